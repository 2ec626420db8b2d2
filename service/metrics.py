"""Prometheus metrics: store and log gauges read at scrape time, RPC counters."""

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily


class _StoreCollector:
    """Reads the store and the logs when Prometheus scrapes, so they know nothing of
    metrics."""

    def __init__(self, store, logs):
        self._store = store
        self._logs = logs

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
                 "Free bytes in the shared-memory filesystem.")):
            yield GaugeMetricFamily(name, doc, value=value)
        latest = GaugeMetricFamily("bubblesnap_latest_committed_step",
                                   "Latest step every rank of the job holds.", labels=["job"])
        held = GaugeMetricFamily("bubblesnap_steps_held", "Steps held per job.", labels=["job"])
        for job in self._store.jobs():
            latest.add_metric([job.job], job.latest_committed_step)
            held.add_metric([job.job], len(job.steps))
        yield latest
        yield held


class DaemonMetrics:
    """The daemon's metrics registry and the counters the servicer updates."""

    def __init__(self, store, logs):
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(store, logs))
        self.rpcs = Counter("bubblesnap_rpcs", "RPCs answered, by method and status code.",
                            ["method", "code"], registry=self.registry)
        self.restores = Counter("bubblesnap_restores", "Restores served, by the tier the bytes "
                                "came from (memory, peer, durable).", ["source"],
                                registry=self.registry)

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP endpoint; returns the port it listens on."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
