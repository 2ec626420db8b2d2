"""Status: what each job's snapshots look like, assembled from the parts that know.

The store knows the copies held here, and what it adopted at start; the
bubble plans know the plan and its profiles; the replicator knows how many
copies the group holds; the durable tier knows which steps are on disk;
restore knows which copies failed their checksums. Nothing here changes
anything.
"""

import dataclasses
import time

from bubblesnap.service.bubbles.planner import Plan
from bubblesnap.service.peers.idle_windows import Replication
from bubblesnap.service.progress import InFlight, Progress
from bubblesnap.service.restore import CorruptCopy
from bubblesnap.service.store.adoption import Adoption
from bubblesnap.service.store.registration import Coverage
from bubblesnap.service.store.views import JobView, MemoryView

#: The longest one WaitCommitted call waits (a client waiting longer calls again).
_MAX_WAIT_SECONDS = 30.0
_WAIT_POLL_SECONDS = 0.02


@dataclasses.dataclass(frozen=True)
class JobStatus:
    job: JobView
    plan: Plan | None
    profiles: dict      # rank -> planner.RankProfile the plan was made from
    plan_version: int
    copies: dict[tuple[int, int], int]  # (rank, step) -> copies in the group's memory
    durable_steps: list[int]
    replicas: int
    corrupt_copies: list[CorruptCopy]
    coverage: Coverage
    replication: list[Replication]  # this daemon's latest pushes, oldest first


@dataclasses.dataclass(frozen=True)
class DaemonStatus:
    jobs: list[JobStatus]
    memory: MemoryView
    log_bytes: int
    log_budget_bytes: int
    adoption: Adoption = Adoption()
    in_flight: tuple[InFlight, ...] = ()
    durable_directory: str = ""
    durable_error: str = ""
    durable_notes: tuple[str, ...] = ()


class Status:
    """Answers Status for one job or all of them."""

    def __init__(self, store, plans, logs, restorer, layouts, replicator=None,
                 replicas: int = 0, progress: Progress | None = None, durable=None):
        self._store = store
        self._durable = durable  # the DurableWriter, for its trouble
        self._progress = progress or Progress()
        self._layouts = layouts
        self._plans = plans
        self._logs = logs
        self._restorer = restorer
        self._replicator = replicator
        self._replicas = replicas

    def status(self, job: str = "") -> DaemonStatus:
        """NotFound when ``job`` is named and not registered here."""
        return DaemonStatus([self._job(view) for view in self._store.jobs(job)],
                            self._store.memory(), self._logs.bytes_held(),
                            self._logs.options.max_total_bytes, self._store.adoption,
                            tuple(self._progress.in_flight(job)),
                            self._restorer.durable_directory,
                            self._durable.trouble() if self._durable is not None else "",
                            tuple(self._durable.saves_in_flight.notes())
                            if self._durable is not None else ())

    def wait_committed(self, job: str, step: int, timeout: float) -> tuple[bool, int]:
        """Waits up to ``timeout`` (capped) for ``step`` to be committed for the job;
        (committed, latest committed step). Polls: commits are rare next to the poll.
        NotFound at once for a job not registered here (nothing would ever commit)."""
        self._store.world_size(job)
        deadline = time.monotonic() + max(0.0, min(timeout, _MAX_WAIT_SECONDS))
        while True:
            committed = self._store.committed(job)
            latest = committed[-1] if committed else -1
            if step in committed or time.monotonic() >= deadline:
                return step in committed, latest
            time.sleep(_WAIT_POLL_SECONDS)

    def copies(self, job: str) -> dict[tuple[int, int], int]:
        """(rank, step) -> copies in the group's memory (1 for a lone daemon's own)."""
        if self._replicator is not None:
            return self._replicator.copies(job)
        return {(h.rank, h.step): 1 for h in self._store.holdings(job)}

    def _job(self, view: JobView) -> JobStatus:
        plan, profiles, version = self._plans.plan_of(view.job)
        return JobStatus(view, plan, profiles, version, self.copies(view.job),
                         self._restorer.durable_steps(view.job),
                         self._replicas, self._restorer.corrupt_copies(view.job),
                         self._layouts.coverage(view.job),
                         self._replicator.idle.replications(view.job)
                         if self._replicator is not None else [])
