"""The daemon's snapshot store: jobs, ranks, steps, segments, budget, retention.

All state changes happen under one lock. Checksums are computed under that
lock too (on a small thread pool, one task per shard): it keeps a segment
from being recycled while it is read, at the cost of other RPCs waiting for
the length of one hash (~20 ms per 256 MB on the dev VM).
"""

import dataclasses
import enum
import threading
from concurrent.futures import ThreadPoolExecutor

from bubblesnap.protos.checksum import checksum
from bubblesnap.service import layout as layout_lib
from bubblesnap.service.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from bubblesnap.service.segments import Segment, SegmentPool, shm_free_bytes


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """How much the store may hold and for how long.

    Attributes:
      memory_budget_bytes: shared memory the store may use, pooled segments
        included. Default 4 GiB.
      keep_steps: committed steps kept per job; older ones are freed once a
        newer step commits. Default 2, so the step before the newest survives
        while the newest is restored. With peers, a rank also keeps at most
        ``keep_steps + 2`` uncommitted copies (see ``_beyond_cap``).
      checksum_threads: threads that hash shards in parallel. Default 2.
      verify_on_commit: re-hash a commit's bytes even when the client sent
        checksums. Off by default: the client hashes the bytes it wrote into
        shared memory inside its bubbles, where the core is idle anyway, and
        every copy is verified again before it is served.
    """

    memory_budget_bytes: int = 4 << 30
    keep_steps: int = 2
    checksum_threads: int = 2
    verify_on_commit: bool = False


class CopyState(enum.Enum):
    STAGING = "STAGING"
    LOCAL = "LOCAL"


@dataclasses.dataclass(frozen=True)
class BubbleUsage:
    """How a rank's copy of a step used its bubbles (reported by the client)."""

    offered_seconds: float = 0.0
    used_seconds: float = 0.0
    spilled_seconds: float = 0.0
    spilled_bytes: int = 0
    bubbles: int = 0
    iterations: int = 0
    overrun_seconds: float = 0.0


@dataclasses.dataclass
class _RankStep:
    segment: Segment
    state: CopyState
    checksums: tuple[int, ...] = ()
    usage: BubbleUsage = BubbleUsage()
    pins: int = 0          # readers outside the lock (replication, durable writes)
    released: bool = False  # freed while pinned: the last unpin disposes of the segment
    replicated: bool = False  # a peer acknowledged a copy (or this is that copy)
    just_verified: bool = False  # installed for a restore and verified; not served since
    arriving: bool = False  # being installed from a peer or the durable tier


@dataclasses.dataclass
class _Rank:
    layout: layout_lib.Layout
    slots: list[tuple[int, int, int, int]]
    #: The rank's replica group, sorted, the rank included: group[0] copies
    #: the state, the other members are held through its copies.
    group: tuple[int, ...]
    steps: dict[int, _RankStep] = dataclasses.field(default_factory=dict)
    replica: bool = False  # held for a peer; no trainer registered it here


