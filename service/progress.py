"""Long work in flight (a restore reading a copy, a durable write): bytes done of a total.

Status reports it, so ``bubblesnap status --watch`` and a restoring client
can show a progress bar with the rate and the time left, for work that runs
inside the daemon where the caller sees nothing else of it.
"""

import contextlib
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


class Progress:
    """The work in flight now; thread-safe (TensorStore's and the data channel's threads
    report bytes as they land)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def track(self, kind: str, job: str, rank: int, step: int, total_bytes: int):
        """Tracks work of ``total_bytes`` while the block runs; yields ``done(nbytes)``, to
        call as bytes are done. The entry goes when the block ends, however it ends."""
        key = next(self._ids)
        entry = _Entry(kind, job, rank, step, total_bytes, time.monotonic())
        with self._lock:
            self._entries[key] = entry

        def done(nbytes: int) -> None:
            with self._lock:
                entry.done = min(entry.total, entry.done + nbytes)

        try:
            yield done
        finally:
            with self._lock:
                del self._entries[key]

    def in_flight(self, job: str = "") -> list[InFlight]:
        """What runs now (of ``job``; every job when empty), oldest first."""
        now = time.monotonic()
        with self._lock:
            return [InFlight(e.kind, e.job, e.rank, e.step, e.done, e.total, now - e.started)
                    for e in self._entries.values() if not job or e.job == job]
