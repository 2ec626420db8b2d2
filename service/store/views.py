"""What the store answers: immutable views of its state, safe to use outside its lock."""

import dataclasses

from bubblesnap.service.store.layout import Layout
from bubblesnap.service.store.model import BubbleUsage, CopyState, Job, RankStep
from bubblesnap.service.store.pages import SharedPages
from bubblesnap.service.store.segments import Segment


@dataclasses.dataclass(frozen=True)
class Registration:
    reattached: bool
    latest_local_step: int
    step_bytes: int


@dataclasses.dataclass(frozen=True)
class Staging:
    """Where a step's shards go: the segment file and one slot per shard."""

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
    """A verified copy handed over to a trainer: ``slots`` (tensor, shard, offset, nbytes)
    in ``segment_path``, or, where ``slot_segments`` says so, in one of
    ``other_segments`` (slot_segments[i] = k: slot i is in other_segments[k - 1])."""

    step: int
    segment_path: str
    slots: tuple[tuple[int, int, int, int], ...]
    checksums: tuple[int, ...]
    layout: Layout
    world_size: int = 0  # of the epoch the step was taken in
    other_segments: tuple[str, ...] = ()
    slot_segments: tuple[int, ...] = ()  # empty: every slot in segment_path


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
    world_size: int = 0  # of the epoch the copy was taken in


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
    """A LOCAL copy that stays intact (not recycled) until ``SnapshotStore.unpin``."""

    job: str
    rank: int
    step: int
    world_size: int
    segment: Segment
    layout: Layout
    slots: tuple[tuple[int, int, int, int], ...]
    checksums: tuple[int, ...]
    group: tuple[int, ...] = ()
    _held: RankStep | None = dataclasses.field(repr=False, compare=False, default=None)


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """A rank a trainer registered here: its world size, layout and replica group."""

    rank: int
    world_size: int
    layout: Layout
    group: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MemoryView:
    budget_bytes: int
    used_bytes: int
    pooled_bytes: int
    shm_dir: str
    shm_free_bytes: int
    warm_bytes: int = 0       # of pooled_bytes: pre-faulted segments ready (warm_pool.py)
    warm_pool_bytes: int = 0  # what the warm pool keeps ready (--warm-pool-bytes)
    warm_taken: int = 0       # segments taken from the warm pool so far
    pages: SharedPages | None = None  # the pages segments get in shm_dir (pages.py)


def staging_of(rank_step: RankStep) -> Staging:
    return Staging(rank_step.segment.path, rank_step.segment.nbytes, rank_step.slots)


def job_view(name: str, entry: Job) -> JobView:
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
                ShardView(rank_step.layout.tensors[t].name, s, n,
                          rank_step.checksums[i] if rank_step.checksums else 0)
                for i, (t, s, _, n) in enumerate(rank_step.slots))
            ranks.append(RankStepView(rank, rank_step.state, rank_step.layout.nbytes, shards,
                                      rank_step.usage, held.replica,
                                      tuple(m for m in rank_step.group if m != rank),
                                      rank_step.world_size))
        views.append(StepView(step, step in committed, tuple(ranks)))
    return JobView(name, entry.world_size,
                   tuple(sorted(r for r, h in entry.ranks.items() if h.layout is not None)),
                   max(committed, default=-1), tuple(views))


def held_copies(name: str, entry: Job) -> list[HeldCopy]:
    return [HeldCopy(name, rank, step, held.replica, rank_step.world_size, rank_step.group)
            for rank, held in sorted(entry.ranks.items())
            for step, rank_step in sorted(held.steps.items()) if rank_step.local]


def unpushed_copies(entry: Job) -> set[tuple[int, int]]:
    """(rank, step) of the LOCAL copies committed here that no peer acknowledged yet (an
    arrived copy counts as pushed: it is the acknowledged one)."""
    return {(rank, step) for rank, held in entry.ranks.items()
            for step, rank_step in held.steps.items()
            if rank_step.local and not rank_step.replicated}


def pinned(name: str, rank: int, step: int, rank_step: RankStep) -> PinnedCopy:
    return PinnedCopy(name, rank, step, rank_step.world_size, rank_step.segment,
                      rank_step.layout, rank_step.slots, rank_step.checksums, rank_step.group,
                      rank_step)
