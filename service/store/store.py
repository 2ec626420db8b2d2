"""The daemon's snapshot store: one lock over jobs, ranks, steps, segments and the budget.

Each public method takes the lock and calls one function of the part that owns the
decision (registration, staging, reads, arrivals; retention is pure). A copy handed
to a trainer is hashed outside the lock (on a small thread pool, one task per shard),
pinned meanwhile so that nothing recycles it; a commit's hash, when it has one (no
client checksums, or --verify-on-commit), is computed under the lock: other calls
wait for it (~20 ms per 256 MB on the dev VM). Inputs are validated where the
request enters (rpc/); names reaching the store are well formed.

A store started on a --shm-dir where a killed daemon left its segments
adopts the committed copies first (adoption.py): ``adoption`` says what it
took over, dropped and left alone.

Listeners hear what other parts react to: ``on_local(job, rank, step)``
after a trainer's copy became LOCAL (replication, the durable tier),
``on_job_deleted(job)`` after a whole job was deleted (plans, logs; each
returns whether it held anything of the job), both outside the lock;
``on_retained(job, step)`` with the oldest committed step retention keeps,
under the lock (it must not call the store).
"""

import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor

from bubblesnap.service import answer_segment, phases
from bubblesnap.service.errors import NotFound
from bubblesnap.service.store import adoption, arrivals, reads, registration, staging
from bubblesnap.service.store.adoption import Adoption
from bubblesnap.service.store.layout import Layout
from bubblesnap.service.store.memory import Memory
from bubblesnap.service.store.model import BubbleUsage, lookup
from bubblesnap.service.store.options import StoreOptions
from bubblesnap.service.store.restore_segments import RestoreSegments
from bubblesnap.service.store.segments import shm_free_bytes
from bubblesnap.service.store.state import StoreState
from bubblesnap.service.store.views import (
    Commit,
    HeldCopy,
    JobView,
    MemoryView,
    PinnedCopy,
    RankLayout,
    Registration,
    Restorable,
    Staging,
    held_copies,
    job_view,
    unpushed_copies,
)
from bubblesnap.service.store.warm_pool import WarmPool


