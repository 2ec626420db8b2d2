"""Long work in flight (a restore reading a copy, a durable write): bytes done of a total.

Status reports it, so ``bubblesnap status --watch`` and a restoring client
can show a progress bar with the rate and the time left, for work that runs
inside the daemon where the caller sees nothing else of it.

The bytes are counted where they land (a region read from disk, a range
pulled from a peer), several calls below the one that tracks the work, and
the same code serves work nobody tracks (a replica push): :func:`expect` and
:func:`reporter` reach the work the calling thread's context tracks, and
cost one lookup outside one.
"""

import contextlib
import contextvars
import dataclasses
import itertools
import threading
import time


@dataclasses.dataclass(frozen=True)
class InFlight:
    """One piece of long work: ``kind`` ("restore", "persist"), of which copy, how far."""

    kind: str
    job: str
    rank: int
    step: int
    done_bytes: int
    total_bytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.done_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def seconds_left(self) -> float | None:
        """At the rate so far; None before any byte is done."""
        rate = self.bytes_per_second
        return max(0, self.total_bytes - self.done_bytes) / rate if rate > 0 else None


@dataclasses.dataclass
class _Entry:
    kind: str
    job: str
    rank: int
    step: int
    total: int
    started: float
    done: int = 0


_current: contextvars.ContextVar = contextvars.ContextVar("bubblesnap_progress", default=None)


def expect(nbytes: int) -> None:
    """Adds ``nbytes`` to the total of the work the calling context tracks, if any."""
    current = _current.get()
    if current is not None:
        lock, entry = current
        with lock:
            entry.total += nbytes


def reporter():
    """``done(nbytes)`` for the work the calling context tracks (a no-op if none), to
    call from any thread: capture it here, call it where the bytes land."""
    current = _current.get()
    if current is None:
        return lambda nbytes: None
    lock, entry = current

    def done(nbytes: int) -> None:
        with lock:
            entry.done = min(entry.total, entry.done + nbytes)

    return done


class Progress:
    """The work in flight now; thread-safe (TensorStore's and the data channel's threads
    report bytes as they land)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def track(self, kind: str, job: str, rank: int, step: int, total_bytes: int = 0):
        """Tracks work of ``total_bytes`` (more as :func:`expect` adds) while the block
        runs; yields ``done(nbytes)``, to call as bytes are done (as :func:`reporter`'s
        are). The entry goes when the block ends, however it ends."""
        key = next(self._ids)
        entry = _Entry(kind, job, rank, step, total_bytes, time.monotonic())
        with self._lock:
            self._entries[key] = entry
        token = _current.set((self._lock, entry))
        try:
            yield reporter()
        finally:
            _current.reset(token)
            with self._lock:
                del self._entries[key]

    def in_flight(self, job: str = "") -> list[InFlight]:
        """What runs now (of ``job``; every job when empty), oldest first."""
        now = time.monotonic()
        with self._lock:
            return [InFlight(e.kind, e.job, e.rank, e.step, e.done, e.total, now - e.started)
                    for e in self._entries.values() if not job or e.job == job]
