"""Prometheus metrics: store, log, copy and peer gauges and the data channel's bytes sent,
read at scrape time; RPC, phase, bubble and corrupt-copy counters.
``deploy/grafana/bubblesnap.json`` charts them."""

import collections
import contextlib
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: What a snapshot goes through, each timed by ``bubblesnap_phase_seconds``: the trainer's
#: copy into the segment (BeginStep answered to CommitStep arrived), BeginStep, CommitStep,
#: one push to a peer, one durable write of a rank's copy, a Restore.
PHASES = ("fetch", "stage", "commit", "replicate", "persist", "restore")

#: From a small copy's staging (a millisecond) to a large restore from the durable tier.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
            120, 300)

#: Stagings whose commit is still awaited, for the fetch time; a trainer that never commits
#: (killed) must not grow it without bound, so the oldest are forgotten past this.
_OPEN_STAGINGS = 4096


class _StoreCollector:
    """Reads the store, the logs, the group's copies and the peers when Prometheus scrapes,
    so they know nothing of metrics."""

    def __init__(self, store, logs):
        self._store = store
        self._logs = logs
        self.copies = None    # job -> {(rank, step): copies}: Status.copies, once built
        self.group = None     # the PeerGroup, with peers
        self.data = None      # the DataServer, with peers
        self.copies_wanted = 1

    def collect(self):
        memory = self._store.memory()
        for name, value, doc in (
                ("bubblesnap_log_bytes", self._logs.bytes_held(),
                 "Bytes of training and boundary log records held."),
                ("bubblesnap_log_budget_bytes", self._logs.options.max_total_bytes,
                 "The bound on all log records (--log-budget)."),
                ("bubblesnap_memory_budget_bytes", memory.budget_bytes, "Memory budget."),
                ("bubblesnap_memory_used_bytes", memory.used_bytes, "Bytes held by snapshots."),
                ("bubblesnap_memory_pooled_bytes", memory.pooled_bytes,
                 "Freed segments kept for reuse, and warm ones."),
                ("bubblesnap_memory_warm_bytes", memory.warm_bytes,
                 "Pre-faulted segments kept ready for copies that arrive (--warm-pool-bytes)."),
                ("bubblesnap_shm_free_bytes", memory.shm_free_bytes,
                 "Free bytes in the shared-memory filesystem."),
                ("bubblesnap_copies_wanted", self.copies_wanted,
                 "Copies a step needs in the group's memory to be committed (1 + --replicas)."),
                ("bubblesnap_peers", self.group.size if self.group else 1,
                 "Daemons in the ring, this one included."),
                ("bubblesnap_peers_alive", len(self.group.live()) if self.group else 1,
                 "Daemons of the ring that answered their last call, this one included.")):
            yield GaugeMetricFamily(name, doc, value=value)
        if self.group is not None:
            alive = GaugeMetricFamily("bubblesnap_peer_alive", "Per ring position: 1 while "
                                      "its daemon answered its last call (with etcd: holds "
                                      "the position), else 0; this one's included.",
                                      labels=["peer"])
            live = self.group.live()
            for index in range(self.group.size):
                alive.add_metric([str(index)], int(index in live))
            yield alive
            yield GaugeMetricFamily("bubblesnap_ring_index", "This daemon's ring position now; "
                                    "with etcd -1 while it holds none (its lease may have "
                                    "run out, or every position is another daemon's).",
                                    value=self.group.index)
        latest = GaugeMetricFamily("bubblesnap_latest_committed_step",
                                   "Latest step every rank of the job holds.", labels=["job"])
        held = GaugeMetricFamily("bubblesnap_steps_held", "Steps held per job.", labels=["job"])
        copies = GaugeMetricFamily(
            "bubblesnap_newest_step_copies", "Copies in the group's memory of the newest "
            "step held here, of its rank with the fewest.", labels=["job"])
        for job in self._store.jobs():
            latest.add_metric([job.job], job.latest_committed_step)
            held.add_metric([job.job], len(job.steps))
            found = self.copies(job.job) if self.copies else {}
            if found:
                newest = max(step for _, step in found)
                copies.add_metric([job.job], min(n for (_, step), n in found.items()
                                                 if step == newest))
        yield latest
        yield held
        yield copies
        if self.data is not None:
            yield CounterMetricFamily(
                "bubblesnap_data_sent_bytes", "Bytes this daemon's data channel sent to peers: "
                "replicas pushed, copies and slots read for their restores.",
                value=self.data.sent_bytes)


