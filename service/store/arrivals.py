"""Copies that arrive from elsewhere (a peer's push or pull, the durable tier), and rollback.

An arrival is reserved under the lock, filled outside it (the bytes take a
while to come), and lands under the lock once its checksums match; a copy
that fails is dropped whole. Called with the store's lock held.
"""

import dataclasses

from bubblesnap.service.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
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


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A copy being installed: its segment is reserved and pinned while it fills."""

    job: str
    rank: int
    step: int
    entry: Job
    held: Rank
    rank_step: RankStep
    checksums: tuple[int, ...]


def reserve(state: StoreState, job: str, world_size: int, rank: int, step: int,
            layout: Layout, checksums: tuple[int, ...],
            group: tuple[int, ...]) -> Arrival | None:
    """Reserves the segment of an arriving copy; None when this very copy is held already.

    A rank no trainer registered here is held as a replica, of the ranks in
    ``group``, until one does. The copy keeps its own layout and world size
    (it may be of an earlier epoch of the job). An existing copy with other
    checksums (an abandoned run's) is replaced.
    """
    slots = layout.slots()
    if len(checksums) != len(slots):
        raise InvalidArgument(f"{len(checksums)} checksums for {len(slots)} shards")
    entry = state.jobs.get(job)
    if entry is None:
        entry = state.new_job(job, world_size)
    held = entry.ranks.get(rank)
    if held is None:
        held = entry.ranks[rank] = Rank(layout, group, replica=True)
    elif held.replica:
        held.layout, held.group = layout, group
    elif held.layout is not None and world_size == entry.world_size and held.layout != layout:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} is registered here with a different "
            f"layout ({describe_difference(held.layout, layout)})")
    existing = held.steps.get(step)
    if existing is not None and existing.local and existing.checksums == checksums:
        return None
    if existing is not None:
        state.memory.free(held, step)
    segment = state.memory.acquire(layout.segment_bytes,
                                   f"step {step} of job {job!r} rank {rank}")
    rank_step = held.steps[step] = RankStep(segment, CopyState.STAGING, layout, world_size, group,
                                            pins=1, arriving=True)
    return Arrival(job, rank, step, entry, held, rank_step, checksums)


def land(state: StoreState, arrival: Arrival, computed, for_restore: bool) -> int:
    """Makes a filled arrival LOCAL if ``computed`` matches its checksums; returns the
    bytes stored. ``for_restore``: it is served right away, without a second hash."""
    held, rank_step, step = arrival.held, arrival.rank_step, arrival.step
    state.memory.unpin(rank_step)
    if held.steps.get(step) is not rank_step:  # deleted meanwhile
        raise NotFound(f"step {step} of rank {arrival.rank} was deleted while it arrived")
    bad = mismatches(arrival.checksums, computed)
    if bad:
        names = rank_step.slot_names(bad)
        state.memory.free(held, step)
        raise DataLoss(f"step {step} of rank {arrival.rank} of job {arrival.job!r}: checksum "
                       f"mismatch on {names}; the copy was dropped")
    rank_step.checksums = arrival.checksums
    rank_step.replicated = True
    state.record(arrival.job, arrival.entry, arrival.rank, held, step, rank_step)
    rank_step.state = CopyState.LOCAL
    rank_step.arriving = False
    rank_step.just_verified = for_restore
    state.retain(arrival.job, arrival.entry)
    return rank_step.layout.nbytes


def abandon(state: StoreState, arrival: Arrival) -> None:
    """The bytes never came whole: the reserved copy goes."""
    if arrival.held.steps.get(arrival.step) is arrival.rank_step:
        state.memory.free(arrival.held, arrival.step)
    state.memory.unpin(arrival.rank_step)


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
