"""The daemon's heartbeat: its clock written into its shared-memory lock file every 10 ms.

A trainer's save that finds its last call unanswered must tell a busy daemon
(wait for it, as Orbax's manager waits for its previous save) from a frozen,
swapped-out or dead one (skip the snapshot at once: training never waits on a
sick daemon). Asking the daemon would be a call that a frozen daemon never
answers; reading a clock it writes costs nothing and goes stale the moment the
process stops. The lock file of the daemon's segment directory (held with
``flock`` for the daemon's whole life, readable by the trainers that map its
segments) carries it: ``CLOCK_MONOTONIC`` seconds as a native float64 at
offset 0, the clock every process of the host shares.
"""

import logging
import os
import struct
import threading
import time

log = logging.getLogger("bubblesnap.daemon")

#: How often the clock is written: staleness beyond a few of these means the daemon
#: is not running (a trainer's ``ClientOptions.sick_after_seconds``, 0.1 s by default).
INTERVAL_SECONDS = 0.01
#: The value's layout in the file.
FORMAT = "=d"


class Heartbeat:
    """Writes ``time.monotonic()`` into ``path`` every :data:`INTERVAL_SECONDS` on a thread
    of its own, from :meth:`start` until :meth:`stop`."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY)
        self._stopped = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _beat(self) -> None:
        os.pwrite(self._fd, struct.pack(FORMAT, time.monotonic()), 0)

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