@dataclasses.dataclass
class _Job:
    world_size: int
    ranks: dict[int, _Rank] = dataclasses.field(default_factory=dict)
    #: With peers, the steps the peer group has committed (set by the
    #: replicator from every daemon's holdings); None on a lone daemon.
    group_committed: list[int] | None = None

    def committed_steps(self) -> list[int]:
        """Steps committed for the job, oldest first.

        A lone daemon holds every rank: a step is committed when each rank
        holds it LOCAL, a member of a replica group through its copier's
        copy. With peers, the group decides.
        """
        if self.group_committed is not None:
            return self.group_committed
        if len(self.ranks) < self.world_size:
            return []
        common = None
        for copier in {held.group[0] for held in self.ranks.values()}:
            rank = self.ranks.get(copier)
            local = {s for s, rs in rank.steps.items() if rs.state is CopyState.LOCAL} \
                if rank else set()
            common = local if common is None else common & local
        return sorted(common or ())

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The replica group of ``rank`` as a rank held here declared it (the rank
        itself, a member, or a replica of the group's copier); None if none did."""
        held = self.ranks.get(rank)
        if held is not None:
            return held.group
        return next((h.group for h in self.ranks.values() if rank in h.group), None)


@dataclasses.dataclass(frozen=True)
class Registration:
    reattached: bool
    latest_local_step: int
    step_bytes: int


@dataclasses.dataclass(frozen=True)
class Staging:
    segment_path: str
    segment_bytes: int
    slots: tuple[tuple[int, int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Commit:
    job_committed: bool
    latest_committed_step: int
    next: Staging | None = None  # the next step, begun as the commit asked
    newly_local: bool = False    # this call made the copy LOCAL (not a repeated commit)


@dataclasses.dataclass(frozen=True)
class Restorable:
    step: int
    segment_path: str
    slots: tuple[tuple[int, int, int, int], ...]
    checksums: tuple[int, ...]
    layout: layout_lib.Layout


@dataclasses.dataclass(frozen=True)
class ShardView:
    tensor: str
    shard: int
    nbytes: int
    checksum: int


@dataclasses.dataclass(frozen=True)
class RankStepView:
    rank: int
    state: CopyState
    nbytes: int
    shards: tuple[ShardView, ...]
    usage: BubbleUsage
    replica: bool
    held_for: tuple[int, ...] = ()  # the rest of its replica group, held through this copy


@dataclasses.dataclass(frozen=True)
class StepView:
    step: int
    committed: bool
    ranks: tuple[RankStepView, ...]


@dataclasses.dataclass(frozen=True)
class JobView:
    job: str
    world_size: int
    registered_ranks: tuple[int, ...]
    latest_committed_step: int
    steps: tuple[StepView, ...]


@dataclasses.dataclass(frozen=True)
class HeldCopy:
    """A committed (LOCAL) copy this daemon holds, as peers see it."""

    job: str
    rank: int
    step: int
    replica: bool
    world_size: int
    group: tuple[int, ...] = ()  # the ranks this copy holds (its replica group)


@dataclasses.dataclass(frozen=True)
class PinnedCopy:
    """A LOCAL copy that stays intact (not recycled) until :meth:`SnapshotStore.unpin`."""

    job: str
    rank: int
    step: int
    world_size: int
    segment: Segment
    layout: layout_lib.Layout
    slots: tuple[tuple[int, int, int, int], ...]
    checksums: tuple[int, ...]
    group: tuple[int, ...] = ()
    _held: "_RankStep" = dataclasses.field(repr=False, compare=False, default=None)


@dataclasses.dataclass(frozen=True)
class MemoryView:
    budget_bytes: int
    used_bytes: int
    pooled_bytes: int
    shm_dir: str
    shm_free_bytes: int


class SnapshotStore:
    """Holds every job's snapshots in shared memory, within a memory budget."""

    def __init__(self, shm_dir: str, options: StoreOptions = StoreOptions(),
                 grouped: bool = False, on_retained=None):
        """``on_retained(job, step)`` hears the oldest committed step retention keeps
        each time retention runs (from a commit here or the peer group's), with the
        store's lock held: it must not call back into the store."""
        self.options = options
        self.grouped = grouped  # peers decide what is committed
        self._on_retained = on_retained
        self.shm_dir = shm_dir
        self._pool = SegmentPool(shm_dir)
        self._jobs: dict[str, _Job] = {}
        self._lingering: list[_RankStep] = []  # freed, but a pinned reader still has it
        self._lock = threading.Lock()
        self._hashers = ThreadPoolExecutor(max(1, options.checksum_threads),
                                           thread_name_prefix="checksum")

    # -- registration -------------------------------------------------------

    def register(self, job: str, rank: int, world_size: int, tensors,
                 replica_group=()) -> Registration:
        """Declares one rank's layout and replica group (see RegisterRequest)."""
        layout_lib.check_job_name(job)
        layout_lib.check_world(rank, world_size)
        layout = layout_lib.build_layout(tensors)
        group = layout_lib.check_replica_group(rank, world_size, replica_group)
        with self._lock:
            entry = self._jobs.get(job)
            if entry is not None and entry.world_size != world_size:
                raise FailedPrecondition(
                    f"job {job!r} is registered with world_size {entry.world_size}, "
                    f"not {world_size}; delete the job's snapshots to start it over")
            if entry is not None:
                _check_group_agrees(job, entry, rank, group, layout)
            else:
                entry = self._new_job(job, world_size)
            held = entry.ranks.get(rank)
            if held is not None and held.replica:
                # A trainer takes over a rank this daemon held replicas of
                # (a replacement host): the replicas become its own copies.
                if held.layout != layout:
                    for step in list(held.steps):
                        self._free(held, step)
                    held = entry.ranks[rank] = _Rank(layout, layout.slots(), group)
                held.replica = False
                held.group = group
            if held is not None:
                if held.layout != layout:
                    raise AlreadyExists(
                        f"rank {rank} of job {job!r} is already registered with a different "
                        f"state layout ({_describe_difference(held.layout, layout)}); use a new "
                        "job name or delete this job's snapshots first")
                # A restarted trainer: keep what is committed, drop its unfinished copies.
                for step in [s for s, rs in held.steps.items() if rs.state is CopyState.STAGING]:
                    self._free(held, step)
                return Registration(True, _latest_local(held), layout.segment_bytes)
            entry.ranks[rank] = _Rank(layout, layout.slots(), group)
            return Registration(False, -1, layout.segment_bytes)

    # -- staging and commit -------------------------------------------------

    def begin_step(self, job: str, rank: int, step: int) -> Staging:
        layout_lib.check_step(step)
        with self._lock:
            entry, held = self._rank(job, rank)
            if held.group[0] != rank:
                raise FailedPrecondition(
                    f"rank {rank} of job {job!r} is held through rank {held.group[0]}'s copies "
                    f"(replica group {list(held.group)}): it has nothing to copy; only rank "
                    f"{held.group[0]} snapshots this state")
            return self._begin(job, rank, entry, held, step)

    def _begin(self, job: str, rank: int, entry: _Job, held: _Rank, step: int) -> Staging:
        """BeginStep with the lock held."""
        existing = held.steps.get(step)
        if existing is not None:
            if existing.state is CopyState.STAGING:
                return self._staging(held, existing)
            if step in entry.committed_steps():
                raise FailedPrecondition(
                    f"step {step} of job {job!r} is already committed; snapshot a later step")
            # A LOCAL copy that never committed job-wide, left by an earlier
            # incarnation of this rank: the new copy replaces it.
            self._free(held, step)
        committed = entry.committed_steps()
        kept = committed[-self.options.keep_steps:]
        if kept and len(kept) == self.options.keep_steps and step < kept[0]:
            raise FailedPrecondition(
                f"step {step} of job {job!r} is older than every step retention keeps "
                f"(committed: {committed}); it would be dropped as soon as it commits. "
                "A new run under an old job name? Delete the job's snapshots or use a new "
                "job name")
        # Unfinished copies of this rank are abandoned (a crashed trainer), except the
        # newest: its commit may still be on its way, overtaken by this call.
        staging = sorted(s for s, rs in held.steps.items() if rs.state is CopyState.STAGING)
        for stale in staging[:-1]:
            self._free(held, stale)
        segment = self._acquire(job, rank, step, held.layout.segment_bytes)
        rank_step = held.steps[step] = _RankStep(segment, CopyState.STAGING)
        return self._staging(held, rank_step)

    def commit_step(self, job: str, rank: int, step: int, checksums=(),
                    usage: BubbleUsage = BubbleUsage(), next_step: int | None = None) -> Commit:
        """Commits a staged step; with ``next_step`` (> step) also begins that one.

        Beginning the next step here, in the same call, saves the client a
        BeginStep round trip inside its next bubble. If the next step cannot
        begin (no memory), the commit stands and ``next`` is None.
        """
        if next_step is not None and next_step <= step:
            raise InvalidArgument(f"next step {next_step} must come after step {step}")
        with self._lock:
            entry, held = self._rank(job, rank)
            rank_step = held.steps.get(step)
            if rank_step is None:
                raise NotFound(
                    f"rank {rank} of job {job!r} has no step {step} being staged; "
                    "call BeginStep first (the copy may have been aborted by a newer BeginStep "
                    "or a re-registration)")
            if rank_step.state is CopyState.LOCAL:
                return self._commit_result(job, rank, entry, held, step, next_step)
            if checksums and len(checksums) != len(held.slots):
                raise InvalidArgument(
                    f"{len(checksums)} checksums for {len(held.slots)} shards; send one per "
                    "slot, in the order BeginStep returned, or none to let the daemon compute them")
            if checksums and not self.options.verify_on_commit:
                computed = tuple(checksums)  # verified before every serve instead
            else:
                computed = self._hash(rank_step.segment, held.slots)
            if checksums:
                bad = _mismatches(checksums, computed)
                if bad:
                    self._free(held, step)
                    names = _slot_names(held, bad)
                    raise DataLoss(
                        f"step {step} of rank {rank}: the bytes in shared memory do not match the "
                        f"client's checksums for {names}; the copy was dropped, snapshot again")
            rank_step.checksums = computed
            rank_step.usage = usage
            rank_step.state = CopyState.LOCAL
            self._retain(job, entry)
            return dataclasses.replace(
                self._commit_result(job, rank, entry, held, step, next_step), newly_local=True)

    def abort_step(self, job: str, rank: int, step: int) -> None:
        with self._lock:
            _, held = self._rank(job, rank)
            rank_step = held.steps.get(step)
            if rank_step is None:
                raise NotFound(f"rank {rank} of job {job!r} has no step {step}")
            if rank_step.state is not CopyState.STAGING:
                raise FailedPrecondition(
                    f"step {step} of rank {rank} is already {rank_step.state.value}; "
                    "use DeleteSnapshots to drop committed steps")
            self._free(held, step)

    # -- restore ------------------------------------------------------------

    def restore(self, job: str, rank: int, step: int | None = None,
                chosen_by_group: bool = False, replica_group=()) -> Restorable:
        """Verifies a committed step and hands its segment to the client.

        The client may keep arrays that alias the segment (zero-copy on the
        CPU backend), so a segment once restored from is never recycled: when
        retention frees it, it is unlinked, and its memory lives on only as
        long as the client maps it.

        A member of a replica group gets its copier's copy (``replica_group``
        is the caller's, for a rank no registration here declared).
        ``chosen_by_group``: the step was chosen from every peer's holdings
        (tiers.py); it only has to be held LOCAL here. NotFound otherwise.
        """
        with self._lock:
            entry, held = self._copier(job, rank, replica_group)
            committed = entry.committed_steps()
            if chosen_by_group:
                rank_step = held.steps.get(step)
                if rank_step is None or rank_step.state is not CopyState.LOCAL:
                    raise NotFound(f"this daemon holds no copy of step {step} of rank "
                                   f"{held.group[0]}")
            elif step is None:
                if not committed:
                    raise NotFound(
                        f"job {job!r} has no committed step yet: "
                        f"{_progress(entry)}")
                step = committed[-1]
            elif step not in committed:
                if any(step in r.steps for r in entry.ranks.values()):
                    raise FailedPrecondition(
                        f"step {step} of job {job!r} is not committed: {_progress(entry, step)}; "
                        f"committed steps: {committed or 'none'}")
                raise NotFound(
                    f"job {job!r} holds no step {step}; committed steps: {committed or 'none'}")
            rank_step = held.steps[step]
            # A copy verified as it arrived (a moment ago, restore from a peer or
            # disk) is not read a second time.
            computed = rank_step.checksums if rank_step.just_verified else \
                self._hash(rank_step.segment, held.slots)
            rank_step.just_verified = False
            bad = _mismatches(rank_step.checksums, computed)
            if bad:
                names = _slot_names(held, bad)
                self._free(held, step)
                raise DataLoss(
                    f"step {step} of rank {rank} failed its checksum on {names}: the copy was "
                    f"corrupted in memory and has been discarded; committed steps left: "
                    f"{entry.committed_steps() or 'none'}")
            rank_step.segment.handed_out = True
            return Restorable(step, rank_step.segment.path, tuple(held.slots),
                              rank_step.checksums, held.layout)

    # -- peers: replicas, holdings, pinned reads ------------------------------

    def copier_of(self, job: str, rank: int, world_size: int,
                  replica_group=()) -> tuple[int, tuple[int, ...]]:
        """The rank whose copies hold ``rank``'s state, and its replica group, as
        registrations here declare it or else as the caller does."""
        layout_lib.check_job_name(job)
        asked = layout_lib.check_replica_group(rank, world_size, replica_group) \
            if replica_group else ()
        with self._lock:
            entry = self._jobs.get(job)
            group = _agreed_group(job, entry, rank, asked)
        return group[0], group

    def holdings(self, job: str = "") -> list[HeldCopy]:
        """Every LOCAL copy held, of one job or all."""
        if job:
            layout_lib.check_job_name(job)
        with self._lock:
            return [HeldCopy(name, rank, step, held.replica, entry.world_size, held.group)
                    for name, entry in sorted(self._jobs.items()) if not job or name == job
                    for rank, held in sorted(entry.ranks.items())
                    for step, rank_step in sorted(held.steps.items())
                    if rank_step.state is CopyState.LOCAL]

    def world_size(self, job: str) -> int:
        layout_lib.check_job_name(job)
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                raise NotFound(f"no job {job!r} is registered with this daemon; "
                               "call Register first")
            return entry.world_size

    def layout_of(self, job: str, rank: int) -> layout_lib.Layout:
        with self._lock:
            return self._rank(job, rank)[1].layout

    def pin(self, job: str, rank: int, step: int) -> PinnedCopy:
        """Keeps a LOCAL copy's segment intact for a reader outside the lock."""
        with self._lock:
            entry, held = self._rank(job, rank)
            rank_step = held.steps.get(step)
            if rank_step is None or rank_step.state is not CopyState.LOCAL:
                raise NotFound(f"this daemon holds no committed copy of step {step} of rank "
                               f"{rank} of job {job!r}")
            rank_step.pins += 1
            return PinnedCopy(job, rank, step, entry.world_size, rank_step.segment, held.layout,
                              tuple(held.slots), rank_step.checksums, held.group, rank_step)

    def unpin(self, pinned: PinnedCopy) -> None:
        with self._lock:
            self._unpin(pinned._held)

    def install(self, job: str, world_size: int, rank: int, step: int, layout, checksums,
                fill, for_restore: bool = False, replica_group=()) -> int:
        """Stores a copy that arrives from elsewhere (a peer, the durable tier).

        ``fill(view, slots)`` writes the segment's bytes, outside the lock,
        and may return the checksums of the (offset, nbytes) ``slots`` it
        computed on the way (else the store hashes them). They are compared
        with ``checksums`` before the copy counts.
        A rank no trainer registered here is held as a replica, of the ranks
        in ``replica_group``, until one does. An existing copy with other
        checksums (an abandoned run's) is replaced. ``for_restore``: the copy
        is served right away, without a second hash. Returns the bytes
        stored; DataLoss (and nothing kept) when a checksum fails.
        """
        layout_lib.check_job_name(job)
        layout_lib.check_world(rank, world_size)
        layout_lib.check_step(step)
        group = layout_lib.check_replica_group(rank, world_size, replica_group)
        slots = layout.slots()
        if len(checksums) != len(slots):
            raise InvalidArgument(f"{len(checksums)} checksums for {len(slots)} shards")
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                entry = self._new_job(job, world_size)
            if entry.world_size != world_size:
                raise FailedPrecondition(
                    f"job {job!r} has world_size {entry.world_size} here, not {world_size}")
            held = entry.ranks.get(rank)
            if held is None:
                held = entry.ranks[rank] = _Rank(layout, slots, group, replica=True)
            elif held.layout != layout:
                if not held.replica:
                    raise FailedPrecondition(
                        f"rank {rank} of job {job!r} is registered here with a different "
                        f"layout ({_describe_difference(held.layout, layout)})")
                for old in list(held.steps):
                    self._free(held, old)
                held = entry.ranks[rank] = _Rank(layout, slots, group, replica=True)
            elif held.replica:
                held.group = group
            existing = held.steps.get(step)
            if existing is not None and existing.state is CopyState.LOCAL and \
                    existing.checksums == tuple(checksums):
                return 0
            if existing is not None:
                self._free(held, step)
            segment = self._acquire(job, rank, step, layout.segment_bytes)
            rank_step = held.steps[step] = _RankStep(segment, CopyState.STAGING, pins=1,
                                                     arriving=True)
        try:
            computed = fill(segment.view, [(o, n) for _, _, o, n in slots]) \
                or self._hash(segment, slots)
        except BaseException:
            with self._lock:
                if held.steps.get(step) is rank_step:
                    self._free(held, step)
                self._unpin(rank_step)
            raise
        with self._lock:
            self._unpin(rank_step)
            if held.steps.get(step) is not rank_step:  # deleted meanwhile
                raise NotFound(f"step {step} of rank {rank} was deleted while it arrived")
            bad = _mismatches(checksums, computed)
            if bad:
                names = _slot_names(held, bad)
                self._free(held, step)
                raise DataLoss(f"step {step} of rank {rank} of job {job!r}: checksum mismatch on "
                               f"{names}; the copy was dropped")
            rank_step.checksums = tuple(checksums)
            rank_step.state = CopyState.LOCAL
            rank_step.replicated = True
            rank_step.arriving = False
            rank_step.just_verified = for_restore
            self._retain(job, entry)
            return layout.nbytes

    def rollback(self, job: str, step: int) -> int:
        """Drops every copy of ``job`` newer than ``step`` (the job resumes from it).

        Returns the copies dropped. A trainer's unfinished (STAGING) copies
        are kept: a resumed trainer may already be writing its next step;
        copies still arriving from a peer are dropped (the old run's).
        """
        layout_lib.check_job_name(job)
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                return 0
            dropped = 0
            for held in entry.ranks.values():
                for later in [s for s, rs in held.steps.items()
                              if s > step and (rs.state is CopyState.LOCAL or rs.arriving)]:
                    self._free(held, later)
                    dropped += 1
            if entry.group_committed is not None:
                entry.group_committed = [s for s in entry.group_committed if s <= step]
            return dropped

    def mark_replicated(self, job: str, rank: int, step: int) -> None:
        """A peer acknowledged its copy: retention keeps the step until the group commits."""
        with self._lock:
            entry = self._jobs.get(job)
            held = entry.ranks.get(rank) if entry else None
            rank_step = held.steps.get(step) if held else None
            if rank_step is not None:
                rank_step.replicated = True

    def set_group_committed(self, job: str, steps) -> None:
        """The peer group's committed steps of ``job``; frees what retention lets go."""
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                return
            entry.group_committed = sorted(steps)
            self._retain(job, entry)

    # -- listing and deleting -----------------------------------------------

    def delete(self, job: str, steps=()) -> int:
        """Deletes the given steps of ``job``; no steps: the whole job. Returns steps deleted."""
        layout_lib.check_job_name(job)
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                raise NotFound(f"no job {job!r} is registered with this daemon")
            held_steps = {s for r in entry.ranks.values() for s in r.steps}
            if not steps:
                for held in entry.ranks.values():
                    for step in list(held.steps):
                        self._free(held, step)
                del self._jobs[job]
                return len(held_steps)
            missing = sorted(set(steps) - held_steps)
            if missing:
                raise NotFound(f"job {job!r} holds no step {missing}; held: {sorted(held_steps)}")
            for held in entry.ranks.values():
                for step in set(steps) & set(held.steps):
                    self._free(held, step)
            return len(set(steps))

    def slot_bytes(self, job: str, rank: int) -> tuple[tuple[int, int, int], ...]:
        """(tensor, shard, nbytes) of each slot of a registered rank, in slot order."""
        with self._lock:
            _, held = self._rank(job, rank)
            return tuple((t, s, n) for t, s, _, n in held.slots)

    def job_names(self) -> list[str]:
        """Every job registered or held here, sorted."""
        with self._lock:
            return sorted(self._jobs)

    def jobs(self, job: str = "") -> list[JobView]:
        if job:
            layout_lib.check_job_name(job)
        with self._lock:
            if job and job not in self._jobs:
                raise NotFound(f"no job {job!r} is registered with this daemon")
            names = [job] if job else sorted(self._jobs)
            return [self._job_view(name, self._jobs[name]) for name in names]

    def memory(self) -> MemoryView:
        with self._lock:
            used = self._used_bytes()
        return MemoryView(self.options.memory_budget_bytes, used, self._pool.pooled_bytes,
                          self._pool.directory, shm_free_bytes(self.shm_dir))

    def close(self) -> None:
        with self._lock:
            self._jobs.clear()
            self._pool.close()
        self._hashers.shutdown(wait=False)

    # -- internals (call with the lock held) ---------------------------------

    def _rank(self, job: str, rank: int) -> tuple[_Job, _Rank]:
        layout_lib.check_job_name(job)
        layout_lib.check_rank(rank)
        entry = self._jobs.get(job)
        if entry is None:
            raise NotFound(f"no job {job!r} is registered with this daemon; call Register first")
        held = entry.ranks.get(rank)
        if held is None:
            raise NotFound(f"rank {rank} of job {job!r} is not registered; "
                           f"registered ranks: {sorted(entry.ranks)}")
        return entry, held

    def _used_bytes(self) -> int:
        held = sum(rs.segment.nbytes for e in self._jobs.values()
                   for r in e.ranks.values() for rs in r.steps.values())
        return held + sum(rs.segment.nbytes for rs in self._lingering)

    def _acquire(self, job: str, rank: int, step: int, nbytes: int) -> Segment:
        budget = self.options.memory_budget_bytes
        over = self._used_bytes() + self._pool.pooled_bytes + nbytes - budget
        if over > 0 and not self._pool.has(nbytes):
            self._pool.trim(over)
            used = self._used_bytes()
            if used + self._pool.pooled_bytes + nbytes > budget:
                raise ResourceExhausted(
                    f"no room for step {step} of job {job!r} rank {rank}: it needs {nbytes} "
                    f"bytes and the daemon holds {used} of its {budget}-byte memory budget. "
                    "Raise --memory-budget, lower --keep, or delete snapshots; "
                    "everything already held is kept")
        return self._pool.acquire(nbytes)

    def _new_job(self, job: str, world_size: int) -> _Job:
        entry = self._jobs[job] = _Job(world_size, group_committed=[] if self.grouped else None)
        return entry

    def _copier(self, job: str, rank: int, replica_group=()) -> tuple[_Job, _Rank]:
        """The job and the held rank whose copies serve ``rank`` (itself, or the copier of
        its replica group, which must have the layout ``rank`` registered here)."""
        layout_lib.check_job_name(job)
        layout_lib.check_rank(rank)
        entry = self._jobs.get(job)
        if entry is None:
            raise NotFound(f"no job {job!r} is registered with this daemon; call Register first")
        asked = layout_lib.check_replica_group(rank, entry.world_size, replica_group) \
            if replica_group else ()
        group = _agreed_group(job, entry, rank, asked)
        if group[0] == rank:
            return self._rank(job, rank)
        copier = entry.ranks.get(group[0])
        if copier is None:
            raise NotFound(f"rank {rank} of job {job!r} is held through rank {group[0]}'s copies "
                           f"(replica group {list(group)}), and this daemon holds no copy of "
                           f"rank {group[0]}; registered ranks: {sorted(entry.ranks)}")
        layout_lib.check_held_for(job, rank, group[0], copier.group)
        own = entry.ranks.get(rank)
        if own is not None and own.layout != copier.layout:
            difference = _describe_difference(copier.layout, own.layout)
            raise FailedPrecondition(
                f"rank {rank} of job {job!r} registered a layout that differs from the copy of "
                f"rank {group[0]} it is held through ({difference}); replicas hold identical "
                "state: check the replica group or the shardings")
        return entry, copier

    def _free(self, held: _Rank, step: int) -> None:
        rank_step = held.steps.pop(step)
        if rank_step.pins:
            rank_step.released = True  # the last unpin disposes of it
            self._lingering.append(rank_step)  # still memory: counted in the budget
            return
        self._dispose(rank_step.segment, rank_step.state is CopyState.STAGING)

    def _unpin(self, rank_step: _RankStep) -> None:
        rank_step.pins -= 1
        if rank_step.released and rank_step.pins == 0:
            self._lingering.remove(rank_step)
            self._dispose(rank_step.segment, rank_step.state is CopyState.STAGING)

    def _dispose(self, segment: Segment, staging: bool) -> None:
        # A segment someone may still write into (an unfinished copy) or read from
        # (a restore) is never handed to another step: it is unlinked instead.
        if segment.handed_out or staging:
            segment.destroy()
        else:
            self._pool.release(segment)

    def _retain(self, job: str, entry: _Job) -> None:
        committed = entry.committed_steps()
        keep = self.options.keep_steps
        floor = committed[-keep:][0] if committed else -1
        for held in entry.ranks.values():
            too_many = _beyond_cap(held, keep) - set(committed[-keep:]) if self.grouped \
                else set()
            for step in [s for s in held.steps if s < floor or s in too_many]:
                self._free(held, step)
        if self._on_retained is not None and floor >= 0:
            self._on_retained(job, floor)

    def _hash(self, segment: Segment, slots) -> tuple[int, ...]:
        views = [segment.view[off:off + n] for _, _, off, n in slots]
        return tuple(self._hashers.map(checksum, views))

    def _staging(self, held: _Rank, rank_step: _RankStep) -> Staging:
        return Staging(rank_step.segment.path, rank_step.segment.nbytes, tuple(held.slots))

    def _commit_result(self, job: str, rank: int, entry: _Job, held: _Rank, step: int,
                       next_step: int | None) -> Commit:
        committed = entry.committed_steps()
        staging = None
        if next_step is not None:
            try:
                staging = self._begin(job, rank, entry, held, next_step)
            except (ResourceExhausted, FailedPrecondition):
                staging = None
        return Commit(step in committed, committed[-1] if committed else -1, staging)

    def _job_view(self, name: str, entry: _Job) -> JobView:
        committed = set(entry.committed_steps())
        steps = sorted({s for r in entry.ranks.values() for s in r.steps})
        views = []
        for step in steps:
            ranks = []
            for rank, held in sorted(entry.ranks.items()):
                rank_step = held.steps.get(step)
                if rank_step is None:
                    continue
                shards = tuple(
                    ShardView(held.layout.tensors[t].name, s, n,
                              rank_step.checksums[i] if rank_step.checksums else 0)
                    for i, (t, s, _, n) in enumerate(held.slots))
                ranks.append(RankStepView(rank, rank_step.state, held.layout.nbytes, shards,
                                          rank_step.usage, held.replica,
                                          tuple(m for m in held.group if m != rank)))
            views.append(StepView(step, step in committed, tuple(ranks)))
        return JobView(name, entry.world_size, tuple(sorted(entry.ranks)),
                       max(committed, default=-1), tuple(views))


def _latest_local(held: _Rank) -> int:
    return max((s for s, rs in held.steps.items() if rs.state is CopyState.LOCAL), default=-1)


def _progress(entry: _Job, step: int | None = None) -> str:
    missing = [r for r in range(entry.world_size) if r not in entry.ranks]
    parts = [f"ranks {missing} have not registered"] if missing else []
    copiers = sorted((r, h) for r, h in entry.ranks.items() if h.group[0] == r)
    if step is not None:
        waiting = [r for r, held in copiers
                   if step not in held.steps or held.steps[step].state is not CopyState.LOCAL]
        if waiting:
            parts.append(f"ranks {waiting} have not finished it")
    else:
        latest = {r: _latest_local(h) for r, h in copiers}
        parts.append(f"latest local step per copying rank: {latest}")
    return "; ".join(parts)


def _check_group_agrees(job: str, entry: _Job, rank: int, group: tuple[int, ...],
                        layout: layout_lib.Layout) -> None:
    """Ranks registered here that share a replica group with ``rank`` (itself
    included) declared the same group and, being replicas, the same layout."""
    for other, held in sorted(entry.ranks.items()):
        if held.replica or not set(held.group) & set(group):
            continue
        if held.group != group:
            who = "it was" if other == rank else f"rank {other} was"
            raise FailedPrecondition(
                f"rank {rank} of job {job!r} declares replica group {list(group)}, but {who} "
                f"registered with replica group {list(held.group)}; every member of a "
                "data-parallel group must declare the same ranks. Fix the groups, or delete "
                "the job's snapshots to change them")
        if other != rank and held.layout != layout:
            raise FailedPrecondition(
                f"rank {rank} of job {job!r} declares rank {other} a replica (group "
                f"{list(group)}), but their state layouts differ "
                f"({_describe_difference(held.layout, layout)}); replicas hold identical "
                "state: check the replica group or the shardings")


def _agreed_group(job: str, entry: _Job | None, rank: int,
                  asked: tuple[int, ...]) -> tuple[int, ...]:
    """The replica group of ``rank``: as declared here, else ``asked``, else alone."""
    known = entry.group_of(rank) if entry is not None else None
    if known and asked and known != asked:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} is asked for with replica group {list(asked)}, but it "
            f"was registered with {list(known)}; pass the group the trainers register")
    return known or asked or (rank,)


def _mismatches(expected, computed) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(expected, computed, strict=True)) if a != b]


