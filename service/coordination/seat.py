"""A daemon's ring position, held under an etcd lease, and whether it is held *now*.

etcd drops a daemon's slot when its lease runs out, and may give it to
another daemon (a replacement) at once. A daemon cut off from etcd cannot
learn that, so it judges for itself: etcd restarts a lease's TTL when a
renewal arrives, which is after the daemon sent it, so the lease runs at
least until the last successful renewal was *sent* plus the TTL. Past that
moment the daemon may have lost its position and steps down: :attr:`Seat.index`
is -1 (nothing is published under the old index, the daemon does not count
itself a member), without asking etcd. When etcd answers again, a lease that
still runs gives the position back (nobody could take it meanwhile); one that
ran out is replaced, and a position is taken afresh: the old one if it is
free, else the first free one, else none: the daemon stays out of the ring,
serving what it holds to its trainers, and tries again at each renewal.
"""

import logging
import math
import threading
import time

from bubblesnap.service.coordination import keys as keys_lib
from bubblesnap.service.coordination.etcd_kv import EtcdUnavailable
from bubblesnap.service.errors import Unavailable

log = logging.getLogger("bubblesnap.daemon")


class Seat:
    """One ring position under a lease: claimed, renewed, given up when it may be lost,
    taken again. ``on_seated(index)`` runs (on the lease's thread) after a position
    was taken under a new lease, once the daemon is running."""

    def __init__(self, kv, keys: keys_lib.Keys, options, address: str, name: str,
                 ttl: int, on_seated=lambda index: None):
        self._kv, self._keys, self._options = kv, keys, options
        self._address, self._name = address, name
        self.ttl = ttl
        self._on_seated = on_seated
        self._lock = threading.Lock()
        self._lease = 0
        self._index = -1      # the position taken under the current lease, -1 none
        self._last = -1       # the position held last (preferred when taking one again)
        self._sent = 0.0      # when the last successful grant or renewal was sent
        # Judged only once start() renews the lease: a caller that drives a group
        # itself (benchmarks/group_scale.py) holds its position as long as it says.
        self._deadline = math.inf
        self._generation = 0  # bumped with each new lease
        self._said = ""       # the state the log last reported: "down", "out" or ""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="etcd-lease",
                                        daemon=True)

    # -- what is held --------------------------------------------------------------

    def held(self) -> tuple[int, int, int]:
        """(index, lease, generation) at one instant; index -1 while no position is held:
        none taken, or the lease may have run out (not renewed for a TTL)."""
        with self._lock:
            index = self._index if time.monotonic() < self._deadline else -1
            return index, self._lease, self._generation

    @property
    def index(self) -> int:
        """The ring position held now; -1 while none is (see :meth:`held`)."""
        return self.held()[0]

    @property
    def last_index(self) -> int:
        """The position held now or, while none is, the one held last (-1: never one)."""
        with self._lock:
            return self._last

    @property
    def lease(self) -> int:
        with self._lock:
            return self._lease

    # -- taking a position at start ------------------------------------------------

    def claim(self, preferred: int = -1) -> int:
        """Takes a ring position under a new lease: ``preferred`` (``--index``), else as
        ``keys.claim_order`` says for the one this name held last; waits up to the
        claim timeout for one to free. Unavailable when etcd does not answer or none
        frees in time."""
        deadline = time.monotonic() + self._options.claim_timeout_seconds
        try:
            self._grant()
            index = self._claim(preferred, deadline)
            with self._lock:
                self._index = self._last = index
            self._kv.put(self._keys.name(self._name), str(index).encode())
        except EtcdUnavailable as err:
            raise Unavailable(f"--coordination {self._options.url}: {err}") from None
        return index

    def _claim(self, preferred: int, deadline: float) -> int:
        size, explicit = self._options.group_size, preferred >= 0
        if not explicit:
            last = self._kv.get(self._keys.name(self._name))
            preferred = int(last) if last and last.isdigit() and int(last) < size else -1
        while True:
            held = {} if explicit else self._slots()
            order = keys_lib.claim_order(size, preferred, explicit, held, self._address)
            for index in order:
                if self._kv.create(self._keys.slot(index), self._address.encode(),
                                   self.lease):
                    return index
            sent = time.monotonic()
            if self._kv.keepalive(self.lease) <= 0:  # a long wait outlives the TTL
                self._grant()
            else:
                with self._lock:
                    self._sent = sent
            if time.monotonic() > deadline:
                if explicit:
                    what = f"ring position {preferred}"
                elif held.get(preferred) == self._address:
                    what = (f"ring position {preferred} (held under this daemon's address by "
                            "an earlier run whose lease did not run out)")
                else:
                    what = f"a free one of the {size} ring positions"
                raise Unavailable(
                    f"{what} stayed taken in etcd group {self._options.prefix} for "
                    f"{self._options.claim_timeout_seconds:g} s; a daemon that holds it is "
                    "alive, or --group-size is too small")
            time.sleep(0.5)

    def _grant(self) -> int:
        sent = time.monotonic()
        lease = self._kv.grant(self.ttl)
        with self._lock:
            self._lease, self._sent = lease, sent
            if self._deadline != math.inf:
                self._deadline = sent + self.ttl
        return lease

    def _slots(self) -> dict[int, str]:
        _, found = self._kv.range(self._keys.slots())
        return keys_lib.parse_positions(self._keys.slots(), found)

    # -- renewal -------------------------------------------------------------------

    def start(self) -> None:
        """Judges the lease from its last renewal on, renews it once now (so a long
        start-up that outlived it is found at once) and then every third of its TTL."""
        with self._lock:
            self._deadline = self._sent + self.ttl
        self._renew()
        self._thread.start()

    def stop(self) -> None:
        """Ends the renewal; the position is held until the lease is revoked or runs out."""
        self._stopped.set()

    def _renew_loop(self) -> None:
        while not self._stopped.wait(self.ttl / 3):
            try:
                self._renew()
            except Exception:  # a bug must not end the renewal for good: the position goes
                log.exception("renewing the etcd lease failed")

    def _renew(self) -> None:
        lease = self.lease
        sent = time.monotonic()
        try:
            if self._kv.keepalive(lease) <= 0:
                self._lost()
                return
            with self._lock:
                if self._lease == lease:
                    self._sent, self._deadline = sent, sent + self.ttl
                index = self._index
            if index < 0:
                self._take()  # out of the ring: a position may have freed
            elif self._said == "down":
                self._said = ""
                log.warning("ring position %d is held again: its lease still ran when etcd "
                            "answered again", index)
        except (EtcdUnavailable, Unavailable) as err:
            self._unreachable(err)

    def _unreachable(self, err) -> None:
        with self._lock:
            index, lapsed = self._index, time.monotonic() >= self._deadline
        if index >= 0 and lapsed and self._said != "down":
            self._said = "down"
            log.warning("stepping down from ring position %d: its lease was not renewed for "
                        "%d s (%s), so it may belong to another daemon now; nothing is "
                        "published under it until etcd answers again", index, self.ttl, err)
        else:
            log.info("etcd lease renewal: %s", err)

    def _lost(self) -> None:
        """The lease ran out: the position may be another daemon's now. A new lease,
        then a position under it (publishes in flight under the old one are not
        recorded: the generation moved on)."""
        with self._lock:
            old, self._index = self._last, -1
            self._generation += 1
        log.warning("the etcd lease of ring position %d ran out (etcd away, or this daemon "
                    "cut off from it, for longer than %d s): taking a ring position under a "
                    "new lease", old, self.ttl)
        self._grant()
        self._take()

    def _take(self) -> None:
        """One try at a position: the one held last if free, else the first free one;
        none free: out of the ring until a renewal finds one."""
        lease, prefer = self.lease, self.last_index
        for index in keys_lib.claim_order(self._options.group_size, prefer, False,
                                          self._slots(), self._address):
            if not self._kv.create(self._keys.slot(index), self._address.encode(), lease):
                continue
            with self._lock:
                self._index = self._last = index
            self._said = ""
            log.warning("took ring position %d%s under a new lease; publishing what is held "
                        "here under it", index, "" if index == prefer else
                        f" (position {prefer} is another daemon's now)")
            self._on_seated(index)
            self._kv.put(self._keys.name(self._name), str(index).encode())
            return
        if self._said != "out":
            self._said = "out"
            log.warning("out of the ring: all %d ring positions are held by other daemons. "
                        "Serving what is held here to its trainers, publishing nothing, and "
                        "trying again every %.1f s", self._options.group_size, self.ttl / 3)