class DaemonMetrics:
    """The daemon's metrics registry and the counters and timers the parts update."""

    def __init__(self, store, logs):
        self.registry = CollectorRegistry()
        self._gauges = _StoreCollector(store, logs)
        self.registry.register(self._gauges)
        self.rpcs = Counter("bubblesnap_rpcs", "RPCs answered, by method and status code.",
                            ["method", "code"], registry=self.registry)
        self.restores = Counter("bubblesnap_restores", "Restores served, by the tier the bytes "
                                "came from (memory, peer, durable).", ["source"],
                                registry=self.registry)
        self._phases = Histogram("bubblesnap_phase_seconds", "Seconds each phase of a "
                                 "snapshot took, those that failed included: " +
                                 ", ".join(PHASES) + ".", ["phase"], buckets=_BUCKETS,
                                 registry=self.registry)
        self._bubbles = Counter("bubblesnap_bubble_seconds", "Pipeline-bubble seconds the "
                                "trainers reported at commit: offered (idle), used (copying "
                                "in them), spilled (copying outside them, training waited).",
                                ["kind"], registry=self.registry)
        self._corrupt = Counter("bubblesnap_corrupt_copies", "Copies that failed their "
                                "checksums and were skipped, by tier (memory, peer, durable).",
                                ["source"], registry=self.registry)
        # Every series exists from the start: a dashboard shows 0, not "no data".
        for phase in PHASES:
            self._phases.labels(phase)
        for kind in ("offered", "used", "spilled"):
            self._bubbles.labels(kind)
        for source in ("memory", "peer", "durable"):
            self._corrupt.labels(source)
        self._staged: collections.OrderedDict[tuple, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def watch(self, copies, group, copies_wanted: int, data=None) -> None:
        """Where the scrape reads the group's copies of a job (``copies(job)``), the
        peers (``group``: a PeerGroup or None) and the bytes the data channel sent
        (``data``: a DataServer or None) from; they are built after the metrics."""
        self._gauges.copies, self._gauges.group, self._gauges.data = copies, group, data
        self._gauges.copies_wanted = copies_wanted

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Times the block as ``phase``, whether it succeeds or raises."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._phases.labels(phase).observe(time.perf_counter() - started)

    def staged(self, job: str, rank: int, step: int) -> None:
        """A BeginStep was answered: the trainer's fetch into the segment starts."""
        with self._lock:
            self._staged[(job, rank, step)] = time.perf_counter()
            while len(self._staged) > _OPEN_STAGINGS:
                self._staged.popitem(last=False)

    def fetched(self, job: str, rank: int, step: int) -> None:
        """A CommitStep arrived: the trainer's fetch into the segment ended."""
        with self._lock:
            started = self._staged.pop((job, rank, step), None)
        if started is not None:
            self._phases.labels("fetch").observe(time.perf_counter() - started)

    def bubbles(self, usage) -> None:
        """A commit kept a copy; ``usage`` is the bubble time its trainer reported."""
        self._bubbles.labels("offered").inc(usage.offered_seconds)
        self._bubbles.labels("used").inc(usage.used_seconds)
        self._bubbles.labels("spilled").inc(usage.spilled_seconds)

    def corrupt(self, source: str) -> None:
        """A copy from ``source`` ("memory", "peer <address>", "durable") was corrupt."""
        self._corrupt.labels(source.split()[0]).inc()

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP endpoint; returns the port it listens on."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
