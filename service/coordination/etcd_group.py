"""A daemon's place in a group coordinated through etcd (``--coordination etcd://...``).

Membership comes from leases, not polling: each daemon holds one ring
position (a ``slots/`` key under its lease) and renews the lease; a daemon
that dies stops renewing, and etcd removes its slot and its holdings after
the lease's TTL, which every daemon sees on its watch. The ring order is the
slot order, so it stays put when a host is replaced: the replacement takes
the free slot (its old one when it restarts under the same name). One
position has one owner: a daemon whose lease may have run out (etcd away, or
the daemon cut off from it, for a TTL) steps down before etcd could give its
position away, and takes a free one, if any, once etcd answers (``seat``).
A daemon that took a position marks it ready once it published what it
holds; a restore waits for every position to be marked (``wait_ready``).

What a daemon holds is published as keys (see ``keys``); a daemon reads back
only the holders of the ranks it holds (for re-replication), one request
whatever the group's size, and watches the slots, the layouts (they change
only when ranks register) and the per-job summaries. The aggregator, the
live daemon with the lowest index, alone watches every holding and writes
the summaries (committed and restorable steps, from the pure group view).
So a daemon's coordination traffic in steady state does not grow with the
group; the aggregator's grows with it, and a restore reads the job's
holdings once.
"""

import logging
import threading
import time

from bubblesnap.service.coordination import keys as keys_lib
from bubblesnap.service.coordination.etcd_kv import EtcdKV, EtcdUnavailable, parse_endpoints
from bubblesnap.service.coordination.mirror import Mirror
from bubblesnap.service.coordination.options import CoordinationOptions
from bubblesnap.service.coordination.seat import Seat
from bubblesnap.service.errors import Unavailable
from bubblesnap.service.peers import group_view

log = logging.getLogger("bubblesnap.daemon")

__all__ = ["CoordinationOptions", "EtcdGroup"]  # the options live in options.py