def _slot_names(held: _Rank, indices) -> str:
    return ", ".join(f"{held.layout.tensors[held.slots[i][0]].name!r} shard {held.slots[i][1]}"
                     for i in indices)


def _describe_difference(a: layout_lib.Layout, b: layout_lib.Layout) -> str:
    names_a = [t.name for t in a.tensors]
    names_b = [t.name for t in b.tensors]
    if names_a != names_b:
        return f"tensors {names_a[:4]}... vs {names_b[:4]}..."
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        if ta != tb:
            return (f"tensor {ta.name!r}: {ta.dtype}{list(ta.global_shape)} in {len(ta.shards)} "
                    f"shards vs {tb.dtype}{list(tb.global_shape)} in {len(tb.shards)} shards")
    return "same tensors, different shards"


def _beyond_cap(held: _Rank, keep_steps: int) -> set[int]:
    """LOCAL steps past what a rank keeps while the group has not committed them.

    Memory must not grow without bound when the group commits nothing (peers
    down, or replication behind training). A rank keeps its newest
    ``keep_steps + 2`` copies, and also its newest ``keep_steps`` replicated
    ones: under load, replication takes a few chosen steps (replicator.py),
    which stand a chance to be committed once the other ranks' copies of
    them are replicated too. (The group's kept committed steps are never
    freed by this cap: see ``_retain``.)
    """
    local = sorted(s for s, rs in held.steps.items() if rs.state is CopyState.LOCAL)
    replicated = [s for s in local if held.steps[s].replicated]
    return set(local[:-(keep_steps + 2)]) - set(replicated[-keep_steps:])
