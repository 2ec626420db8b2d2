"""Pushes committed copies to the next daemons in the ring and keeps them there.

After a trainer commits a step, the copy is offered on the data channel and
the next k live daemons are asked to take it (``Replicate``); each answers
once it pulled and verified the bytes, which is the acknowledgement. Only
the copier of a data-parallel replica group commits, so a replicated shard
crosses the network once per group (each copy names the ranks it holds). When
replication falls behind training (slow network, busy cores), the waiting
steps of a rank collapse into one: the "roundest" (most trailing zero bits,
then newest), so daemons that fall behind by different amounts still pick
common steps, and a step gets committed for the whole job; a newer step
waits for the next round (a run that stops must not leave its newest step
with one copy), the others are skipped. Every
``refresh_seconds`` the group's holdings are gathered: they say which steps
are committed (each rank 1 + k times, which drives retention) and which
copies lost a holder (a dead peer), which this daemon then pushes again; a
new copy never pushed is not one of those (it waits for its push, or the
coalescing skipped it), except the last a push left short of peers.
With ``--pace-replication`` a new copy's push, and each piece of its bytes,
waits for a window in which every stage reporting bubbles here is in one, up
to a bound (:mod:`bubblesnap.service.peers.idle_windows`); re-replication is
not held: a copy that lost a holder is restored to 1 + k copies first.
"""

import logging
import threading
import time

import grpc

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.background import CoalescingWorker
from bubblesnap.service.errors import DaemonError
from bubblesnap.service.peers import group_view
from bubblesnap.service.peers.idle_windows import IdleWindows, PushGate, Replication
from bubblesnap.service.rpc.messages import tensor_specs

log = logging.getLogger("bubblesnap.daemon")


