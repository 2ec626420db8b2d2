"""The daemon's heartbeat: its clock written into its shared-memory lock file every 10 ms.

A trainer's save that finds its last call unanswered must tell a busy daemon
(wait for it, as Orbax's manager waits for its previous save) from a frozen or
dead one (skip the snapshot at once: training never waits on a sick daemon).
Asking the daemon would be a call that a frozen daemon never answers; reading a
file it writes costs nothing. The lock file of the daemon's segment directory
(held with ``flock`` for the daemon's whole life, readable by the trainers that
map its segments) carries it, laid out as ``bubblesnap.shared.heartbeat_file`` says:
the daemon's clock, and its pid and start time, by which a trainer that sees
its process asks the kernel whether it is stopped.
"""

import logging
import os
import threading
import time

from bubblesnap.shared import heartbeat_file

log = logging.getLogger("bubblesnap.daemon")

#: How often the clock is written (a trainer that cannot see the daemon's process
#: takes a clock older than ``ClientOptions.sick_after_seconds`` for a frozen daemon).
INTERVAL_SECONDS = 0.01


class Heartbeat:
    """Writes ``time.monotonic()`` (with this process's pid and start time) into ``path``
    every :data:`INTERVAL_SECONDS` on a thread of its own, from :meth:`start` until
    :meth:`stop`."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY)
        own = heartbeat_file.process_state(os.getpid())
        self._pid, self._start = (os.getpid(), own[1]) if own else (0, 0)
        self._stopped = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _beat(self) -> None:
        os.pwrite(self._fd, heartbeat_file.pack(time.monotonic(), self._pid, self._start), 0)

    def _run(self) -> None:
        while not self._stopped.wait(INTERVAL_SECONDS):
            try:
                self._beat()
            except OSError as err:  # the directory removed under a running daemon
                log.warning("heartbeat: %s; trainers will take this daemon for frozen", err)
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        os.close(self._fd)
