"""Staging and commit: a trainer writes a step into a segment, then commits it LOCAL.

A trainer killed at any point leaves either a LOCAL copy or an unfinished
(STAGING) one that is never served and is dropped when the rank registers
again or begins another step. Called with the store's lock held.
"""

import dataclasses

from bubblesnap.service.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from bubblesnap.service.store.model import (
    BubbleUsage,
    CopyState,
    Job,
    Rank,
    RankStep,
    lookup,
    mismatches,
)
from bubblesnap.service.store.state import StoreState
from bubblesnap.service.store.views import Commit, Staging, staging_of


def begin(state: StoreState, job: str, rank: int, step: int) -> Staging:
    """Reserves a segment for ``step`` of ``rank`` (or hands back the one reserved)."""
    entry, held = lookup(state.jobs, job, rank)
    if held.group[0] != rank:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} is held through rank {held.group[0]}'s copies "
            f"(replica group {list(held.group)}): it has nothing to copy; only rank "
            f"{held.group[0]} snapshots this state")
    return _begin(state, job, rank, entry, held, step)


def commit(state: StoreState, job: str, rank: int, step: int, checksums=(),
           usage: BubbleUsage = BubbleUsage(), next_step: int | None = None,
           staged_as: int | None = None) -> Commit:
    """Commits a staged step; with ``next_step`` (> step) also begins that one.

    Beginning the next step here, in the same call, saves the client a
    BeginStep round trip inside its next bubble (or before its next save). If
    the next step cannot begin (no memory), the commit stands and ``next`` is
    None. ``staged_as`` (<= step): the step the bytes were staged under, a
    segment reserved by an earlier commit's ``next_step`` for what turned out
    to be a later step; the copy becomes ``step``.
    """
    if next_step is not None and next_step <= step:
        raise InvalidArgument(f"next step {next_step} must come after step {step}")
    if staged_as is not None and staged_as > step:
        raise InvalidArgument(f"staged_as {staged_as} comes after step {step}: a segment "
                              "reserved for a step holds that step or a later one")
    entry, held = lookup(state.jobs, job, rank)
    if staged_as is not None and staged_as != step and step not in held.steps:
        _restage(entry, job, rank, held, staged_as, step)
    rank_step = held.steps.get(step)
    if rank_step is None:
        raise NotFound(
            f"rank {rank} of job {job!r} has no step {step} being staged; "
            "call BeginStep first (the copy may have been aborted by a newer BeginStep "
            "or a re-registration)")
    if rank_step.local:
        return _result(state, job, rank, entry, held, step, next_step)
    if checksums and len(checksums) != len(rank_step.slots):
        raise InvalidArgument(
            f"{len(checksums)} checksums for {len(rank_step.slots)} shards; send one per "
            "slot, in the order BeginStep returned, or none to let the daemon compute them")
    if checksums and not state.options.verify_on_commit:
        computed = tuple(checksums)  # verified before every serve instead
    else:
        computed = state.hash(rank_step.segment, rank_step.slots)
    bad = mismatches(checksums, computed) if checksums else []
    if bad:
        names = rank_step.slot_names(bad)
        state.memory.free(held, step)
        raise DataLoss(
            f"step {step} of rank {rank}: the bytes in shared memory do not match the "
            f"client's checksums for {names}; the copy was dropped, snapshot again")
    rank_step.usage = usage
    state.record(job, entry, rank, held, step, rank_step, computed)
    rank_step.make_local(computed)
    state.retain(job, entry)
    return dataclasses.replace(_result(state, job, rank, entry, held, step, next_step),
                               newly_local=True)


def abort(state: StoreState, job: str, rank: int, step: int) -> None:
    _, held = lookup(state.jobs, job, rank)
    rank_step = held.steps.get(step)
    if rank_step is None:
        raise NotFound(f"rank {rank} of job {job!r} has no step {step}")
    if rank_step.local:
        raise FailedPrecondition(
            f"step {step} of rank {rank} is already {rank_step.state.value}; "
            "use DeleteSnapshots to drop committed steps")
    state.memory.free(held, step)


def _restage(entry: Job, job: str, rank: int, held: Rank, staged_as: int, step: int) -> None:
    """The segment staged as ``staged_as`` holds ``step`` instead (a reservation made
    before the client knew which step it would save next)."""
    reserved = held.steps.get(staged_as)
    if reserved is None or reserved.local:
        raise NotFound(
            f"rank {rank} of job {job!r} has no step {staged_as} being staged to commit as "
            f"step {step}; the reservation may have been aborted by a newer BeginStep, a "
            "re-registration or a daemon restart: snapshot again")
    if step in entry.committed_steps():
        raise FailedPrecondition(
            f"step {step} of job {job!r} is already committed; snapshot a later step")
    held.steps[step] = held.steps.pop(staged_as)


def _begin(state: StoreState, job: str, rank: int, entry: Job, held: Rank,
           step: int) -> Staging:
    existing = held.steps.get(step)
    if existing is not None:
        if not existing.local and existing.layout == held.layout:
            return staging_of(existing)
        if step in entry.committed_steps():
            raise FailedPrecondition(
                f"step {step} of job {job!r} is already committed; snapshot a later step")
        # A LOCAL copy that never committed job-wide, left by an earlier
        # incarnation of this rank: the new copy replaces it.
        state.memory.free(held, step)
    committed = entry.committed_steps()
    keep = state.options.keep_steps
    kept = committed[-keep:]
    if kept and len(kept) == keep and step < kept[0]:
        raise FailedPrecondition(
            f"step {step} of job {job!r} is older than every step retention keeps "
            f"(committed: {committed}); it would be dropped as soon as it commits. "
            "A new run under an old job name? Delete the job's snapshots or use a new "
            "job name")
    # Unfinished copies of this rank are abandoned (a crashed trainer), except the
    # newest: its commit may still be on its way, overtaken by this call.
    staging = sorted(s for s, rs in held.steps.items() if not rs.local)
    for stale in staging[:-1]:
        state.memory.free(held, stale)
    segment = state.memory.acquire(held.layout.segment_bytes,
                                   f"step {step} of job {job!r} rank {rank}")
    rank_step = held.steps[step] = RankStep(segment, CopyState.STAGING, held.layout,
                                            entry.world_size, held.group)
    return staging_of(rank_step)


def _result(state: StoreState, job: str, rank: int, entry: Job, held: Rank, step: int,
            next_step: int | None) -> Commit:
    committed = entry.committed_steps()
    staging = None
    if next_step is not None:
        try:
            staging = _begin(state, job, rank, entry, held, next_step)
        except (ResourceExhausted, FailedPrecondition):
            staging = None
    return Commit(step in committed, committed[-1] if committed else -1, staging)