class EtcdGroup:
    """Membership, holdings and summaries of one daemon through etcd."""

    def __init__(self, options: CoordinationOptions, address: str, copies_wanted: int,
                 lease_seconds: float, kv=None):
        self.options = options
        self.keys = keys_lib.Keys(options.prefix.rstrip("/"))
        self._kv = kv if kv is not None else EtcdKV(parse_endpoints(options.url))
        self._address = address
        self._wanted = copies_wanted
        self._seat = Seat(self._kv, self.keys, options, address, options.name or address,
                          max(2, round(lease_seconds)), self._seated)
        self._published: dict[str, dict[str, bytes]] = {}  # job -> holding keys put
        self._published_generation = 0  # the lease those keys went under
        self._ready_generation = -1  # the lease under which ready/<index> was put
        self._layouts: dict[str, bytes] = {}  # layout keys put (put again on a new lease)
        self._members: list[str] = [""] * options.group_size  # slot holders etcd showed
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._stopped = threading.Event()
        self._summarize = threading.Event()
        self._holdings_mirror: Mirror | None = None
        self._slots = Mirror(self._kv, self.keys.slots(), self._members_changed)
        self._summaries = Mirror(self._kv, self.keys.summaries(), self._summaries_changed)
        self._summaries_seen: dict[str, bytes] = {}
        self._on_summary = lambda job: None
        self._on_seated = lambda index: None
        self._layout_mirror = Mirror(self._kv, self.keys.layouts())
        self._aggregator = threading.Thread(target=self._aggregate, name="etcd-aggregator",
                                            daemon=True)

    # -- membership ---------------------------------------------------------

    @property
    def index(self) -> int:
        """This daemon's ring position now; -1 while it holds none (its lease may have
        run out, or every position is another daemon's): see ``seat``."""
        return self._seat.index

    @property
    def last_index(self) -> int:
        """The position held now, or the one held last while none is."""
        return self._seat.last_index

    @property
    def _lease(self) -> int:  # the group_scale benchmark expires a daemon's lease by it
        return self._seat.lease

    def start(self, preferred: int = -1) -> int:
        """Takes a ring position (:meth:`claim`) and starts watching the group and renewing
        the lease; the position's index."""
        self.claim(preferred)
        self.watch()
        return self.index

    def claim(self, preferred: int = -1) -> int:
        """Takes a ring position (``preferred``, else the one this name held last, else
        the first free one) under a new lease; its index. Unavailable when etcd does not
        answer or no position frees within ``claim_timeout_seconds``."""
        return self._seat.claim(preferred)

    def watch(self) -> None:
        """Starts the watches, the lease's renewal and the aggregator's thread."""
        for mirror in (self._slots, self._summaries, self._layout_mirror):
            mirror.start()
        for mirror in (self._slots, self._summaries, self._layout_mirror):
            mirror.wait_synced(self.options.claim_timeout_seconds)
        self._seat.start()
        self._aggregator.start()
        log.info("ring position %d of %d in etcd group %s (lease %ds)", self.index,
                 self.options.group_size, self.options.prefix, self._seat.ttl)

    def members(self) -> tuple[list[str], set[int]]:
        """(address per ring position, "" where none; the positions held now). This
        daemon counts at the position it holds now (etcd away or not), and not at one
        etcd last showed it at that it no longer holds."""
        index = self.index
        with self._lock:
            addresses = list(self._members)
        for i, address in enumerate(addresses):
            if address == self._address and i != index:
                addresses[i] = ""
        if index >= 0:
            addresses[index] = self._address
        return addresses, {i for i, a in enumerate(addresses) if a}

    def _members_changed(self) -> None:
        addresses = [""] * self.options.group_size
        for index, address in keys_lib.parse_positions(self.keys.slots(),
                                                       self._slots.items()).items():
            if index < len(addresses):
                addresses[index] = address
        with self._lock:
            self._members = addresses
        self._summarize.set()  # the aggregator may have changed

    def is_aggregator(self) -> bool:
        index = self.index
        live = self.members()[1]
        return index >= 0 and min(live) == index

    def listen_seated(self, on_seated) -> None:
        """``on_seated(index)`` runs (on the lease's thread) after this daemon took a ring
        position under a new lease: what it holds is to be published under it."""
        self._on_seated = on_seated

    def _seated(self, index: int) -> None:
        self._summarize.set()
        self._on_seated(index)

    # -- what is held -------------------------------------------------------

    def publish(self, job: str, own) -> bool:
        """Makes etcd show exactly ``own`` (this daemon's committed copies of ``job``)
        under the ring position held now, putting and deleting only what changed;
        whether etcd shows them now. Nothing while no position is held (it may be
        another daemon's); etcd away: tried again next time."""
        with self._publishing:  # one diff at a time, each against what the last one put
            index, lease, generation = self._seat.held()
            if index < 0:
                return False
            want = {self.keys.holding(job, h.rank, h.step, index): keys_lib.holding_value(h)
                    for h in own}
            with self._lock:
                if generation != self._published_generation:  # they went with the old lease
                    self._published, self._published_generation = {}, generation
                had = self._published.get(job, {})
            puts = {k: v for k, v in want.items() if had.get(k) != v}
            deletes = [k for k in had if k not in want]
            if not puts and not deletes:
                return True
            try:
                self._kv.apply(puts, deletes, lease)
            except EtcdUnavailable as err:
                log.debug("publishing the holdings of %s: %s", job, err)
                return False
            with self._lock:
                if generation == self._published_generation:
                    self._published[job] = want
            return True

    def needs_ready(self) -> bool:
        """Whether this daemon holds a position under whose lease it has not yet published
        what it holds (:meth:`publish_held`)."""
        index, _, generation = self._seat.held()
        return index >= 0 and self._ready_generation != generation

    def publish_held(self, held: dict) -> bool:
        """Publishes the layouts registered here and ``held`` (job -> this daemon's
        copies) under the position held now, then marks it ready (``ready/<index>``:
        a restore anywhere waits for every position held to be marked, so it never
        picks a step on holdings a daemon that just took its position has not
        published yet). Whether the position is marked now."""
        index, lease, generation = self._seat.held()
        if index < 0:
            return False
        with self._lock:
            layouts = dict(self._layouts)
        try:
            self._kv.apply(layouts, lease=lease)
            published = all([self.publish(job, own) for job, own in held.items()])
            if published and self._seat.held() == (index, lease, generation):
                self._kv.put(self.keys.ready(index), self._address.encode(), lease)
                self._ready_generation = generation
                return True
        except EtcdUnavailable as err:
            log.info("publishing what is held here under ring position %d: %s", index, err)
        return False

    def wait_ready(self) -> None:
        """Waits, up to ``ready_wait_seconds``, until every other position held is marked
        ready (its daemon published what it held when it took it); past that, says so
        and returns: the caller goes on with what etcd shows. etcd away: at once."""
        deadline = time.monotonic() + self.options.ready_wait_seconds
        waited: set[int] = set()
        while True:
            try:
                _, (slots, ready) = self._kv.ranges([self.keys.slots(), self.keys.readies()])
            except EtcdUnavailable:
                return
            waiting = keys_lib.unready(keys_lib.parse_positions(self.keys.slots(), slots),
                                       keys_lib.parse_positions(self.keys.readies(), ready))
            waiting.discard(self.index)  # its own copies are counted as held now
            if not waiting:
                if waited:
                    log.info("ring positions %s published what they hold", sorted(waited))
                return
            if time.monotonic() > deadline:
                log.warning("ring positions %s were taken but have not published what they "
                            "hold after %g s; going on with the holdings etcd shows",
                            sorted(waiting), self.options.ready_wait_seconds)
                return
            if not waited:
                log.info("waiting up to %g s for ring positions %s to publish what they hold",
                         self.options.ready_wait_seconds, sorted(waiting))
            waited |= waiting
            self._stopped.wait(0.05)

    def forget(self, job: str) -> None:
        """``job`` was deleted here: its holdings and layouts leave etcd."""
        prefix = self.keys.layouts(job)
        with self._lock:
            gone = list(self._published.pop(job, {}))
            gone += [k for k in self._layouts if k.startswith(prefix)]
            for key in gone:
                self._layouts.pop(key, None)
        try:
            self._kv.apply({}, gone)
        except EtcdUnavailable as err:
            log.info("forgetting %s in etcd: %s", job, err)

    def publish_layout(self, job: str, rank: int, value: bytes) -> None:
        """Publishes a rank's layout under the lease; held no position: once one is."""
        key = self.keys.layout(job, rank)
        with self._lock:
            self._layouts[key] = value
        index, lease, _ = self._seat.held()
        if index < 0:
            return  # publish_held puts it, once a position is taken
        try:
            self._kv.put(key, value, lease)
        except EtcdUnavailable as err:
            log.info("publishing the layout of rank %d of %s: %s", rank, job, err)

    def layouts(self, job: str) -> list[bytes]:
        """The layouts every daemon published for ``job`` (RankLayout messages)."""
        prefix = self.keys.layouts(job)
        return [v for k, v in sorted(self._layout_mirror.items().items()) if k.startswith(prefix)]

    def holdings_of(self, job: str, ranks) -> list[group_view.Holding]:
        """Every daemon's copies of ``ranks`` of ``job``, read now (one request)."""
        ranks = sorted(set(ranks))
        if not ranks:
            return []
        _, found = self._kv.ranges([self.keys.rank_holdings(job, r) for r in ranks])
        return keys_lib.parse_holdings(kv for kvs in found for kv in kvs.items())

    def all_holdings(self, job: str) -> list[group_view.Holding]:
        """Every copy of ``job`` in the group, read now (a restore decides on this)."""
        try:
            _, found = self._kv.range(self.keys.holdings(job))
        except EtcdUnavailable as err:
            raise Unavailable(f"the holdings of job {job!r} cannot be read from etcd "
                              f"({err}); the step to restore is not known. Try again") from None
        return keys_lib.parse_holdings(found.items())

    def listen(self, on_summary) -> None:
        """``on_summary(job)`` runs (on a watch thread) when a job's summary changed."""
        self._on_summary = on_summary

    def _summaries_changed(self) -> None:
        prefix = self.keys.summaries()
        now = {self.keys.job_of(k, prefix): v for k, v in self._summaries.items().items()}
        changed = [job for job, v in now.items() if self._summaries_seen.get(job) != v]
        self._summaries_seen = now
        for job in changed:
            self._on_summary(job)

    def summary(self, job: str) -> tuple[list[int], list[int]] | None:
        """(committed, restorable) steps of ``job`` as the aggregator last wrote them."""
        value = self._summaries.items().get(self.keys.summary(job))
        return keys_lib.parse_summary(value) if value else None

    # -- the aggregator -----------------------------------------------------

    def _aggregate(self) -> None:
        while not self._stopped.is_set():
            self._summarize.wait(1.0)
            self._summarize.clear()
            if not self.is_aggregator():
                if self._holdings_mirror is not None:
                    self._holdings_mirror.stop()
                    self._holdings_mirror = None
                continue
            if self._holdings_mirror is None:
                self._holdings_mirror = Mirror(self._kv, self.keys.holdings(),
                                               self._summarize.set).start()
                continue
            if not self._holdings_mirror.wait_synced(0):
                continue  # not read yet: its empty view would drop every summary
            try:
                self._write_summaries(self._holdings_mirror.items())
            except EtcdUnavailable as err:
                log.debug("writing summaries: %s", err)
            self._stopped.wait(0.05)  # coalesce a burst of holdings into one summary

    def _write_summaries(self, items: dict[str, bytes]) -> None:
        prefix = self.keys.holdings()
        by_job: dict[str, list] = {}
        for key, value in items.items():
            by_job.setdefault(self.keys.job_of(key, prefix), []).extend(
                keys_lib.parse_holdings([(key, value)]))
        by_job = {job: holdings for job, holdings in by_job.items() if holdings}
        current = self._summaries.items()
        for job, holdings in by_job.items():
            world = max(h.world_size for h in holdings)
            value = keys_lib.summary_value(
                group_view.committed_steps(world, holdings, self._wanted),
                group_view.restorable_steps(world, holdings))
            if current.get(self.keys.summary(job)) != value:
                self._kv.put(self.keys.summary(job), value)
        # A job nobody holds any more (deleted) must not keep claiming committed steps.
        gone = [key for key in current if self.keys.job_of(key, self.keys.summaries())
                not in by_job]
        if gone:
            self._kv.apply({}, gone)

    def stop(self) -> None:
        """Gives the ring position back at once (a planned stop is not a failure)."""
        self._stopped.set()
        self._seat.stop()
        for mirror in (self._slots, self._summaries, self._layout_mirror,
                       self._holdings_mirror):
            if mirror is not None:
                mirror.stop()
        try:
            if self._lease:
                self._kv.revoke(self._lease)
        except EtcdUnavailable:
            pass  # the lease runs out by itself
        self._kv.close()
