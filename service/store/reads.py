"""Reading held copies: handing one over to a trainer, pinning one for a reader outside the lock.

Called with the store's lock held. A copy handed over is verified between
``take`` and ``hand_over``, outside the lock, pinned meanwhile.
"""

from bubblesnap.service import answer_segment
from bubblesnap.service.errors import DataLoss, NotFound
from bubblesnap.service.store import registration
from bubblesnap.service.store.model import RankStep, mismatches
from bubblesnap.service.store.state import StoreState
from bubblesnap.service.store.views import PinnedCopy, Restorable, pinned


def take(state: StoreState, job: str, rank: int, step: int,
         asked_group: tuple[int, ...] = ()) -> tuple[PinnedCopy, bool]:
    """``take_copy`` of this daemon's copy of ``step`` for ``rank``: a member of a replica
    group gets its copier's copy (``asked_group`` is the caller's, for a rank no
    registration here declared)."""
    entry, _ = registration.copier(state, job, rank, asked_group)
    copier = registration.agreed_group(job, entry, rank, asked_group)[0]
    return take_copy(state, job, copier, step)


def take_copy(state: StoreState, job: str, rank: int, step: int) -> tuple[PinnedCopy, bool]:
    """Pins this daemon's copy of ``step`` of ``rank`` (registered or not, of any epoch)
    to be handed over, and names its segment to the caller; True when the copy was
    verified as it arrived (a moment ago, from a peer or disk): not to be read a
    second time. Every take is followed by ``hand_over``.

    The client maps the segment from now on and may keep arrays that alias it
    (zero-copy on the CPU backend), so a segment once taken is never recycled:
    when it is freed, it is unlinked, and its memory lives on only as long as the
    client maps it.
    """
    rank_step = _local_copy(state, job, rank, step)
    answer_segment.announce(rank_step.segment.path, rank_step.segment.nbytes)
    rank_step.segment.handed_out = True
    verified, rank_step.just_verified = rank_step.just_verified, False
    rank_step.pins += 1
    return pinned(job, rank, step, rank_step), verified


def hand_over(state: StoreState, copy: PinnedCopy, computed: tuple[int, ...]) -> Restorable:
    """Unpins ``copy`` (``take``) and hands it over if ``computed``, its checksums as read
    outside the lock, are the ones it was committed with. DataLoss (the copy
    discarded, if another caller did not discard it first) if not; NotFound if it
    was freed meanwhile (deleted, retired, the store closed)."""
    rank_step = copy._held
    state.memory.unpin(rank_step)
    entry = state.jobs.get(copy.job)
    held = entry.ranks.get(copy.rank) if entry is not None else None
    still_held = held is not None and held.steps.get(copy.step) is rank_step
    bad = mismatches(copy.checksums, computed)
    if bad:
        if still_held:
            state.memory.free(held, copy.step)
        left = entry.committed_steps() if entry is not None else []
        raise DataLoss(
            f"step {copy.step} of rank {copy.rank} failed its checksum on "
            f"{rank_step.slot_names(bad)}: the copy was corrupted in memory and has been "
            f"discarded; committed steps left: {left or 'none'}")
    if not still_held:
        raise NotFound(f"step {copy.step} of rank {copy.rank} was deleted while it was "
                       "being verified for this restore; restore again")
    return Restorable(copy.step, copy.segment.path, copy.slots, copy.checksums, copy.layout,
                      copy.world_size)


def pin(state: StoreState, job: str, rank: int, step: int) -> PinnedCopy:
    """Keeps a LOCAL copy's segment intact for a reader outside the lock."""
    rank_step = _local_copy(state, job, rank, step)
    rank_step.pins += 1
    return pinned(job, rank, step, rank_step)


def _local_copy(state: StoreState, job: str, rank: int, step: int) -> RankStep:
    entry = state.jobs.get(job)
    held = entry.ranks.get(rank) if entry is not None else None
    rank_step = held.steps.get(step) if held is not None else None
    if rank_step is None or not rank_step.local:
        raise NotFound(f"this daemon holds no committed copy of step {step} of rank "
                       f"{rank} of job {job!r}")
    return rank_step
