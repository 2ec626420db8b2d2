"""The bubble planner: pure functions from bubble profiles to a snapshot plan.

Inputs, per rank (pipeline stage): the bubbles of one iteration (schedule
position and expected length), the iteration length, the measured fetch
bandwidth, and the bytes of each shard slot. Output: the snapshot interval in
iterations (the same for every rank, so every rank snapshots the same steps),
which byte ranges of which slots to fetch in which bubble of which iteration
of the interval, and what fits nowhere (spilled: fetched at the end of the
interval while training waits), with the overhead that predicts.

No I/O and no clocks, so it runs at the scale of thousands of stages and is
tested on crafted profiles.
"""

import dataclasses
from collections.abc import Mapping

from bubblesnap.shared.options import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Knobs of the planner.

    Attributes:
      safety: fraction of a bubble's expected length that may be filled, so a
        bubble shorter than usual is rarely cut short. Default 0.85 (clients
        stop fetching when the bubble ends, so a short one costs little).
      per_bubble_seconds: fixed cost of using a bubble (preparing the held
        state, starting the copies). Default 1 ms.
      min_bubble_seconds: bubbles shorter than this are left alone. Default 1 ms.
      min_chunk_bytes: a slot is not cut into pieces smaller than this.
        Default 256 KiB.
      max_interval: the longest interval the plan may choose; what does not
        fit into that many iterations' bubbles is spilled. 1 forces a snapshot
        every iteration (``--max-interval``). Default 8.
    """

    safety: float = 0.85
    per_bubble_seconds: float = 1e-3
    min_bubble_seconds: float = 1e-3
    min_chunk_bytes: int = 256 << 10
    max_interval: int = 8

    def __post_init__(self):
        require(self, "safety", 0 < self.safety <= 1, "in (0, 1]")
        for name in ("per_bubble_seconds", "min_bubble_seconds"):
            require(self, name, getattr(self, name) >= 0, ">= 0")
        require(self, "min_chunk_bytes", self.min_chunk_bytes >= 1, "at least 1")
        require(self, "max_interval", self.max_interval >= 1, "at least 1", "--max-interval")


@dataclasses.dataclass(frozen=True)
class RankProfile:
    """What the planner knows about one rank.

    Attributes:
      bubbles: (position, expected seconds) of each bubble of one iteration.
      iteration_seconds: length of one iteration.
      copy_bytes_per_second: measured device-to-shared-memory fetch bandwidth.
      slot_bytes: bytes of each shard slot, in slot order.
    """

    bubbles: tuple[tuple[int, float], ...]
    iteration_seconds: float
    copy_bytes_per_second: float
    slot_bytes: tuple[int, ...]

    @property
    def step_bytes(self) -> int:
        return sum(self.slot_bytes)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Bytes [start, stop) of slot ``slot``."""

    slot: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's part of a plan.

    ``assignments`` maps (iteration offset, bubble position) to the chunks to
    fetch there; offset 1 is the iteration right after the snapshotted step.
    ``commit_at`` is the key of the last assignment (None: nothing fits, all
    is spilled).
    """

    assignments: Mapping[tuple[int, int], tuple[Chunk, ...]]
    commit_at: tuple[int, int] | None
    spill_bytes: int
    predicted_overhead: float
    bubble_seconds: float
    usable_bubbles: int


@dataclasses.dataclass(frozen=True)
class Plan:
    interval: int
    ranks: Mapping[int, RankPlan]

    @property
    def predicted_overhead(self) -> float:
        return max((r.predicted_overhead for r in self.ranks.values()), default=0.0)

    @property
    def spill_bytes(self) -> int:
        return sum(r.spill_bytes for r in self.ranks.values())


def bubble_capacity(seconds: float, bytes_per_second: float, options: PlannerOptions) -> int:
    """Bytes that can be fetched in one bubble of ``seconds``."""
    if seconds < options.min_bubble_seconds:
        return 0
    usable = seconds * options.safety - options.per_bubble_seconds
    return max(0, int(usable * bytes_per_second))


def iterations_needed(profile: RankProfile, options: PlannerOptions) -> int:
    """Fewest iterations whose bubbles take this rank's whole state, as :func:`assign` fills them.

    Counted with the real fill, not total capacity / step bytes: a bubble whose
    room left is below ``min_chunk_bytes`` cannot take a cut of a larger slot,
    so the fill may need more iterations than the byte count says.
    ``max_interval + 1`` when even ``max_interval`` iterations are not enough.
    """
    filled = assign(profile, options.max_interval, options)
    if filled.spill_bytes:
        return options.max_interval + 1
    return filled.commit_at[0] if filled.commit_at is not None else 1


def choose_interval(profiles: Mapping[int, RankProfile], options: PlannerOptions) -> int:
    """The smallest interval in which every rank's snapshot fits its bubbles (capped)."""
    needed = max((iterations_needed(p, options) for p in profiles.values()), default=1)
    return max(1, min(needed, options.max_interval))


def assign(profile: RankProfile, interval: int, options: PlannerOptions) -> RankPlan:
    """Greedy, in schedule order: fill each bubble of each iteration with the next bytes.

    The fill of the first n iterations does not depend on ``interval`` (it only
    stops earlier), which :func:`iterations_needed` relies on.
    """
    pieces = [(slot, 0, n) for slot, n in enumerate(profile.slot_bytes) if n > 0]
    head = 0
    assignments, commit_at = {}, None
    for offset in range(1, interval + 1):
        if head == len(pieces):
            break
        for position, seconds in profile.bubbles:
            room = bubble_capacity(seconds, profile.copy_bytes_per_second, options)
            chunks = []
            while head < len(pieces) and room > 0:
                slot, start, stop = pieces[head]
                take = min(stop - start, room)
                if take < stop - start and take < options.min_chunk_bytes:
                    break
                chunks.append(Chunk(slot, start, start + take))
                room -= take
                if start + take == stop:
                    head += 1
                else:
                    pieces[head] = (slot, start + take, stop)
            if chunks:
                assignments[(offset, position)] = tuple(chunks)
                commit_at = (offset, position)
    spill = sum(stop - start for _, start, stop in pieces[head:])
    spill_seconds = spill / profile.copy_bytes_per_second if profile.copy_bytes_per_second else 0
    overhead = spill_seconds / (interval * profile.iteration_seconds) \
        if profile.iteration_seconds > 0 else 0.0
    usable = [s for _, s in profile.bubbles
              if bubble_capacity(s, profile.copy_bytes_per_second, options) > 0]
    return RankPlan(assignments, commit_at, spill, overhead, sum(usable), len(usable))


def plan(profiles: Mapping[int, RankProfile], options: PlannerOptions = PlannerOptions()) -> Plan:
    """The plan for a job: one interval for all ranks, and each rank's assignments."""
    interval = choose_interval(profiles, options)
    return Plan(interval, {rank: assign(p, interval, options) for rank, p in profiles.items()})
