"""A copy of the keys under one etcd prefix, kept current by a watch.

Read once, then watched from the next revision; when the stream breaks (etcd
restarted, the revision compacted, the network gone) the prefix is read
afresh and watched again, so no change is missed for long. While etcd is
away the copy stays as last seen: the daemons go on with what they knew.
"""

import logging
import threading

from bubblesnap.service.coordination.etcd_kv import EtcdUnavailable

log = logging.getLogger("bubblesnap.daemon")


class Mirror:
    """The keys under ``prefix`` -> value; ``on_change()`` after each change lands."""

    def __init__(self, kv, prefix: str, on_change=None, retry_seconds: float = 0.5):
        self._kv = kv
        self.prefix = prefix
        self._on_change = on_change or (lambda: None)
        self._retry = retry_seconds
        self._items: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._synced = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)

    def start(self) -> "Mirror":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def wait_synced(self, timeout: float) -> bool:
        """Whether the prefix was read at least once within ``timeout`` seconds."""
        return self._synced.wait(timeout)

    def items(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._items)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                revision, found = self._kv.range(self.prefix)
            except EtcdUnavailable as err:
                log.debug("reading %s: %s", self.prefix, err)
                self._stopped.wait(self._retry)
                continue
            with self._lock:
                changed = found != self._items
                self._items = found
            self._synced.set()
            if changed:
                self._on_change()
            self._kv.watch(self.prefix, revision + 1, self._apply, self._stopped)
            self._stopped.wait(self._retry)

    def _apply(self, events, revision: int) -> None:
        with self._lock:
            for key, value in events:
                if value is None:
                    self._items.pop(key, None)
                else:
                    self._items[key] = value
        self._on_change()
