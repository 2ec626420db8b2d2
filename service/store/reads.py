"""Reading held copies: handing one over to a trainer, pinning one for a reader outside the lock.

Called with the store's lock held.
"""

from bubblesnap.service import answer_segment
from bubblesnap.service.errors import DataLoss, NotFound
from bubblesnap.service.store import registration
from bubblesnap.service.store.model import mismatches
from bubblesnap.service.store.state import StoreState
from bubblesnap.service.store.views import PinnedCopy, Restorable, pinned


def serve(state: StoreState, job: str, rank: int, step: int,
          asked_group: tuple[int, ...] = ()) -> Restorable:
    """Verifies this daemon's copy of ``step`` for ``rank`` and hands its segment over.

    A member of a replica group gets its copier's copy (``asked_group`` is
    the caller's, for a rank no registration here declared).
    """
    entry, _ = registration.copier(state, job, rank, asked_group)
    copier = registration.agreed_group(job, entry, rank, asked_group)[0]
    return serve_copy(state, job, copier, step)


def serve_copy(state: StoreState, job: str, rank: int, step: int) -> Restorable:
    """Verifies this daemon's copy of ``step`` of ``rank`` (registered or not, of any
    epoch) and hands its segment over.

    The client may keep arrays that alias the segment (zero-copy on the CPU
    backend), so a segment once served is never recycled: when retention
    frees it, it is unlinked, and its memory lives on only as long as the
    client maps it.
    """
    entry = state.jobs.get(job)
    held = entry.ranks.get(rank) if entry is not None else None
    rank_step = held.steps.get(step) if held is not None else None
    if rank_step is None or not rank_step.local:
        raise NotFound(f"this daemon holds no copy of step {step} of rank {rank}")
    answer_segment.announce(rank_step.segment.path, rank_step.segment.nbytes)
    # A copy verified as it arrived (a moment ago, from a peer or disk) is not
    # read a second time.
    computed = rank_step.checksums if rank_step.just_verified else \
        state.hash(rank_step.segment, rank_step.slots)
    rank_step.just_verified = False
    bad = mismatches(rank_step.checksums, computed)
    if bad:
        names = rank_step.slot_names(bad)
        state.memory.free(held, step)
        raise DataLoss(
            f"step {step} of rank {rank} failed its checksum on {names}: the copy was "
            f"corrupted in memory and has been discarded; committed steps left: "
            f"{entry.committed_steps() or 'none'}")
    rank_step.segment.handed_out = True
    return Restorable(step, rank_step.segment.path, rank_step.slots, rank_step.checksums,
                      rank_step.layout, rank_step.world_size)


def pin(state: StoreState, job: str, rank: int, step: int) -> PinnedCopy:
    """Keeps a LOCAL copy's segment intact for a reader outside the lock."""
    entry = state.jobs.get(job)
    held = entry.ranks.get(rank) if entry is not None else None
    rank_step = held.steps.get(step) if held is not None else None
    if rank_step is None or not rank_step.local:
        raise NotFound(f"this daemon holds no committed copy of step {step} of rank "
                       f"{rank} of job {job!r}")
    rank_step.pins += 1
    return pinned(job, rank, step, rank_step)
