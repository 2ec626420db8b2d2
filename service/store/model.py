"""The store's data model: jobs, their ranks, and each rank's copies of steps.

A job has ``world_size`` ranks in its current epoch. Each rank registered
(or held for a peer) here has the layout its next copies take, and a copy
per step: STAGING while a trainer or a peer writes it, LOCAL once its
checksums are known. A copy keeps the layout, world size and replica group
it was taken with: after a restore onto another topology the job snapshots
on as a new epoch (another world size, other layouts) while the older
copies stay restorable. Plain mutable records; every change happens under
the store's lock (store.py).
"""

import dataclasses
import enum
import functools
import time

from bubblesnap.service.errors import NotFound
from bubblesnap.service.store import regions
from bubblesnap.service.store.layout import Layout
from bubblesnap.service.store.segments import Segment


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
class RankStep:
    """One rank's copy of one step, with the layout, world size and group it was taken with."""

    segment: Segment
    state: CopyState
    layout: Layout
    world_size: int
    #: The ranks this copy holds (its replica group, sorted, the rank included).
    group: tuple[int, ...]
    checksums: tuple[int, ...] = ()
    usage: BubbleUsage = BubbleUsage()
    pins: int = 0          # readers outside the lock (replication, durable writes)
    released: bool = False  # freed while pinned: the last unpin disposes of the segment
    replicated: bool = False  # a peer acknowledged a copy (or this is that copy)
    just_verified: bool = False  # installed for a restore and verified; not served since
    arriving: bool = False  # being installed from a peer or the durable tier
    incoming: tuple[int, ...] = ()  # an arriving copy's checksums, before they are checked
    local_since: float = 0.0  # when it became LOCAL (time.monotonic())
    group_changed: float = 0.0  # when a copy of this step last appeared in the group's view

    @property
    def local(self) -> bool:
        return self.state is CopyState.LOCAL

    def make_local(self, checksums: tuple[int, ...]) -> None:
        self.checksums, self.state, self.local_since = checksums, CopyState.LOCAL, \
            time.monotonic()

    @functools.cached_property
    def slots(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(self.layout.slots())

    def slot_names(self, indices) -> str:
        """The slots at ``indices`` as a person reads them: 'w' shard 0, ..."""
        return ", ".join(f"{self.layout.tensors[self.slots[i][0]].name!r} shard "
                         f"{self.slots[i][1]}" for i in indices)


@dataclasses.dataclass
class Rank:
    """One rank of a job as this daemon holds it.

    ``layout`` and ``group`` are what the rank registered in the job's current
    epoch (a replica held for a peer: what its last copy had); ``layout`` is
    None for a rank of an earlier epoch that has not registered in this one.
    """

    layout: Layout | None
    #: The rank's replica group, sorted, the rank included: group[0] copies
    #: the state, the other members are held through its copies.
    group: tuple[int, ...]
    steps: dict[int, RankStep] = dataclasses.field(default_factory=dict)
    replica: bool = False  # held for a peer; no trainer registered it here

    @property
    def slots(self) -> list[tuple[int, int, int, int]]:
        return self.layout.slots() if self.layout is not None else []

    def local_steps(self) -> list[int]:
        return sorted(s for s, rs in self.steps.items() if rs.local)

    def latest_local(self) -> int:
        return max(self.local_steps(), default=-1)


@dataclasses.dataclass
class Job:
    world_size: int
    ranks: dict[int, Rank] = dataclasses.field(default_factory=dict)
    #: With peers, the steps the peer group has committed (set by the
    #: replicator from every daemon's holdings); None on a lone daemon.
    group_committed: list[int] | None = None
    #: (world size, step): a restore resumed the job from ``step`` for callers
    #: of that world size, whose ranks may register as a new epoch.
    resume: tuple[int, int] | None = None
    #: Adopted after a restart, with peers: the group's committed steps are not
    #: known yet, and retention must not free a copy the group still counts.
    awaiting_group: bool = False
    #: With peers: when the latest gathering of the group's holdings began (monotonic
    #: seconds). The cap on uncommitted copies counts its grace to then, not to now: a
    #: replicator busy pushing gathers nothing, and its view must not age into frees.
    gathered_at: float = float("-inf")

    def committed_steps(self) -> list[int]:
        """Steps committed for the job, oldest first.

        A lone daemon holds every rank: a step is committed when every rank
        of the world size its copies were taken with holds it LOCAL (a member
        of a replica group through its copier's copy) and the copies' regions
        cover every job-wide array. With peers, the group decides.
        """
        if self.group_committed is not None:
            return self.group_committed
        by_step: dict[int, dict[int, RankStep]] = {}
        for rank, held in self.ranks.items():
            for step, rank_step in held.steps.items():
                if rank_step.local:
                    by_step.setdefault(step, {})[rank] = rank_step
        return sorted(s for s, copies in by_step.items() if whole(copies))

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The replica group of ``rank`` as a rank held here declared it (the rank
        itself, a member, or a replica of the group's copier); None if none did."""
        held = self.ranks.get(rank)
        if held is not None:
            return held.group
        return next((h.group for h in self.ranks.values() if rank in h.group), None)


def whole(copies: dict[int, RankStep]) -> bool:
    """Whether one step's copies (rank -> copy) hold the whole job: one world size, every
    rank held (itself or through its group's copier), every job-wide array covered."""
    worlds = {c.world_size for c in copies.values()}
    if len(worlds) != 1:
        return False
    held = {member for rank, c in copies.items() for member in (rank, *c.group)}
    if not held >= set(range(worlds.pop())):
        return False
    layouts = tuple(c.layout for _, c in sorted(copies.items()))
    return conflict(layouts) is None and not uncovered(layouts)


@functools.lru_cache(maxsize=256)
def uncovered(layouts: tuple[Layout, ...]) -> tuple[str, ...]:
    """The regions of job-wide arrays that no layout of ``layouts`` copies, described for
    a person (at most 8)."""
    shapes: dict[str, tuple[int, ...]] = {}
    boxes: dict[str, list] = {}
    for layout in layouts:
        for tensor in layout.tensors:
            if tensor.job_wide:
                shapes[tensor.name] = tensor.global_shape
                boxes.setdefault(tensor.name, []).extend(s.index for s in tensor.shards)
    gaps = []
    for name, shape in sorted(shapes.items()):
        try:
            gap = regions.missing(shape, boxes[name])
        except regions.TooFragmented:  # never judged whole: refused where it registers
            gaps.append(f"{name!r} (its regions are too fragmented to check)")
            continue
        if gap is not None:
            gaps.append(regions.describe(name, gap))
    return tuple(gaps[:8])


def conflict(layouts: tuple[Layout, ...]) -> str | None:
    """A job-wide array the layouts declare with different dtypes or global shapes."""
    declared: dict[str, tuple] = {}
    for layout in layouts:
        for tensor in layout.tensors:
            if tensor.job_wide:
                kind = (tensor.dtype, tensor.global_shape)
                if declared.setdefault(tensor.name, kind) != kind:
                    return (f"{tensor.name!r} is declared {declared[tensor.name][0]}"
                            f"{list(declared[tensor.name][1])} by one rank and "
                            f"{kind[0]}{list(kind[1])} by another")
    return None


def lookup(jobs: dict[str, Job], job: str, rank: int) -> tuple[Job, Rank]:
    """The job and a rank registered (or held) here; NotFound saying what is missing."""
    entry = jobs.get(job)
    if entry is None:
        raise NotFound(f"no job {job!r} is registered with this daemon; call Register first")
    held = entry.ranks.get(rank)
    if held is None or held.layout is None:
        registered = sorted(r for r, h in entry.ranks.items() if h.layout is not None)
        raise NotFound(f"rank {rank} of job {job!r} is not registered; registered ranks: "
                       f"{registered}")
    return entry, held


def describe_difference(a: Layout, b: Layout) -> str:
    """What differs between two layouts, in a few words."""
    names_a = [t.name for t in a.tensors]
    names_b = [t.name for t in b.tensors]
    if names_a != names_b:
        return f"tensors {names_a[:4]}... vs {names_b[:4]}..."
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        if ta != tb:
            return (f"tensor {ta.name!r}: {ta.dtype}{list(ta.global_shape)} in {len(ta.shards)} "
                    f"shards vs {tb.dtype}{list(tb.global_shape)} in {len(tb.shards)} shards")
    return "same tensors, different shards"


def mismatches(expected, computed) -> list[int]:
    """Indices where two checksum sequences differ."""
    return [i for i, (a, b) in enumerate(zip(expected, computed, strict=True)) if a != b]
