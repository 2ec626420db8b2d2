"""The durable tier's finalized steps as Status and a restore ask for them: answered
within a bound, whatever the storage does.

A store that stops answering (cut off, down) holds each call up to its client's retries
(object_config: about 20 s), and Status or a restore that asked would wait with it. So a
listing runs on a thread of its own (one at a time per job: a second asker waits on the
first) and is waited for up to :data:`LIST_SECONDS`; a storage that did not answer in
time, or failed, is Unavailable, at once for :data:`UNREACHABLE_SECONDS` after (said in
the log once per reason). Never "no steps": a restore that took an unanswered listing
for an empty tier would pick an older step and drop the newer ones as an abandoned
run's. Status shows none (and the writer's failure).
"""

import concurrent.futures
import logging
import threading
import time

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.errors import Unavailable, bounded
from bubblesnap.service.log_once import warn_once

log = logging.getLogger("bubblesnap.daemon")

#: How long a listing is waited for.
LIST_SECONDS = 2.0
#: How long a storage that did not answer a listing is taken to hold nothing.
UNREACHABLE_SECONDS = 10.0


class Listings:
    """The finalized steps of the jobs in ``directory``, each listing bounded."""

    def __init__(self, directory: str):
        self.directory = directory
        self._pool = concurrent.futures.ThreadPoolExecutor(2, "durable-list")
        # (a listing still waiting on a store that is gone when the daemon stops is
        # bounded by the store's own retries: object_config)
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._unreachable_until, self._why = 0.0, ""

    def finalized(self, job: str) -> dict[int, str]:
        """step -> folder of every finalized step of ``job``; Unavailable while the storage
        does not answer."""
        if time.monotonic() < self._unreachable_until:
            raise Unavailable(self._why)
        with self._lock:
            future = self._pending.get(job)
            if future is None or future.done():
                future = self._pending[job] = self._pool.submit(
                    fmt.finalized_steps, self.directory, job)
        try:
            return future.result(timeout=LIST_SECONDS)
        except (concurrent.futures.TimeoutError, OSError) as err:
            self._unreachable_until = time.monotonic() + UNREACHABLE_SECONDS
            why = f"no answer within {LIST_SECONDS:.0f} s" if isinstance(
                err, concurrent.futures.TimeoutError) else str(err)
            self._why = bounded(f"the durable tier {self.directory} cannot be listed ({why}); "
                                f"asked again in {UNREACHABLE_SECONDS:.0f} s")
            warn_once(log, f"list {self.directory}: {why}", "durable: %s", self._why)
            raise Unavailable(self._why) from None
