"""Commits sent and not collected yet, and the failures of saves whose call had returned."""

import threading
import time

import grpc

from bubblesnap.clients.results import SnapshotResult

#: Failures kept for a caller that does not ask: the newest count.
_KEPT = 64


class CommitsInFlight:
    """A session's commits in flight and their outcomes.

    Thread-safe: the training thread, the save lane's thread and gRPC's callback
    threads add to it. ``failed(step, started, err)`` turns a failed call into its
    outcome (the session's back-off and warning); ``answered(step)`` hears that the
    daemon answered a commit.
    """

    def __init__(self, failed, answered):
        self._failed, self._answered = failed, answered
        self._lock = threading.Lock()
        self._pending: list = []  # (step, future, started, phases, sent, late)
        self._late: list[SnapshotResult] = []  # saves that failed after their call returned
        self._fresh: list[SnapshotResult] = []  # outcomes no collect returned yet

    def add(self, step: int, future, started: float, phases: dict, late: bool) -> None:
        """A commit sent; ``late``: its save's call returned already (a failure is kept
        for :meth:`take_late`)."""
        with self._lock:
            self._pending.append((step, future, started, phases, time.perf_counter(), late))

    def note_late(self, outcome: SnapshotResult) -> None:
        """A save whose call had returned failed before its commit was sent."""
        with self._lock:
            self._late = [*self._late[1 - _KEPT:], outcome]
            self._fresh = [*self._fresh[1 - _KEPT:], outcome]

    def take_late(self) -> list[SnapshotResult]:
        """The late failures (oldest first) since the last call, collecting what answered."""
        self.collect(block=False)
        with self._lock:
            late, self._late = self._late, []
        return late

    def collect(self, block: bool) -> SnapshotResult | None:
        """Collects the answered commits (``block``: every one); the newest outcome learnt
        since the last collect (None: none)."""
        with self._lock:
            pending, self._pending = self._pending, []
            outcomes, self._fresh = self._fresh, []
        still = []
        for entry in pending:
            step, future, started, phases, sent, late = entry
            if not block and not future.done():
                still.append(entry)
                continue
            try:
                response = future.result()
                now = time.perf_counter()
                outcomes.append(SnapshotResult(step, True, response.job_committed, "",
                                               now - started, waited_for="rank",
                                               phases={**phases, "commit": now - sent}))
                self._answered(step)
            except grpc.RpcError as err:
                failure = self._failed(step, started, err)
                outcomes.append(failure)
                if late:
                    with self._lock:
                        self._late = [*self._late[1 - _KEPT:], failure]
        with self._lock:
            self._pending[:0] = still
        return max(outcomes, key=lambda o: o.step, default=None)
