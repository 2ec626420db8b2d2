"""The memory a restore works in beside the copies held: the segments served with an
assembled restore's answer (the one regions are cut into, a peer's copy pulled whole
that regions lie in), held copies handed out (regions answered where they lie),
scratch segments for a peer's copy pulled to be cut, and the mark that bytes are
landing (the warm pool waits meanwhile).

Part of ``SnapshotStore`` (its ``restore_segments``): the same lock and state.
"""

import contextlib

from bubblesnap.service import answer_segment, phases
from bubblesnap.service.store.segments import Segment
from bubblesnap.service.store.state import StoreState
from bubblesnap.service.store.views import PinnedCopy


class RestoreSegments:
    """Segments a restore fills, in the store's budget, under the store's ``lock``."""

    def __init__(self, lock, state: StoreState):
        self._lock = lock
        self._state = state

    def release(self, job: str, rank: int) -> None:
        """Frees the segments of ``rank``'s last restore (a new one begins)."""
        with self._lock:
            self._state.release_served(job, rank)

    @contextlib.contextmanager
    def served(self, job: str, rank: int, nbytes: int, scratch: bool = False):
        """A fresh segment of ``nbytes`` served with a restore of ``rank`` (an assembled
        answer, a peer's copy part of it points into), counted in the budget, bytes
        landing in it inside the block (``landing``); given back if the block fails,
        else freed at the rank's next restore (``release``) or commit, or with the job.
        ResourceExhausted when the budget has no room; ``scratch``: room is made as for
        a scratch segment (``Memory.acquire``)."""
        with self.landing():
            segment = self._assembled(job, rank, nbytes, scratch)
            try:
                answer_segment.announce(segment.path, segment.nbytes)
                yield segment
            except BaseException:
                self.give_back(job, rank, segment)
                raise
            finally:
                with self._lock:
                    self._state.filling.discard(segment)

    def _assembled(self, job: str, rank: int, nbytes: int, scratch: bool) -> Segment:
        with phases.timed("segment"), self._lock:
            segment = self._state.memory.hand_over(nbytes, f"a restore of rank {rank} of "
                                                           f"job {job!r}", scratch)
            self._state.served.setdefault((job, rank), []).append(segment)
            self._state.filling.add(segment)
        return segment

    def hand_out(self, copy: PinnedCopy) -> None:
        """A held copy part of whose segment a restore answers as it lies: never recycled
        (freed, it is unlinked; its memory lives as long as the client maps it)."""
        with self._lock:
            copy.segment.handed_out = True

    def give_back(self, job: str, rank: int, segment: Segment) -> None:
        """Frees what ``served`` gave a restore that failed before it answered."""
        with self._lock:
            served = self._state.served.get((job, rank), [])
            if segment in served:
                served.remove(segment)
                self._state.memory.drop(segment)

    @contextlib.contextmanager
    def landing(self):
        """Bytes land in this daemon's memory inside the block (an assembled restore being
        cut): the warm pool makes no segment meanwhile, whose page zeroing would take
        the cores and the memory bandwidth the copy needs."""
        with self._lock:
            self._state.memory.arriving += 1
        try:
            yield
        finally:
            with self._lock:
                self._state.memory.arriving -= 1
            self._state.memory.pool_changed.set()

    @contextlib.contextmanager
    def scratch(self, nbytes: int, what: str):
        """A segment of ``nbytes`` for the block alone (a peer's copy pulled to be cut),
        in the budget while used, then freed; bytes land in it (``landing``).
        ResourceExhausted, no reusable segment destroyed for it, when there is no room."""
        with self.landing():
            with self._lock:
                segment = self._state.memory.acquire(nbytes, what, scratch=True)
            try:
                yield segment
            finally:
                with self._lock:
                    self._state.memory.drop(segment)
