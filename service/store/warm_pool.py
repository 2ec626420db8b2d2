"""Warm segments made ahead of need: one background thread keeps ``warm_pool_bytes`` of
pre-faulted segments in the pool (segments.py), counted in the memory budget.

A segment made when bytes arrive fills at a fraction of memcpy speed: its
pages are reserved, then faulted in one by one under the copy (tmpfs has no
huge pages). A replacement host's daemon restoring from a peer has nothing
to recycle, so without warm segments every byte of its restore pays that.

Sizes: at start the daemon knows nothing of what it will be asked for, so
the first fill is one segment of the whole size (the first acquire cuts it
to size, giving the tail back). After that the pool refills in the sizes
asked lately (the same layouts restore or arrive again), largest first, as
many of each as fit: a large warm segment serves a smaller ask (cut to
size), never the reverse, and the asks a restore makes come after a job's
snapshots, which may be smaller (a rank's half of a state that one process
restores whole; a staging segment).

Room: a segment is made only while the budget has room for it beside
everything held, and its bytes count as held while it is made
(``Memory.filling_bytes``), so the budget holds at every moment. A copy
that needs room trims warm segments like recycled ones; the pool makes them
again once there is room.

The same thread destroys the segments the store frees that cannot be
reused (a restore's, handed to a trainer): unmapping and unlinking one takes
tens of ms, which no request should wait for, and their bytes count in the
budget until then (an acquire short of room destroys them at once).

When: after a segment is taken, and only while no copy is landing (the
refill's page zeroing would take the cores the arriving bytes need). The
thread runs at the daemon's priority, not below it: a thread niced below the
others takes the GIL (and the store's lock) to run, a loaded host leaves it
off the cores for long stretches while it holds them or while the GIL's
holder waits to hand it over, and every other thread of the daemon waits
with it (a priority inversion: under 4-10 CPU hogs on the
2-core dev VM, an 8 MB peer reshard's median took 1.2-1.5x as long with the
thread at niceness 19, the slowest Status answer 1.6-3x as long).
"""

import logging
import threading
import time

from bubblesnap.service.errors import DaemonError

log = logging.getLogger("bubblesnap.daemon")

#: How often the pool looks for room freed meanwhile (a copy dropped), besides being
#: woken when a segment is taken.
_POLL_SECONDS = 0.5
#: How long the pool waits after a segment could not be made (a full shm dir) before it
#: tries again: not a warning every poll.
_RETRY_SECONDS = 30.0
#: How often the pool looks whether the copies landing (which it never competes with:
#: a refill under a peer's transfer slowed it by half on the 2-core dev VM) are done.
_ARRIVING_POLL_SECONDS = 0.02


class WarmPool:
    """The thread that keeps ``target_bytes`` of warm segments in ``memory``'s pool;
    ``lock`` is the store's (Memory is used under it)."""

    def __init__(self, lock: threading.Lock, memory, target_bytes: int):
        self.target_bytes = target_bytes
        self._lock = lock
        self._memory = memory
        self._closed = False
        self._retry_at = 0.0  # monotonic time before which no segment is made
        self._thread = threading.Thread(target=self._run, name="warm-pool", daemon=True)
        if target_bytes:
            memory.reaped = True
            self._thread.start()

    def close(self) -> None:
        """Stops the thread (a segment being made is destroyed); then the pool may close."""
        with self._lock:
            self._closed = True
        self._memory.pool_changed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._closed:
            if self._memory.arriving:  # a copy is landing: its bytes need the cores first
                time.sleep(_ARRIVING_POLL_SECONDS)
                continue
            self._memory.pool.reap()
            if not self._fill_one():
                self._memory.pool_changed.wait(_POLL_SECONDS)
                self._memory.pool_changed.clear()

    def _fill_one(self) -> bool:
        """Makes one warm segment if one is wanted and fits; whether it did."""
        memory = self._memory
        if time.monotonic() < self._retry_at:
            return False
        with self._lock:
            size = 0 if self._closed else self._next_size()
            if not size or not memory.reserve_filling(size):
                return False
        segment = None
        try:
            segment = memory.pool.new_segment(size)
            segment.prefault()
        except (DaemonError, OSError) as err:  # a full shm dir: try again when woken
            log.warning("could not make a warm segment of %d bytes: %s; trying again in "
                        "%.0f s", size, err, _RETRY_SECONDS)
            self._retry_at = time.monotonic() + _RETRY_SECONDS
            if segment is not None:
                segment.destroy()
            segment = None
        with self._lock:
            memory.filling_bytes -= size
            if segment is not None and self._closed:
                segment.destroy()
            elif segment is not None:
                memory.pool.add_warm(segment)
        return segment is not None

    def _next_size(self) -> int:
        """The size of the next warm segment to make (0: none is wanted)."""
        held, asked = self._memory.pool.warm_sizes()
        return next_size(held, asked, self._memory.filling_bytes, self.target_bytes,
                         self._memory.room_bytes())


def next_size(held: list[int], asked: list[int], filling: int, target: int,
              budget_room: int) -> int:
    """The size of the next warm segment to make, 0 for none (pure): ``held`` the warm
    segments' sizes, ``asked`` the sizes asked lately, ``filling`` the bytes being
    made, ``target`` the pool's size, ``budget_room`` what the budget has room for."""
    room = min(target - sum(held) - filling, budget_room)
    if room <= 0:
        return 0
    if not asked:  # nothing asked yet: one segment of it all, cut to size when taken
        return room if not held and not filling else 0
    return next((size for size in sorted(asked, reverse=True) if size <= room), 0)
