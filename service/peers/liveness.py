"""Which peers of the static ring answered their last call, and since when the others are
silent: live (answered), not dead (silent for less than ``dead_after_seconds``), dead; and
which live ones were quiet lately (no call answered: a heartbeat asks them)."""

import logging
import threading
import time

log = logging.getLogger("bubblesnap.daemon")


class Liveness:
    """Every peer counts as live until a call to it fails (a peer missed at start-up is
    found again: the replicator's tick announces this daemon to the silent ones)."""

    def __init__(self, size: int, dead_after_seconds: float, address):
        self._dead_after = dead_after_seconds
        self._address = address  # index -> its address, for the log
        self._live = set(range(size))
        self._silent_since: dict[int, float] = {}
        self._answered_at: dict[int, float] = {}
        self._lock = threading.Lock()

    def live(self) -> set[int]:
        with self._lock:
            return set(self._live)

    def not_dead(self) -> set[int]:
        limit = time.monotonic() - self._dead_after
        with self._lock:
            return self._live | {i for i, t in self._silent_since.items() if t > limit}

    def quiet(self, seconds: float) -> set[int]:
        """Peers that answered no call in the last ``seconds`` (or none ever): the silent
        ones, and live ones that nothing was asked of (one cut off or frozen meanwhile
        still counts as live)."""
        limit = time.monotonic() - seconds
        with self._lock:
            return set(self._silent_since) | {
                i for i in self._live if self._answered_at.get(i, float("-inf")) < limit}

    def mark(self, index: int, alive: bool, quiet: bool = False) -> bool:
        """Records how a call to ``index`` went (``quiet``: not logged); returns whether
        it was live before."""
        with self._lock:
            was = index in self._live
            if alive:
                self._answered_at[index] = time.monotonic()
            if alive and not was:
                self._live.add(index)
                self._silent_since.pop(index, None)
            elif not alive and was:
                self._live.discard(index)
                self._silent_since[index] = time.monotonic()
        if was != alive and not quiet:
            if alive:
                log.info("peer %d (%s) is back", index, self._address(index))
            else:
                log.warning("peer %d (%s) is unreachable", index, self._address(index))
        return was