class SnapshotStore:
    """Holds every job's snapshots in shared memory, within a memory budget."""

    def __init__(self, shm_dir: str, options: StoreOptions = StoreOptions(),
                 grouped: bool = False):
        """``grouped``: peers decide which steps are committed (the replicator tells)."""
        self.options = options
        self.shm_dir = shm_dir
        self._state = StoreState(options, Memory(shm_dir, options.memory_budget_bytes), grouped,
                                 ThreadPoolExecutor(options.checksum_threads,
                                                    thread_name_prefix="checksum"))
        self._on_local: list = []
        self._on_job_deleted: list = []
        self._lock = threading.Lock()
        with self._lock:
            #: What this store took over from a killed daemon's shm dir when it started.
            self.adoption: Adoption = adoption.adopt(self._state)
        # after adoption: what was taken over counts in the budget before warm segments do
        self._warm = WarmPool(self._lock, self._state.memory, options.warm_pool_bytes)
        #: The segments restores fill (restore_segments.py).
        self.restore_segments = RestoreSegments(self._lock, self._state)

    def listen(self, on_local=None, on_job_deleted=None, on_retained=None) -> None:
        """Adds listeners (see the module docstring)."""
        for listeners, listener in ((self._on_local, on_local),
                                    (self._on_job_deleted, on_job_deleted),
                                    (self._state.on_retained, on_retained)):
            if listener is not None:
                listeners.append(listener)

    # -- a trainer's copies ---------------------------------------------------

    def register(self, job: str, rank: int, world_size: int, layout: Layout,
                 group: tuple[int, ...], others=None) -> Registration:
        """``others``: rank -> (layout, group) of ranks registered at peers, judged with
        the ones here (registration.py)."""
        with self._lock:
            return registration.register(self._state, job, rank, world_size, layout, group,
                                         others or {})

    def begin_step(self, job: str, rank: int, step: int) -> Staging:
        with self._lock:
            return staging.begin(self._state, job, rank, step)

    def commit_step(self, job: str, rank: int, step: int, checksums=(),
                    usage: BubbleUsage = BubbleUsage(), next_step: int | None = None,
                    staged_as: int | None = None) -> Commit:
        with self._lock:
            commit = staging.commit(self._state, job, rank, step, checksums, usage, next_step,
                                    staged_as)
            self._state.release_served(job, rank)
        if commit.newly_local:
            for listener in self._on_local:
                listener(job, rank, step)
        return commit

    def abort_step(self, job: str, rank: int, step: int) -> None:
        with self._lock:
            staging.abort(self._state, job, rank, step)

    def serve(self, job: str, rank: int, step: int, asked_group=()) -> Restorable:
        """Verifies this daemon's copy of ``step`` for ``rank`` (its replica group's
        copier's) and hands it to a trainer."""
        with phases.timed("verify"):
            with self._lock:
                taken = reads.take(self._state, job, rank, step, asked_group)
            return self._verify_and_hand_over(*taken)

    def serve_copy(self, job: str, rank: int, step: int) -> Restorable:
        """Verifies this daemon's copy of ``step`` of ``rank`` and hands it over as it is."""
        with phases.timed("verify"):
            with self._lock:
                taken = reads.take_copy(self._state, job, rank, step)
            return self._verify_and_hand_over(*taken)

    def _verify_and_hand_over(self, copy: PinnedCopy, verified: bool) -> Restorable:
        # Hashed outside the lock, the copy pinned: 131 ms for a 4 GB copy on the dev VM,
        # which every other call (commits, Status, peers' requests) would wait for.
        try:
            computed = copy.checksums if verified else \
                self._state.hash(copy.segment, copy.slots)
        except BaseException:  # the store closing under it: its hashers shut down
            self.unpin(copy)
            raise
        with self._lock:
            return reads.hand_over(self._state, copy, computed)

    def resume(self, job: str, world_size: int, step: int) -> None:
        """The job resumes from ``step`` under ``world_size`` ranks: they may register as
        a new epoch (registration.py)."""
        with self._lock:
            entry = self._state.jobs.get(job)
            if entry is not None and world_size and entry.world_size != world_size:
                entry.resume = (world_size, step)

    # -- copies for and from peers and the durable tier ------------------------

    def copier_of(self, job: str, rank: int, asked_group=()) -> tuple[int, tuple[int, ...]]:
        """The rank whose copies hold ``rank``'s state, and its replica group, as
        registrations here declare it or else as the caller does (``asked_group``)."""
        with self._lock:
            group = registration.agreed_group(job, self._state.jobs.get(job), rank,
                                              asked_group)
        return group[0], group

    def holdings(self, job: str = "") -> list[HeldCopy]:
        """Every LOCAL copy held, of one job or all."""
        with self._lock:
            return [copy for name, entry in sorted(self._state.jobs.items())
                    if not job or name == job for copy in held_copies(name, entry)]

    def unpushed(self, job: str) -> set[tuple[int, int]]:
        """(rank, step) of ``job``'s copies committed here that no peer acknowledged yet:
        new copies waiting for their push, or skipped when replication fell behind."""
        with self._lock:
            entry = self._state.jobs.get(job)
            return unpushed_copies(entry) if entry is not None else set()

    def pin(self, job: str, rank: int, step: int) -> PinnedCopy:
        with self._lock:
            return reads.pin(self._state, job, rank, step)

    def unpin(self, pinned: PinnedCopy) -> None:
        with self._lock:
            self._state.memory.unpin(pinned._held)

    def install(self, job: str, world_size: int, rank: int, step: int, layout: Layout,
                checksums, fill, for_restore: bool = False, group=()) -> int:
        """Stores a copy that arrives from elsewhere (arrivals.py); returns the bytes stored.

        ``fill(view, slots)`` writes the segment's bytes, outside the lock,
        and may return the checksums of the (offset, nbytes) ``slots`` it
        computed on the way (else the store hashes them). DataLoss, and
        nothing kept, when they do not match ``checksums``.
        """
        checksums = tuple(checksums)
        with phases.timed("segment"):
            arrival = self._reserve(job, world_size, rank, step, layout, checksums,
                                    tuple(group) or (rank,))
        if arrival is None:
            return 0
        slots = layout.slots()
        segment = arrival.rank_step.segment
        try:
            if for_restore:  # the caller maps it while the bytes land
                answer_segment.announce(segment.path, segment.nbytes)
            segment.prefault(self.workers)  # fresh pages: every core
            with phases.timed("receive"):
                computed = fill(segment.view, [(o, n) for _, _, o, n in slots])
            with phases.timed("verify"):
                computed = computed or self._state.hash(segment, slots)
        except BaseException:
            with self._lock:
                self._state.memory.arriving -= 1
                arrivals.abandon(self._state, arrival)
            raise
        with phases.timed("land"), self._lock:
            self._state.memory.arriving -= 1
            return arrivals.land(self._state, arrival, computed, for_restore)

    def _reserve(self, job, world_size, rank, step, layout, checksums, group):
        """arrivals.reserve under the lock; while the same copy is arriving already (another
        transfer of it), waits for that one to land or go, then asks again."""
        while True:
            with self._lock:
                try:
                    arrival = arrivals.reserve(self._state, job, world_size, rank, step,
                                               layout, checksums, group)
                except arrivals.ArrivingAlready as other:
                    arriving = other.rank_step
                else:
                    self._state.memory.arriving += arrival is not None
                    return arrival
            while arriving.arriving and arriving.pins and not arriving.released:
                time.sleep(0.01)

    def rollback(self, job: str, step: int) -> int:
        with self._lock:
            return arrivals.rollback(self._state, job, step)

    def mark_replicated(self, job: str, rank: int, step: int) -> None:
        """A peer acknowledged its copy: retention keeps the step until the group commits."""
        with self._lock:
            entry = self._state.jobs.get(job)
            held = entry.ranks.get(rank) if entry else None
            rank_step = held.steps.get(step) if held else None
            if rank_step is not None:
                rank_step.replicated = True

    def set_group_committed(self, job: str, steps, changed=(),
                            gathered_at: float | None = None) -> None:
        """The peer group's committed steps of ``job``, judged on holdings gathered from
        ``gathered_at`` (monotonic; default now); frees what retention lets go.
        ``changed``: steps of which a copy appeared in the group's holdings since they
        were gathered last (their copies' grace before the cap starts again)."""
        gathered_at = time.monotonic() if gathered_at is None else gathered_at
        with self._lock:
            entry = self._state.jobs.get(job)
            if entry is not None:
                for held in entry.ranks.values():
                    for step in set(changed) & set(held.steps):
                        held.steps[step].group_changed = gathered_at
                entry.gathered_at = max(entry.gathered_at, gathered_at)
                entry.group_committed = sorted(steps)
                entry.awaiting_group = False
                self._state.retain(job, entry)

    # -- listing and deleting -------------------------------------------------

    def delete(self, job: str, steps=()) -> int:
        """Deletes the given steps of ``job``; no steps: the whole job, with what the
        ``on_job_deleted`` listeners hold of it (a job only they know, such as one whose
        training-log records a peer handed here, is deleted too). Returns steps deleted."""
        with self._lock:
            deleted = self._delete(job, set(steps))
        held_elsewhere = [listener(job) for listener in self._on_job_deleted] \
            if not steps else []
        if deleted is None and not any(held_elsewhere):
            raise NotFound(f"no job {job!r} is registered with this daemon, and it holds no "
                           "log records of it")
        return deleted or 0

    def _delete(self, job: str, steps: set[int]) -> int | None:
        """None: the job is not held here."""
        entry = self._state.jobs.get(job)
        if entry is None:
            return None
        held_steps = {s for r in entry.ranks.values() for s in r.steps}
        if not steps:
            for held in entry.ranks.values():
                self._state.memory.free_all(held)
            self._state.release_served(job)
            del self._state.jobs[job]
            return len(held_steps)
        missing = sorted(steps - held_steps)
        if missing:
            raise NotFound(f"job {job!r} holds no step {missing}; held: {sorted(held_steps)}")
        for held in entry.ranks.values():
            for step in steps & set(held.steps):
                self._state.memory.free(held, step)
        return len(steps)

    def committed(self, job: str) -> list[int]:
        """The job's committed steps, oldest first (none for a job not held here)."""
        with self._lock:
            entry = self._state.jobs.get(job)
            return list(entry.committed_steps()) if entry is not None else []

    def layouts(self, job: str) -> list[RankLayout]:
        """The layouts of the ranks trainers registered here (not replicas held for peers)."""
        with self._lock:
            entry = self._state.jobs.get(job)
            if entry is None:
                return []
            return [RankLayout(rank, entry.world_size, held.layout, held.group)
                    for rank, held in sorted(entry.ranks.items())
                    if not held.replica and held.layout is not None]

    def describe(self, job: str, rank: int, step: int) -> PinnedCopy:
        """A LOCAL copy's layout and checksums (its segment may be recycled later)."""
        pinned = self.pin(job, rank, step)
        self.unpin(pinned)
        return pinned

    def world_size(self, job: str) -> int:
        with self._lock:
            entry = self._state.jobs.get(job)
            if entry is None:
                raise NotFound(f"no job {job!r} is registered with this daemon; "
                               "call Register first")
            return entry.world_size

    def layout_of(self, job: str, rank: int) -> Layout:
        with self._lock:
            return lookup(self._state.jobs, job, rank)[1].layout

    def slot_bytes(self, job: str, rank: int) -> tuple[tuple[int, int, int], ...]:
        """(tensor, shard, nbytes) of each slot of a registered rank, in slot order."""
        with self._lock:
            _, held = lookup(self._state.jobs, job, rank)
            return tuple((t, s, n) for t, s, _, n in held.slots)

    def job_names(self) -> list[str]:
        """Every job registered or held here, sorted."""
        with self._lock:
            return sorted(self._state.jobs)

    def jobs(self, job: str = "") -> list[JobView]:
        with self._lock:
            if job and job not in self._state.jobs:
                raise NotFound(f"no job {job!r} is registered with this daemon")
            names = [job] if job else sorted(self._state.jobs)
            return [job_view(name, self._state.jobs[name]) for name in names]

    @property
    def workers(self) -> Executor:
        """The threads that hash shards, cut assembled restores, pre-fault fresh segments."""
        return self._state.hashers

    @property
    def heartbeat_path(self) -> str:
        """The file the daemon's heartbeat goes into: its segment directory's lock file."""
        return self._state.memory.pool.lock_path

    def memory(self) -> MemoryView:
        with self._lock:
            memory = self._state.memory
            used, pooled = memory.used_bytes, memory.pool.pooled_bytes
            warm, taken = memory.pool.warm_bytes, memory.pool.warm_taken
        return MemoryView(memory.budget_bytes, used, pooled, memory.pool.directory,
                          shm_free_bytes(self.shm_dir), warm, self._warm.target_bytes, taken,
                          memory.pool.pages)

    def close(self) -> None:
        self._warm.close()
        with self._lock:
            for job in list(self._state.jobs):
                self._state.release_served(job)
            self._state.jobs.clear()
            self._state.memory.close()
        self._state.hashers.shutdown(wait=False)
