"""A daemon's place in a group coordinated through etcd (``--coordination etcd://...``).

Membership comes from leases, not polling: each daemon holds one ring
position (a ``slots/`` key under its lease) and renews the lease; a daemon
that dies stops renewing, and etcd removes its slot and its holdings after
the lease's TTL, which every daemon sees on its watch. The ring order is the
slot order, so it stays put when a host is replaced: the replacement takes
the free slot (its old one when it restarts under the same name).

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

import dataclasses
import logging
import threading
import time

from bubblesnap.options import require
from bubblesnap.service.coordination import keys as keys_lib
from bubblesnap.service.coordination.etcd_kv import EtcdKV, EtcdUnavailable, parse_endpoints
from bubblesnap.service.coordination.mirror import Mirror
from bubblesnap.service.errors import Unavailable
from bubblesnap.service.peers import group_view

log = logging.getLogger("bubblesnap.daemon")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinationOptions:
    """The etcd backend of a daemon group (``bubblesnap daemon`` flags in brackets).

    Attributes:
      url: ``etcd://HOST:PORT[,HOST:PORT...]``, the etcd cluster's client
        endpoints (``--coordination``). Empty: the static ``--peers`` ring.
      prefix: where this group's keys live in etcd; one prefix per group
        (``--coordination-prefix``). Default ``/bubblesnap/default``.
      group_size: ring positions, the daemons the group is made for
        (``--group-size``). Needed with ``url``.
      name: this daemon's stable name, which keeps its ring position over
        restarts (``--name``). Default: its peer address.
      claim_timeout_seconds: how long a starting daemon waits for a free ring
        position (a dead daemon's frees when its lease runs out). Default 60 s.
    """

    url: str = ""
    prefix: str = "/bubblesnap/default"
    group_size: int = 0
    name: str = ""
    claim_timeout_seconds: float = 60.0

    def __post_init__(self):
        if self.url:
            try:
                parse_endpoints(self.url)
            except ValueError as err:
                require(self, "url", False, f"etcd://HOST:PORT[,HOST:PORT...] ({err})",
                        "--coordination")
            require(self, "group_size", self.group_size >= 2, "2 or more with --coordination",
                    "--group-size")
        require(self, "prefix", self.prefix.startswith("/") and len(self.prefix) > 1
                and "//" not in self.prefix, "an absolute key prefix such as /bubblesnap/prod",
                "--coordination-prefix")
        require(self, "claim_timeout_seconds", self.claim_timeout_seconds > 0, "positive")

    @property
    def enabled(self) -> bool:
        return bool(self.url)


class EtcdGroup:
    """Membership, holdings and summaries of one daemon through etcd."""

    def __init__(self, options: CoordinationOptions, address: str, copies_wanted: int,
                 lease_seconds: float, kv=None):
        self.options = options
        self.keys = keys_lib.Keys(options.prefix.rstrip("/"))
        self._kv = kv if kv is not None else EtcdKV(parse_endpoints(options.url))
        self._address = address
        self._name = options.name or address
        self._wanted = copies_wanted
        self._ttl = max(2, round(lease_seconds))
        self.index = -1
        self._lease = 0
        self._generation = 0  # bumped with each new lease
        self._published: dict[str, dict[str, bytes]] = {}  # job -> holding keys put
        self._layouts: dict[str, bytes] = {}  # layout keys put (put again on a new lease)
        self._members: tuple[list[str], set[int]] = ([""] * options.group_size, set())
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._stopped = threading.Event()
        self._summarize = threading.Event()
        self._holdings_mirror: Mirror | None = None
        self._slots = Mirror(self._kv, self.keys.slots(), self._members_changed)
        self._summaries = Mirror(self._kv, self.keys.summaries(), self._summaries_changed)
        self._summaries_seen: dict[str, bytes] = {}
        self._on_summary = lambda job: None
        self._layout_mirror = Mirror(self._kv, self.keys.layouts())
        self._threads = [threading.Thread(target=self._keep_alive, name="etcd-lease",
                                          daemon=True),
                         threading.Thread(target=self._aggregate, name="etcd-aggregator",
                                          daemon=True)]

    # -- membership ---------------------------------------------------------

    def start(self, preferred: int = -1) -> int:
        """Takes a ring position (:meth:`claim`) and starts watching the group and renewing
        the lease; the position's index."""
        self.claim(preferred)
        self.watch()
        return self.index

    def claim(self, preferred: int = -1) -> int:
        """Takes a ring position (``preferred``, else the one this name held last,
        else the first free one) under a new lease; its index. Unavailable when etcd
        does not answer or no position frees within ``claim_timeout_seconds``."""
        deadline = time.monotonic() + self.options.claim_timeout_seconds
        try:
            self._lease = self._kv.grant(self._ttl)
            self.index = self._claim(preferred, deadline)
            self._kv.put(self.keys.name(self._name), str(self.index).encode())
        except EtcdUnavailable as err:
            raise Unavailable(f"--coordination {self.options.url}: {err}") from None
        return self.index

    def watch(self) -> None:
        """Starts the watches, the lease's renewal and the aggregator's thread."""
        for mirror in (self._slots, self._summaries, self._layout_mirror):
            mirror.start()
        for mirror in (self._slots, self._summaries, self._layout_mirror):
            mirror.wait_synced(self.options.claim_timeout_seconds)
        for thread in self._threads:
            thread.start()
        log.info("ring position %d of %d in etcd group %s (lease %ds)", self.index,
                 self.options.group_size, self.options.prefix, self._ttl)

    def _claim(self, preferred: int, deadline: float) -> int:
        size = self.options.group_size
        if preferred < 0:
            last = self._kv.get(self.keys.name(self._name))
            preferred = int(last) if last and last.isdigit() and int(last) < size else -1
        while True:
            order = [preferred] if preferred >= 0 else []
            order += [i for i in range(size) if i != preferred] if preferred < 0 else []
            for index in order:
                if self._kv.create(self.keys.slot(index), self._address.encode(), self._lease):
                    return index
            if self._kv.keepalive(self._lease) <= 0:  # a long wait outlives the TTL
                self._lease = self._kv.grant(self._ttl)
            if time.monotonic() > deadline:
                what = f"ring position {preferred}" if preferred >= 0 else \
                    f"a free one of the {size} ring positions"
                raise Unavailable(
                    f"{what} stayed taken in etcd group {self.options.prefix} for "
                    f"{self.options.claim_timeout_seconds:g} s; a daemon that holds it is "
                    "alive, or --group-size is too small")
            time.sleep(0.5)

    def members(self) -> tuple[list[str], set[int]]:
        """(address per ring position, "" where none; the positions held now)."""
        with self._lock:
            addresses, live = self._members
            return list(addresses), set(live)

    def _members_changed(self) -> None:
        addresses = [""] * self.options.group_size
        for key, value in self._slots.items().items():
            index = keys_lib.parse_slot(self.keys, key)
            if index is not None and index < len(addresses):
                addresses[index] = value.decode()
        live = {i for i, a in enumerate(addresses) if a}
        if self.index >= 0:
            live.add(self.index)  # this daemon counts itself while etcd is away
            addresses[self.index] = self._address
        with self._lock:
            self._members = (addresses, live)
        self._summarize.set()  # the aggregator may have changed

    def is_aggregator(self) -> bool:
        live = self.members()[1]
        return bool(live) and min(live) == self.index

    def _keep_alive(self) -> None:
        while not self._stopped.wait(self._ttl / 3):
            try:
                if self._kv.keepalive(self._lease) > 0:
                    continue
                log.warning("the etcd lease ran out (etcd away longer than %d s): taking ring "
                            "position %d again and publishing what is held", self._ttl,
                            self.index)
                lease = self._kv.grant(self._ttl)
                with self._lock:
                    self._lease = lease
                    self._generation += 1  # a publish in flight must not record its keys
                    self._published.clear()  # their keys went with the old lease
                self._claim(self.index, time.monotonic() + self.options.claim_timeout_seconds)
                with self._lock:
                    layouts = dict(self._layouts)
                self._kv.apply(layouts, lease=self._lease)
            except (EtcdUnavailable, Unavailable) as err:
                log.info("etcd lease renewal: %s", err)

    # -- what is held -------------------------------------------------------

    def publish(self, job: str, own) -> None:
        """Makes etcd show exactly ``own`` (this daemon's committed copies of ``job``),
        putting and deleting only what changed; etcd away: tried again next time."""
        want = {self.keys.holding(job, h.rank, h.step, self.index): keys_lib.holding_value(h)
                for h in own}
        with self._publishing:  # one diff at a time, each against what the last one put
            with self._lock:
                had, lease, generation = (self._published.get(job, {}), self._lease,
                                          self._generation)
            puts = {k: v for k, v in want.items() if had.get(k) != v}
            deletes = [k for k in had if k not in want]
            if not puts and not deletes:
                return
            try:
                self._kv.apply(puts, deletes, lease)
            except EtcdUnavailable as err:
                log.debug("publishing the holdings of %s: %s", job, err)
                return
            with self._lock:
                if generation == self._generation:
                    self._published[job] = want

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
        key = self.keys.layout(job, rank)
        with self._lock:
            self._layouts[key] = value
        try:
            self._kv.put(key, value, self._lease)
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
