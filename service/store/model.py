"""The store's data model: jobs, their ranks, and each rank's copies of steps.

A job has ``world_size`` ranks. Each rank registered (or held for a peer)
here has one layout and a copy per step: STAGING while a trainer or a peer
writes it, LOCAL once its checksums are known. Plain mutable records; every
change happens under the store's lock (store.py).
"""

import dataclasses
import enum

from bubblesnap.service.errors import NotFound
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
    """One rank's copy of one step."""

    segment: Segment
    state: CopyState
    checksums: tuple[int, ...] = ()
    usage: BubbleUsage = BubbleUsage()
    pins: int = 0          # readers outside the lock (replication, durable writes)
    released: bool = False  # freed while pinned: the last unpin disposes of the segment
    replicated: bool = False  # a peer acknowledged a copy (or this is that copy)
    just_verified: bool = False  # installed for a restore and verified; not served since
    arriving: bool = False  # being installed from a peer or the durable tier

    @property
    def local(self) -> bool:
        return self.state is CopyState.LOCAL


@dataclasses.dataclass
class Rank:
    """One rank of a job as this daemon holds it."""

    layout: Layout
    slots: list[tuple[int, int, int, int]]
    #: The rank's replica group, sorted, the rank included: group[0] copies
    #: the state, the other members are held through its copies.
    group: tuple[int, ...]
    steps: dict[int, RankStep] = dataclasses.field(default_factory=dict)
    replica: bool = False  # held for a peer; no trainer registered it here

    @classmethod
    def of(cls, layout: Layout, group: tuple[int, ...], replica: bool = False) -> "Rank":
        return cls(layout, layout.slots(), group, replica=replica)

    def local_steps(self) -> list[int]:
        return sorted(s for s, rs in self.steps.items() if rs.local)

    def latest_local(self) -> int:
        return max(self.local_steps(), default=-1)

    def slot_names(self, indices) -> str:
        """The slots at ``indices`` as a person reads them: 'w' shard 0, ..."""
        return ", ".join(f"{self.layout.tensors[self.slots[i][0]].name!r} shard "
                         f"{self.slots[i][1]}" for i in indices)


@dataclasses.dataclass
class Job:
    world_size: int
    ranks: dict[int, Rank] = dataclasses.field(default_factory=dict)
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
            local = set(rank.local_steps()) if rank else set()
            common = local if common is None else common & local
        return sorted(common or ())

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The replica group of ``rank`` as a rank held here declared it (the rank
        itself, a member, or a replica of the group's copier); None if none did."""
        held = self.ranks.get(rank)
        if held is not None:
            return held.group
        return next((h.group for h in self.ranks.values() if rank in h.group), None)


def lookup(jobs: dict[str, Job], job: str, rank: int) -> tuple[Job, Rank]:
    """The job and a rank registered (or held) here; NotFound saying what is missing."""
    entry = jobs.get(job)
    if entry is None:
        raise NotFound(f"no job {job!r} is registered with this daemon; call Register first")
    held = entry.ranks.get(rank)
    if held is None:
        raise NotFound(f"rank {rank} of job {job!r} is not registered; "
                       f"registered ranks: {sorted(entry.ranks)}")
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
