"""A background thread that does queued work in batches (replication, durable writes).

Work is submitted per key (a job's rank, say). While the thread is busy,
submissions pile up; when it wakes it takes everything waiting at once, so a
burst of commits costs one round, and the handler can collapse what fell
behind (the replicator and the durable tier keep one step per rank). An
optional tick runs every ``every_seconds`` between batches.
"""

import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger("bubblesnap.daemon")


class CoalescingWorker:
    """Runs ``work(batch)`` on its own thread with ``batch``: key -> items, oldest first.

    ``tick()`` runs every ``every_seconds`` (None: never) and after a batch
    once it is due. ``discard(item)`` gets every item that will never be
    worked on (dropped, or waiting at :meth:`stop`). An exception in
    ``work`` or ``tick`` is logged and the thread goes on: a bug must not end
    replication or durable writes for good.
    """

    def __init__(self, name: str, work: Callable[[dict], None],
                 tick: Callable[[], None] | None = None, every_seconds: float | None = None,
                 discard: Callable[[object], None] = lambda item: None):
        self._name = name
        self._work, self._tick, self._every = work, tick, every_seconds
        self._discard = discard
        self._waiting: dict[Hashable, list] = {}
        self._wake = threading.Condition()
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, key: Hashable, item) -> None:
        with self._wake:
            self._waiting.setdefault(key, []).append(item)
            self._wake.notify()

    def drop(self, keep: Callable[[Hashable, object], bool]) -> None:
        """Drops waiting items for which ``keep(key, item)`` is false."""
        dropped = []
        with self._wake:
            for key, items in list(self._waiting.items()):
                kept = [item for item in items if keep(key, item)]
                dropped += [item for item in items if not keep(key, item)]
                if kept:
                    self._waiting[key] = kept
                else:
                    del self._waiting[key]
        for item in dropped:
            self._discard(item)

    def stop(self, timeout: float) -> bool:
        """Drops what waits, lets the batch in progress finish for up to ``timeout``
        seconds; whether the thread ended."""
        self.stopping.set()
        with self._wake:
            waiting, self._waiting = self._waiting, {}
            self._wake.notify()
        for items in waiting.values():
            for item in items:
                self._discard(item)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self.stopping.is_set():
            with self._wake:
                while not self._waiting and not self.stopping.is_set():
                    timeout = None if self._every is None else next_tick - time.monotonic()
                    if timeout is not None and timeout <= 0:
                        break
                    self._wake.wait(timeout)
                batch, self._waiting = self._waiting, {}
            if self.stopping.is_set():
                for items in batch.values():
                    for item in items:
                        self._discard(item)
                return
            if batch:
                self._guarded(self._work, batch)
            if self._tick is not None and time.monotonic() >= next_tick:
                self._guarded(self._tick)
                next_tick = time.monotonic() + self._every

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s: a round failed", self._name)