class Replicator:
    """The background thread that replicates and tracks the group's copies."""

    def __init__(self, store, group, transfers, layouts, metrics, idle: IdleWindows):
        self._store = store
        self.idle = idle  # the stages' bubbles: pacing, and the record of pushes
        self._metrics = metrics  # times each push
        self._layouts = layouts  # the group's layouts: a step is committed only when whole
        self._group = group
        self._transfers = transfers
        self._views: dict[str, list[group_view.Holding]] = {}
        self._seen: dict[str, dict] = {}  # job -> holders() of its last gathering
        self._spared: dict[str, set[int]] = {}  # job -> steps kept from the cap: see _refresh
        self._rolled_back: dict[str, int] = {}  # job -> step, until etcd judges anew
        self._rollbacks: dict[str, int] = {}  # job -> how many times it was rolled back
        self._probed: dict[int, float] = {}  # when a peer believed dead was last asked
        # (job, rank) -> step -> when it was committed here, for the commits waiting for
        # their push: a step that replaced older ones waits no longer than they may.
        self._waiting: dict[tuple[str, int], dict[int, float]] = {}
        # (job, rank) -> the step its last new-copy push left short of k peers (none live
        # then, or they failed; or adopted unpushed at start): the refresh pushes it
        # once nothing newer of the rank waits.
        self._short: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._worker = CoalescingWorker("replicator", self._replicate_batch,
                                        tick=lambda: self._refresh(None),
                                        every_seconds=group.options.refresh_seconds)
        # On a thread of its own: a push to a frozen peer holds the replicator's until
        # the peer is found dead, which only the heartbeat's calls can find.
        self._heartbeat = CoalescingWorker("heartbeat", lambda batch: None,
                                           tick=lambda: group.announce(heartbeat=True),
                                           every_seconds=group.options.refresh_seconds)

    def start(self) -> None:
        for job in self._store.job_names():  # adopted copies a peer never took
            for rank, step in sorted(self._store.unpushed(job)):
                self._short[(job, rank)] = step
        self._heartbeat.start()
        self._worker.start()

    def stop(self) -> None:
        self._worker.stop(timeout=5)
        self._heartbeat.stop(timeout=5)

    def committed(self, job: str, rank: int, step: int) -> None:
        """A trainer committed (job, rank, step) here: replicate it soon."""
        with self._lock:
            self._waiting.setdefault((job, rank), {}).setdefault(step, time.monotonic())
        self._worker.submit((job, rank), step)

    def summary_changed(self, job: str) -> None:
        """etcd's aggregator judged ``job`` anew: what the group committed is read now,
        not at the next refresh (trainers waiting for a commit learn it sooner). A
        summary written after a rollback was judged on the rolled-back holdings."""
        with self._lock:
            self._rolled_back.pop(job, None)
        self._worker.submit((job, None), None)

    def seated(self) -> None:
        """With etcd, this daemon took a ring position under a new lease: everything it
        holds is published under it now (then it is marked ready), not at the next
        refresh."""
        self._worker.submit((None, None), None)

    def copies(self, job: str) -> dict[tuple[int, int], int]:
        """(rank, step) -> live copies in the group: this daemon's own as held now (a copy
        that landed after the last gathering counts), the peers' as last gathered."""
        with self._lock:
            view = self._views.get(job, [])
        here = self._group.index
        found = [h for h in view if h.index != here] + [
            group_view.Holding(here, h.rank, h.step) for h in self._store.holdings(job)]
        return {key: len(where) for key, where in group_view.holders(found).items()}

    def forget_after(self, job: str, step: int) -> None:
        """``job`` was rolled back to ``step``: later steps waiting here are dropped, and
        what is known of the group's copies is gathered afresh."""
        with self._lock:
            self._views.pop(job, None)
            self._seen.pop(job, None)
            self._spared.pop(job, None)
            self._waiting = {key: kept for key, times in self._waiting.items() if (kept := {
                s: t for s, t in times.items() if key[0] != job or s <= step})}
            self._short = {key: s for key, s in self._short.items()
                           if key[0] != job or s <= step}
            self._rolled_back[job] = step
            self._rollbacks[job] = self._rollbacks.get(job, 0) + 1
        # (job, None) items ask for a refresh after a summary changed: they stay
        self._worker.drop(lambda key, waiting: key[0] != job or waiting is None
                          or waiting <= step)
        self._group.forget_holdings(job)

    def rolled_back(self, job: str) -> None:
        """This daemon's copies of ``job`` were rolled back: with etcd, published now, so
        the aggregator's next summary no longer counts the dropped steps."""
        self._group.changed(job, self._store.holdings(job))

    def view(self, job: str, answered: bool = False) -> list[group_view.Holding]:
        """The group's holdings of ``job``, gathered now; ``answered``: only once every
        live peer answered (``PeerGroup.holdings_answered``), for decisions such as a
        restore's step."""
        if answered:
            holdings = self._group.holdings_answered(job, lambda: self._store.holdings(job))
        else:
            holdings = self._group.holdings(job, lambda: self._store.holdings(job))
        with self._lock:
            self._views[job] = holdings
        return holdings

    # -- the thread -----------------------------------------------------------

    def _replicate_batch(self, batch: dict) -> None:
        """One step per (job, rank) is replicated now, the roundest; a newer one waits
        for the next round, the others are dropped. Then what these commits changed is
        gathered."""
        # (job, None) keys only ask for the refresh below (summary_changed); (None, None)
        # for a refresh of every job (seated)
        now, taken = time.monotonic(), []
        with self._lock:
            rollbacks = dict(self._rollbacks)
            for key, steps in sorted(item for item in batch.items() if item[0][1] is not None):
                times = self._waiting.get(key, {})
                taken.append((key, steps, {step: times.pop(step, now) for step in steps}))
                if not times:
                    self._waiting.pop(key, None)
        for key, steps, committed_at in taken:
            step, newest = group_view.roundest(steps), max(steps)
            try:
                self._replicate_new(*key, step, since=min(committed_at.values()))
            finally:
                if newest > step:
                    self._carry(key, newest, committed_at[newest], rollbacks.get(key[0], 0))
        if (None, None) in batch:
            self._refresh(None)
        for job in sorted({job for job, _ in batch if job is not None}):
            self._refresh(job)

    def _carry(self, key: tuple[str, int], step: int, committed_at: float,
               rollbacks: int) -> None:
        """Puts a waiting step the round passed over (newer than the one it pushed) into
        the next round, where newer commits may replace it: skipped, it would stay one
        copy for good in a run that stops here. Not when the job was rolled back since
        the round began (the step may be gone, or re-committed with other bytes)."""
        with self._lock:  # a rollback's drop() comes after its count: it sees this item
            if self._rollbacks.get(key[0], 0) != rollbacks:
                return
            self._waiting.setdefault(key, {}).setdefault(step, committed_at)
            self._worker.submit(key, step)

    def _replicate_new(self, job: str, rank: int, step: int, since: float) -> None:
        """Pushes a new copy to the next k daemons; ``since``: when the oldest commit it
        replaced was made (the pacing's wait bound counts from then)."""
        # The next k daemons that answer, in ring order. One believed dead is
        # asked first with a short call: daemons start one after another, and a
        # peer missed at startup must not lose its place in the ring.
        waited = self.idle.wait(since, self._worker.stopping)
        gate = self.idle.gate(since, self._worker.stopping)
        started, acked, nbytes = time.monotonic(), 0, 0
        for target in self._group.ring():
            if acked == self._group.options.replicas:
                break
            if target not in self._group.live() and (self._group.coordinated
                                                     or not self._probe(target, job)):
                continue  # asked at most once a refresh: a dead host may take seconds to fail
            pushed = self._push(job, rank, step, target, gate)
            acked, nbytes = acked + bool(pushed), nbytes + pushed
        stopped = time.monotonic()
        with self._lock:
            if acked < self._group.options.replicas:
                self._short[(job, rank)] = step
            else:
                self._short.pop((job, rank), None)
        self.idle.record(job, Replication(
            rank=rank, step=step, nbytes=nbytes, paced=self.idle.options.in_bubbles,
            peers=acked, waited_seconds=waited, push_seconds=stopped - started,
            idle_bytes=gate.idle_bytes, copies_seconds=stopped - since))

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
        if only_job is None:  # with etcd: what is held published once per position taken
            self._group.mark_ready(lambda: {job: self._store.holdings(job) for job in jobs})
        for job in jobs:
            gathered_at = time.monotonic()
            holdings = self.view(job)
            try:
                world = self._store.world_size(job)
            except DaemonError:
                continue
            wanted = self._group.options.copies_wanted
            with self._lock:
                cut = self._rolled_back.get(job)
            coverage = self._layouts.coverage(job)
            # a step a peer took as committed is held here too: it may have told its
            # trainers, and then lost a host before this daemon saw the step whole
            held = set(self._store.committed(job)) | self._group.committed_by_peers(job)
            committed = group_view.kept_committed(
                world, holdings, wanted, self._group.summary(job), held,
                cut, epoch_whole=not coverage.known or coverage.whole,
                stale=self._group.unanswered(job))
            self._store.set_group_committed(job, committed, self._changed(job, holdings)
                                            | self._spare(job), gathered_at)
            with self._lock:
                newest = max(committed, default=-1)
                self._spared[job] = {s for s in self._spared.get(job, ()) if s > newest}
            if only_job or self._group.unanswered(job, ever=True):
                continue  # a peer that is not dead never answered: its copies are unknown
            kept = committed[-self._store.options.keep_steps:]
            work = group_view.re_replication(self._group.index, self._group.size,
                                             self._group.not_dead(), holdings, wanted,
                                             floor=kept[0] if kept else 0,
                                             unpushed=self._left_to_new_pushes(job))
            for rank, step, targets in work:
                log.info("re-replicating step %d of rank %d of %s to peers %s", step, rank, job,
                         targets)
                for target in targets:
                    self._push(job, rank, step, target)

    def _left_to_new_pushes(self, job: str) -> set[tuple[int, int]]:
        """The copies of ``job`` held here unpushed that re-replication leaves alone: all
        but a rank's short one while no newer commit of the rank waits."""
        unpushed = self._store.unpushed(job)
        with self._lock:
            short = {(rank, step) for (name, rank), step in self._short.items()
                     if name == job and (name, rank) not in self._waiting}
        return unpushed - short

    def _spare(self, job: str) -> set[int]:
        """The steps of ``job`` the cap on uncommitted copies spares (their grace starts
        again every gathering): when a peer is lost, every step held here newer than
        what this daemon takes committed, until the job rolls back or a newer step is
        committed. The lost peer may have seen one whole and reported it committed just
        before it went, with no gathering of it answered since to tell this daemon."""
        if self._group.peer_lost(job):
            newest = max(self._store.committed(job), default=-1)
            held = {h.step for h in self._store.holdings(job) if h.step > newest}
            with self._lock:
                self._spared.setdefault(job, set()).update(held)
        with self._lock:
            return set(self._spared.get(job, ()))

    def _changed(self, job: str, holdings) -> set[int]:
        """Steps of ``job`` a copy of which landed in the group since the last gathering;
        every step held while a peer that is not dead did not answer (what it holds now
        is not known). The cap on uncommitted copies waits its grace from then: a step
        that just became whole elsewhere is seen whole here before a copy could go."""
        seen = group_view.holders(holdings)
        with self._lock:
            before, self._seen[job] = self._seen.get(job, {}), seen
        if self._group.unanswered(job):
            return {step for _, step in seen}
        return group_view.newly_held(before, holdings)

    def _push(self, job: str, rank: int, step: int, target: int,
              gate: PushGate | None = None) -> int:
        """The bytes ``target`` took of the copy (0: it did not); ``gate`` paces them."""
        try:
            pinned, ticket = self._transfers.offer(job, rank, step, gate=gate)
        except DaemonError:
            return 0  # freed meanwhile: a newer step replaced it
        request = ppb.ReplicateRequest(
            job=job, world_size=pinned.world_size, rank=rank, step=step,
            tensors=tensor_specs(pinned.layout), checksums=pinned.checksums,
            data_address=self._transfers.data_address, ticket=ticket,
            replica_group=pinned.group)
        try:
            with self._metrics.timed("replicate"):
                self._group.call(target, "Replicate", request, until_dead=True,
                                 timeout=self._group.options.transfer_timeout_seconds)
        except grpc.RpcError as err:
            self._transfers.cancel(ticket)  # never redeemed, or broken off: unpin now
            log.warning("peer %d did not take step %d of rank %d of %s: %s: %s", target, step,
                        rank, job, err.code().name, err.details())
            return 0
        self._store.mark_replicated(job, rank, step)
        return pinned.segment.nbytes
