"""Pushes committed copies to the next daemons in the ring and keeps them there.

After a trainer commits a step, the copy is offered on the data channel and
the next k live daemons are asked to take it (``Replicate``); each answers
once it pulled and verified the bytes, which is the acknowledgement. Only
the copier of a data-parallel replica group commits, so a replicated shard
crosses the network once per group (each copy names the ranks it holds). When
replication falls behind training (slow network, busy cores), the waiting
steps of a rank collapse into one: the "roundest" (most trailing zero bits,
then newest), so daemons that fall behind by different amounts still pick
common steps, and a step gets committed for the whole job. Every
``refresh_seconds`` the group's holdings are gathered: they say which steps
are committed (each rank 1 + k times, which drives retention) and which
copies lost a holder (a dead peer), which this daemon then pushes again.
"""

import logging
import queue
import threading
import time

import grpc

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import group_view
from bubblesnap.service.errors import DaemonError
from bubblesnap.service.layout_messages import tensor_specs

log = logging.getLogger("bubblesnap.daemon")


class Replicator:
    """The background thread that replicates and tracks the group's copies."""

    def __init__(self, store, group, data_server):
        self._store = store
        self._group = group
        self._data = data_server
        self._queue: queue.Queue = queue.Queue()  # wake-ups; the work is in _waiting
        self._waiting: dict[tuple[str, int], set[int]] = {}
        self._views: dict[str, list[group_view.Holding]] = {}
        self._probed: dict[int, float] = {}  # when a peer believed dead was last asked
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replicator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def committed(self, job: str, rank: int, step: int) -> None:
        """A trainer committed (job, rank, step) here: replicate it soon."""
        with self._lock:
            self._waiting.setdefault((job, rank), set()).add(step)
        self._queue.put(job)

    def copies(self, job: str) -> dict[tuple[int, int], int]:
        """(rank, step) -> live copies in the group, as last gathered."""
        with self._lock:
            view = self._views.get(job, [])
        return {key: len(where) for key, where in group_view.holders(view).items()}

    def forget_after(self, job: str, step: int) -> None:
        """``job`` was rolled back to ``step``: later steps waiting here are dropped, and
        what is known of the group's copies is gathered afresh."""
        with self._lock:
            self._views.pop(job, None)
            for key in [k for k in self._waiting if k[0] == job]:
                self._waiting[key] = {s for s in self._waiting[key] if s <= step}
        self._group.forget_holdings(job)

    def view(self, job: str) -> list[group_view.Holding]:
        """The group's holdings of ``job``, gathered now."""
        holdings = self._group.holdings(job, self._store.holdings(job))
        with self._lock:
            self._views[job] = holdings
        return holdings

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        next_refresh = 0.0
        while not self._stop.is_set():
            timeout = max(0.0, next_refresh - time.monotonic())
            try:
                job = self._queue.get(timeout=timeout)
            except queue.Empty:
                job = ""
            if job is None:
                return
            try:
                for job_, rank, step in self._take_waiting():
                    self._replicate_new(job_, rank, step)
                if time.monotonic() >= next_refresh:  # every job, re-replication too
                    self._refresh(None)
                    next_refresh = time.monotonic() + self._group.options.refresh_seconds
                elif job:  # just what this job's new commits changed
                    self._refresh(job)
            except Exception:  # a bug must not end replication for good
                log.exception("replication round failed")

    def _take_waiting(self) -> list[tuple[str, int, int]]:
        """One step per (job, rank) to replicate now; older waiting steps are dropped."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        return [(job, rank, group_view.roundest(steps))
                for (job, rank), steps in sorted(waiting.items())]

    def _replicate_new(self, job: str, rank: int, step: int) -> None:
        # The next k daemons that answer, in ring order. One believed dead is
        # asked first with a short call: daemons start one after another, and a
        # peer missed at startup must not lose its place in the ring.
        acked = 0
        for target in self._group.ring():
            if acked == self._group.options.replicas:
                return
            if target not in self._group.live() and not self._probe(target, job):
                continue  # asked at most once a refresh: a dead host may take seconds to fail
            acked += self._push(job, rank, step, target)

    def _probe(self, target: int, job: str) -> bool:
        now = time.monotonic()
        if now - self._probed.get(target, float("-inf")) < self._group.options.refresh_seconds:
            return False
        self._probed[target] = now
        try:
            self._group.call(target, "Holdings", ppb.HoldingsRequest(job=job))
            return True
        except grpc.RpcError:
            return False

    def _refresh(self, only_job: str | None) -> None:
        # Every job, not only those with copies here: a daemon whose ranks are all
        # held through other daemons' copiers still reports what the group committed.
        jobs = [only_job] if only_job else self._store.job_names()
        for job in jobs:
            holdings = self.view(job)
            try:
                world = self._store.world_size(job)
            except DaemonError:
                continue
            wanted = self._group.options.copies_wanted
            committed = group_view.committed_steps(world, holdings, wanted)
            self._store.set_group_committed(job, committed)
            if only_job:
                continue
            kept = committed[-self._store.options.keep_steps:]
            work = group_view.re_replication(self._group.index, self._group.size,
                                             self._group.not_dead(), holdings, wanted,
                                             floor=kept[0] if kept else 0)
            for rank, step, targets in work:
                log.info("re-replicating step %d of rank %d of %s to peers %s", step, rank, job,
                         targets)
                for target in targets:
                    self._push(job, rank, step, target)

    def _push(self, job: str, rank: int, step: int, target: int) -> bool:
        try:
            pinned = self._store.pin(job, rank, step)
        except DaemonError:
            return False  # freed meanwhile: a newer step replaced it
        ticket = self._data.offer(pinned.segment.path, pinned.segment.nbytes,
                                  lambda: self._store.unpin(pinned))
        request = ppb.ReplicateRequest(
            job=job, world_size=pinned.world_size, rank=rank, step=step,
            tensors=tensor_specs(pinned.layout), checksums=pinned.checksums,
            data_address=self._data.address, ticket=ticket, replica_group=pinned.group)
        try:
            self._group.call(target, "Replicate", request,
                             timeout=self._group.options.transfer_timeout_seconds)
        except grpc.RpcError as err:
            self._data.cancel(ticket)  # never redeemed, or broken off: unpin now
            log.warning("peer %d did not take step %d of rank %d of %s: %s: %s", target, step,
                        rank, job, err.code().name, err.details())
            return False
        self._store.mark_replicated(job, rank, step)
        return True
