"""The store's shared memory: segments taken from a pool within a budget, pins, release.

Every byte the store holds is a segment: a step's copy, a copy freed while a
reader outside the lock still pins it (lingering), a freed segment kept for
reuse in the pool, or a warm one made ahead of need (warm_pool.py; counted
while it is being made, too). All of them count against the budget. Called
with the store's lock held.
"""

import threading

from bubblesnap.service.errors import ResourceExhausted
from bubblesnap.service.store import persistence
from bubblesnap.service.store.model import CopyState, Rank, RankStep
from bubblesnap.service.store.segments import Segment, SegmentPool


class Memory:
    """Segments within ``budget_bytes``: acquire, free, pin and unpin them."""

    def __init__(self, shm_dir: str, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.pool = SegmentPool(shm_dir)
        self._in_use = 0  # bytes of segments handed to copies, lingering ones included
        self._lingering: list[RankStep] = []  # freed, but a pinned reader still has it
        self.filling_bytes = 0  # warm segments being made outside the lock
        self.arriving = 0  # copies being filled outside the lock (the warm pool waits)
        #: Whether a thread (the warm pool's) destroys freed segments; else done at once.
        self.reaped = False
        #: Set when a segment is taken or freed: the warm pool may have work.
        self.pool_changed = threading.Event()

    @property
    def used_bytes(self) -> int:
        return self._in_use

    def _held(self) -> int:
        return self._in_use + self.pool.pooled_bytes + self.filling_bytes

    def room_bytes(self) -> int:
        """What the budget has room for beside everything held."""
        return self.budget_bytes - self._held()

    def reserve_filling(self, nbytes: int) -> bool:
        """Counts a warm segment about to be made, if the budget has room for it."""
        if self._held() + nbytes > self.budget_bytes:
            return False
        self.filling_bytes += nbytes
        return True

    def acquire(self, nbytes: int, what: str, scratch: bool = False) -> Segment:
        """A segment of ``nbytes`` for ``what`` (a step of a rank, for messages);
        ResourceExhausted, with everything held kept, when the budget has no room.
        ``scratch``: wanted for a moment, where the caller can do without it (a peer's
        copy pulled whole to be cut): only doomed segments are destroyed to make room
        (none that could be used again). Its size is one the warm pool makes all the
        same: the next restore pulls the same copies again (a fresh 256 MB segment
        costs ~100 ms to reserve and ~45 ms to pre-fault on the dev VM)."""
        self.pool_changed.set()
        over = self._held() + nbytes - self.budget_bytes
        if over > 0 and not self.pool.has(nbytes):
            self.pool.trim(over, doomed_only=scratch)
            if self._held() + nbytes > self.budget_bytes:
                raise ResourceExhausted(
                    f"no room for {what}: it needs {nbytes} bytes and the daemon holds "
                    f"{self._in_use} of its {self.budget_bytes}-byte memory budget. "
                    "Raise --memory-budget, lower --keep, or delete snapshots; "
                    "everything already held is kept")
        segment = self.pool.acquire(nbytes)
        self._in_use += segment.nbytes
        return segment

    def hand_over(self, nbytes: int, what: str, scratch: bool = False) -> Segment:
        """A segment for a trainer to map and keep (an assembled restore): never pooled.
        ``scratch``: room made as for a scratch one (``acquire``)."""
        segment = self.acquire(nbytes, what, scratch)
        segment.handed_out = True
        return segment

    def adopt(self, segment: Segment) -> None:
        """Counts a segment a dead daemon left (adoption.py) as held here."""
        self._in_use += segment.nbytes

    def drop(self, segment: Segment) -> None:
        """Frees a handed-over or scratch segment (a trainer's mapping of it stays valid;
        the warm pool makes what the next restore lands in)."""
        self._in_use -= segment.nbytes
        self._destroy(segment)

    def free(self, held: Rank, step: int) -> None:
        """Drops ``held``'s copy of ``step``, its record first (a restart must not bring it
        back); a pinned copy lingers until its last unpin."""
        rank_step = held.steps.pop(step)
        persistence.remove(rank_step.segment.path)
        if rank_step.pins:
            rank_step.released = True
            self._lingering.append(rank_step)
            return
        self._dispose(rank_step)

    def free_all(self, held: Rank) -> None:
        for step in list(held.steps):
            self.free(held, step)

    def unpin(self, rank_step: RankStep) -> None:
        rank_step.pins -= 1
        if rank_step.released and rank_step.pins == 0:
            self._lingering.remove(rank_step)
            self._dispose(rank_step)

    def close(self) -> None:
        self.pool.close()

    def _dispose(self, rank_step: RankStep) -> None:
        segment = rank_step.segment
        self._in_use -= segment.nbytes
        self.pool_changed.set()
        # A segment someone may still write into (an unfinished copy) or read from
        # (a restore) is never handed to another step: it is unlinked instead.
        if segment.handed_out or rank_step.state is CopyState.STAGING:
            self._destroy(segment)
        else:
            self.pool.release(segment)

    def _destroy(self, segment: Segment) -> None:
        if self.reaped:
            self.pool.doom(segment)
        else:
            segment.destroy()
        self.pool_changed.set()
