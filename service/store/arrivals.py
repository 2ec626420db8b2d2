"""Copies that arrive from elsewhere (a peer's push or pull, the durable tier), and rollback.

An arrival is reserved under the lock, filled outside it (the bytes take a
while to come), and lands under the lock once its checksums match; a copy
that fails is dropped whole. Called with the store's lock held.
"""

import dataclasses

from bubblesnap.service.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from bubblesnap.service.store.layout import Layout
from bubblesnap.service.store.model import (
    CopyState,
    Job,
    Rank,
    RankStep,
    describe_difference,
    mismatches,
)
from bubblesnap.service.store.state import StoreState


class ArrivingAlready(Exception):
    """The very copy (same checksums) is being installed here by another transfer (a
    restore's pull and a re-replication's push of one copy): wait for that one to land or
    to be abandoned, then reserve again. Replacing it would break off the first."""

    def __init__(self, rank_step):
        super().__init__("the same copy is arriving already")
        self.rank_step = rank_step


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A copy being installed: its segment is reserved and pinned while it fills.

    ``new_job``, ``new_rank``: the arrival made the job's or the rank's entry,
    which goes again if the copy never lands (a failed call keeps nothing).
    """

    job: str
    rank: int
    step: int
    entry: Job
    held: Rank
    rank_step: RankStep
    checksums: tuple[int, ...]
    new_job: bool = False
    new_rank: bool = False


def reserve(state: StoreState, job: str, world_size: int, rank: int, step: int,
            layout: Layout, checksums: tuple[int, ...],
            group: tuple[int, ...]) -> Arrival | None:
    """Reserves the segment of an arriving copy; None when this very copy is held already.

    A rank no trainer registered here is held as a replica, of the ranks in
    ``group``, until one does. The copy keeps its own layout and world size
    (it may be of an earlier epoch of the job). An existing replica with other
    checksums (an abandoned run's) is replaced; a copy this daemon's own trainer
    made never is (FailedPrecondition).
    """
    slots = layout.slots()
    if len(checksums) != len(slots):
        raise InvalidArgument(f"{len(checksums)} checksums for {len(slots)} shards")
    entry = state.jobs.get(job)
    held = entry.ranks.get(rank) if entry is not None else None
    if held is not None and not held.replica and held.layout is not None and \
            world_size == entry.world_size and held.layout != layout:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} is registered here with a different "
            f"layout ({describe_difference(held.layout, layout)})")
    existing = held.steps.get(step) if held is not None else None
    if existing is not None and existing.local and existing.checksums == checksums:
        return None
    if existing is not None and existing.arriving and existing.incoming == checksums:
        raise ArrivingAlready(existing)
    if existing is not None and not held.replica:
        raise FailedPrecondition(
            f"this daemon holds its own trainer's copy of step {step} of rank {rank} of job "
            f"{job!r} ({existing.state.value}, other checksums); a copy from elsewhere does "
            "not replace it")
    if existing is not None:  # a replica of an abandoned run's step
        state.memory.free(held, step)
    segment = state.memory.acquire(layout.segment_bytes,
                                   f"step {step} of job {job!r} rank {rank}")
    new_job, new_rank = entry is None, held is None
    if new_job:
        entry = state.new_job(job, world_size)
    if new_rank:
        held = entry.ranks[rank] = Rank(layout, group, replica=True)
    rank_step = held.steps[step] = RankStep(segment, CopyState.STAGING, layout, world_size, group,
                                            pins=1, arriving=True, incoming=checksums)
    return Arrival(job, rank, step, entry, held, rank_step, checksums, new_job, new_rank)


def land(state: StoreState, arrival: Arrival, computed, for_restore: bool) -> int:
    """Makes a filled arrival LOCAL if ``computed`` matches its checksums; returns the
    bytes stored. ``for_restore``: it is served right away, without a second hash."""
    held, rank_step, step = arrival.held, arrival.rank_step, arrival.step
    state.memory.unpin(rank_step)
    if held.steps.get(step) is not rank_step:  # deleted meanwhile
        _forget_if_empty(state, arrival)
        raise NotFound(f"step {step} of rank {arrival.rank} was deleted while it arrived")
    bad = mismatches(arrival.checksums, computed)
    if bad:
        names = rank_step.slot_names(bad)
        state.memory.free(held, step)
        _forget_if_empty(state, arrival)
        raise DataLoss(f"step {step} of rank {arrival.rank} of job {arrival.job!r}: checksum "
                       f"mismatch on {names}; the copy was dropped")
    rank_step.replicated = True
    try:
        state.record(arrival.job, arrival.entry, arrival.rank, held, step, rank_step,
                     arrival.checksums)
    except ResourceExhausted:
        _forget_if_empty(state, arrival)
        raise
    if held.replica:  # a replica's layout and group are what its newest copy has
        held.layout, held.group = rank_step.layout, rank_step.group
    rank_step.make_local(arrival.checksums)
    rank_step.arriving = False
    rank_step.just_verified = for_restore
    state.retain(arrival.job, arrival.entry)
    return rank_step.layout.nbytes


def abandon(state: StoreState, arrival: Arrival) -> None:
    """The bytes never came whole: the reserved copy goes, and the entries it made."""
    if arrival.held.steps.get(arrival.step) is arrival.rank_step:
        state.memory.free(arrival.held, arrival.step)
    state.memory.unpin(arrival.rank_step)
    _forget_if_empty(state, arrival)


def _forget_if_empty(state: StoreState, arrival: Arrival) -> None:
    """Drops the rank and job entries the arrival made, unless something else came to
    hold them meanwhile (another copy, a trainer's registration)."""
    entry, held = arrival.entry, arrival.held
    if arrival.new_rank and held.replica and not held.steps and \
            entry.ranks.get(arrival.rank) is held:
        del entry.ranks[arrival.rank]
    if arrival.new_job and not entry.ranks and state.jobs.get(arrival.job) is entry:
        del state.jobs[arrival.job]


def rollback(state: StoreState, job: str, step: int) -> int:
    """Drops every copy of ``job`` newer than ``step`` (the job resumes from it).

    Returns the copies dropped. A trainer's unfinished (STAGING) copies
    are kept: a resumed trainer may already be writing its next step;
    copies still arriving from a peer are dropped (the old run's).
    """
    entry = state.jobs.get(job)
    if entry is None:
        return 0
    dropped = 0
    for held in entry.ranks.values():
        for later in [s for s, rs in held.steps.items() if s > step and (rs.local or rs.arriving)]:
            state.memory.free(held, later)
            dropped += 1
    if entry.group_committed is not None:
        entry.group_committed = [s for s in entry.group_committed if s <= step]
    return dropped
