"""The ring of daemons this one belongs to: addresses, liveness, calls to peers."""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.service.coordination.etcd_kv import EtcdUnavailable
from bubblesnap.service.errors import InvalidArgument, Unavailable
from bubblesnap.service.peers import group_name, group_view
from bubblesnap.service.peers.group_view import Holding
from bubblesnap.service.peers.liveness import Liveness
from bubblesnap.service.peers.peer_answers import PeerAnswers
from bubblesnap.service.peers.peer_options import PeerOptions

log = logging.getLogger("bubblesnap.daemon")


class PeerGroup:
    """Calls to the other daemons, with the token; remembers which answered.

    The static ring (``--peers``) learns liveness from its calls and holdings by
    asking every peer; with ``etcd`` (an ``EtcdGroup`` that took its ring
    position) both come from etcd instead, and addresses from its slots.
    """

    def __init__(self, options: PeerOptions, max_message_bytes: int, etcd=None):
        self.options = options
        self._max_message_bytes = max_message_bytes
        self._etcd = etcd
        self._index = options.index  # the static ring's; with etcd it moves (index)
        self._addresses = list(options.peers) if etcd is None else etcd.members()[0]
        self._stubs: dict[int, peer_pb2_grpc.PeerStub] = {}
        self._liveness = Liveness(len(self._addresses), options.dead_after_seconds,
                                  self.address)
        self._group_metadata = group_name.metadata(options.group)
        self._refused: set[str] = set()  # addresses that refused a Join (another group)
        self._joining: set[int] = set()  # quiet peers a heartbeat's Join is on its way to
        self._answers = PeerAnswers()
        self._lock = threading.Lock()
        self._calls = ThreadPoolExecutor(max(1, len(self._addresses)),
                                         thread_name_prefix="peer-call")

    @property
    def index(self) -> int:
        """This daemon's ring position. With etcd, the one it holds now: -1 while it
        holds none (its lease may have run out, or every position is another daemon's),
        and another one after it took a free position under a new lease."""
        return self._etcd.index if self._etcd is not None else self._index

    @property
    def own_address(self) -> str:
        """The peer address this daemon is dialled at."""
        return self.options.listen if self._etcd is not None else self.address(self._index)

    @property
    def size(self) -> int:
        return len(self._addresses)

    @property
    def coordinated(self) -> bool:
        """Whether etcd says who is alive (no probing of silent peers)."""
        return self._etcd is not None

    def live(self) -> set[int]:
        if self._etcd is not None:
            return self._etcd.members()[1]
        return self._liveness.live()

    def not_dead(self) -> set[int]:
        """Peers that answered within ``dead_after_seconds`` (re-replication spares them);
        with etcd, those whose lease runs."""
        if self._etcd is not None:
            return self._etcd.members()[1]
        return self._liveness.not_dead()

    def address(self, index: int) -> str:
        """The peer address of ring position ``index``; "" where none is held."""
        if index < 0:
            return ""
        if self._etcd is not None:
            return self._etcd.members()[0][index]
        with self._lock:
            return self._addresses[index]

    def others(self) -> list[int]:
        """The other daemons' indices (with etcd: those holding a ring position now)."""
        members = self.live() if self._etcd is not None else range(self.size)
        return [i for i in sorted(members) if i != self.index]

    def join(self, index: int, address: str) -> None:
        """A replacement daemon took ring position ``index`` at ``address`` (host:port,
        checked where the Join entered: rpc/messages.py). With etcd, its slots say
        where each daemon is: a Join changes nothing."""
        if self._etcd is not None:
            return
        if not 0 <= index < self.size or index == self.index:
            raise InvalidArgument(
                f"ring index {index} is not another member of this {self.size}-daemon group; "
                "check --index and --peers")
        with self._lock:
            if self._addresses[index] != address:
                log.info("peer %d is now at %s (was %s)", index, address, self._addresses[index])
                self._addresses[index] = address
                self._answers.replaced(index)
            if not self._liveness.mark(index, alive=True, quiet=True):
                # our channel to it may be in a reconnect backoff (up to 1 s) failing every
                # call at once, and a push would pass over it: a fresh one dials now
                self._stubs.pop((index, address), None)

    def call(self, index: int, method: str, request, timeout: float | None = None,
             until_dead: bool = False):
        """One peer call; marks the peer dead when it cannot be reached. ``until_dead``
        (a transfer, whose deadline is long): given up as soon as the peer is dead, as a
        frozen host is (it holds its connections open and answers nothing)."""
        stub = self._stub(index)
        how = {"timeout": timeout or self.options.call_timeout_seconds,
               "metadata": self.options.security.metadata() + self._group_metadata}
        try:
            answer = (self._until_dead(index, getattr(stub, method).future(request, **how))
                      if until_dead else getattr(stub, method)(request, **how))
        except grpc.RpcError as err:
            # PERMISSION_DENIED: a daemon of another group listens there (group_name.py),
            # as good as none for this one.
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.PERMISSION_DENIED):
                self._liveness.mark(index, alive=False)
            raise
        self._liveness.mark(index, alive=True)
        return answer

    def _until_dead(self, index: int, future):
        while True:
            try:
                return future.result(timeout=self.options.refresh_seconds)
            except grpc.FutureTimeoutError:
                if index not in self.not_dead():
                    future.cancel()
                    raise _Unreachable(f"peer {index} is dead: silent for "
                                       f"{self.options.dead_after_seconds:g} s") from None

    def ring(self) -> list[int]:
        """Every other daemon, in ring order from this one. With etcd, while this daemon
        holds no position, from the one it held last: its new copies still reach peers
        (who publish them under their own positions), none with etcd away."""
        index = self._etcd.last_index if self._etcd is not None else self._index
        if index < 0:
            return []
        return group_view.successors(index, self.size, set(range(self.size)), self.size)

    def ring_order_live_first(self) -> list[int]:
        """The other daemons in ring order, those that answered last time first; then
        those that missed a call but are not dead yet (a peer starting up). Dead
        ones are left out: a blackholed host would cost a deadline per call."""
        ring = self.ring()
        live, not_dead = self.live(), self.not_dead()
        return [i for i in ring if i in live] + [i for i in ring
                                                 if i not in live and i in not_dead]

    def announce(self, heartbeat: bool = False) -> None:
        """Tells every peer where this daemon is (a replacement host has a new address);
        with etcd, taking the ring position told them. ``heartbeat`` (each refresh, jobs
        or none): only the peers that answered no call for a refresh, without waiting, so
        that a peer missed at start-up, or whose Join was lost, is found again, and one
        cut off or frozen while nothing was asked of it is found silent and, after
        ``dead_after_seconds``, dead."""
        if self._etcd is not None:
            return
        request = ppb.JoinRequest(index=self.index, address=self.address(self.index))
        if not heartbeat:
            for index in self.others():
                self._join(index, request)
            return
        quiet = set(self.others()) & self._liveness.quiet(self.options.refresh_seconds)
        for index in quiet - self._joining:
            self._joining.add(index)
            self._calls.submit(self._join, index, request).add_done_callback(
                lambda _, index=index: self._joining.discard(index))

    def _join(self, index: int, request) -> None:
        try:
            self.call(index, "Join", request)
        except grpc.RpcError as err:
            address, first = self.address(index), False
            if err.code() == grpc.StatusCode.PERMISSION_DENIED:
                with self._lock:  # a misconfiguration: said once, not each refresh
                    first = address not in self._refused
                    self._refused.add(address)
            if first:
                log.warning("peer %d (%s) refused the join: %s", index, address,
                            (err.details() or "")[:500])
            else:
                log.info("peer %d (%s) did not take the join: %s", index, address,
                         err.code().name)

    def holdings(self, job: str, own_of) -> list[Holding]:
        """The committed copies of ``job`` in the group; ``own_of()`` gives this daemon's.

        A peer that misses one call but is not dead yet (``dead_after_seconds``)
        counts with what it answered last: a busy peer must not look like lost
        copies, which would be pushed again for nothing.

        With etcd, ``own`` is published first, and the answer is what every daemon
        holds of the ranks ``own`` has (all re-replication needs; the job's
        committed steps come from ``summary``), read in one request; etcd away: as
        read last.
        """
        if self._etcd is None:
            return self._gather(job, own_of, set())
        own = own_of()
        self._etcd.publish(job, own)
        try:
            theirs = self._etcd.holdings_of(job, {h.rank for h in own})
        except EtcdUnavailable:
            return self._answers.last(-1, job)
        self._answers.heard(-1, job, theirs)
        return theirs

    def unanswered(self, job: str, ever: bool = False) -> set[int]:
        """Peers not dead that did not answer the last gathering of ``job`` (``ever``: and
        never answered it before: what they hold is not known; re-replication waits)."""
        return self._answers.unanswered(job, ever)

    def summary(self, job: str) -> tuple[list[int], list[int]] | None:
        """(committed, restorable) steps of ``job`` as etcd's aggregator found them;
        None on the static ring (where every daemon judges the holdings itself)."""
        return self._etcd.summary(job) if self._etcd is not None else None

    def on_summary(self, listener) -> None:
        """With etcd, ``listener(job)`` hears when the aggregator judged ``job`` anew."""
        if self._etcd is not None:
            self._etcd.listen(listener)

    def on_seated(self, listener) -> None:
        """With etcd, ``listener()`` hears when this daemon took a ring position under a
        new lease (its lease had run out): what it holds is to be published under it."""
        if self._etcd is not None:
            self._etcd.listen_seated(lambda index: listener())

    def mark_ready(self, held_of) -> None:
        """With etcd, once per position taken: every job's copies held here
        (``held_of()``: job -> this daemon's copies) and the layouts registered here are
        published under it, then the position is marked ready (restores wait for it)."""
        if self._etcd is not None and self._etcd.needs_ready():
            self._etcd.publish_held(held_of())

    def etcd_layouts(self, job: str) -> list[bytes]:
        """The RankLayout messages daemons published in etcd for ``job``."""
        return self._etcd.layouts(job)

    def publish_layout(self, job: str, rank: int, value: bytes) -> None:
        self._etcd.publish_layout(job, rank, value)

    def forget_job(self, job: str) -> None:
        """``job`` was deleted here: with etcd, its holdings and layouts leave etcd (a
        summary nobody backs goes with them: the aggregator drops it)."""
        self.forget_holdings(job)
        if self._etcd is not None:
            self._etcd.forget(job)

    def changed(self, job: str, own) -> None:
        """This daemon's copies of ``job`` changed (an arrival): with etcd, published
        now, so the step counts as committed without waiting for the next refresh."""
        if self._etcd is not None:
            self._etcd.publish(job, own)

    def holdings_answered(self, job: str, own_of) -> list[Holding]:
        """The committed copies of ``job`` once every peer answered this round or is dead
        (silent past ``dead_after_seconds``); ``own_of()`` gives this daemon's, asked
        afresh each round. Waits up to ``dead_after_seconds`` and a little more for a
        peer that is slow or just started; Unavailable past that. A restore decides on
        this view: a step chosen without a live peer's copies could be older than what
        the job holds, and the rollback that follows would drop the newer copies.

        With etcd: the job's holdings as etcd has them now (a dead daemon's left with
        its lease); etcd away, the daemons it listed last are asked as above."""
        if self._etcd is not None:
            own = own_of()
            self._etcd.publish(job, own)
            self._etcd.wait_ready()  # a daemon that just took its position publishes soon
            index = self.index
            try:
                found = self._etcd.all_holdings(job)
                if index < 0:  # no position: the group's view, which every daemon shares
                    return found
                # this daemon's own copies as held now, not as etcd last took them
                return [h for h in found if h.index != index] + \
                    [Holding(index, h.rank, h.step, h.replica, h.world_size, h.group)
                     for h in own]
            except Unavailable as err:
                log.warning("%s; asking the peers instead", err)
        deadline = time.monotonic() + self.options.dead_after_seconds + 2.0
        while True:
            silent: set[int] = set()
            found = self._gather(job, own_of, silent)
            if not silent:
                return found
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"peers {sorted(silent)} did not answer for the holdings of job {job!r} "
                    "and are not dead yet; the latest step the job can restore is not known "
                    "without them. Try again")
            time.sleep(0.2)

    def _gather(self, job: str, own_of, silent: set[int]) -> list[Holding]:
        """Every daemon's holdings; ``silent`` gets the peers that did not answer and are
        not dead (counted with what they answered last). This daemon's own copies are
        taken once the peers answered: retention may free one meanwhile, and a step
        judged whole on a copy already gone would be reported committed without it."""
        request = ppb.HoldingsRequest(job=job)
        futures = {i: self._calls.submit(self.call, i, "Holdings", request) for i in self.others()}
        found, answered = [], set()
        for index, future in futures.items():
            try:
                answer = future.result()
            except grpc.RpcError:
                if index in self.not_dead():
                    silent.add(index)
                    found += self._answers.last(index, job)
                continue
            theirs = [Holding(index, c.rank, c.step, c.role == ppb.REPLICA, c.world_size,
                              tuple(c.replica_group))
                      for c in answer.copies if c.job == job]
            self._answers.heard(index, job, theirs,
                                {s for c in answer.committed if c.job == job for s in c.steps})
            found += theirs
            answered.add(index)
        self._answers.gathered(job, answered, silent)
        return [Holding(self.index, h.rank, h.step, h.replica, h.world_size, h.group)
                for h in own_of()] + found

    def committed_by_peers(self, job: str) -> set[int]:
        """The steps of ``job`` the peers took as committed, as they answered last (on the
        static ring; with etcd the aggregator's summary is every daemon's)."""
        return self._answers.committed(job)

    def peer_lost(self, job: str) -> bool:
        """Whether, since this was last asked, a peer that answered a gathering of ``job``
        stopped answering or a new daemon took a peer's position (static ring): the
        peer may have reported steps committed that no other daemon heard of."""
        return self._answers.lost(job)

    def forget_holdings(self, job: str) -> None:
        self._answers.forget(job)

    def close(self) -> None:
        self._calls.shutdown(wait=False)
        if self._etcd is not None:
            self._etcd.stop()

    def _stub(self, index: int) -> peer_pb2_grpc.PeerStub:
        address = self.address(index)
        if not address:
            raise _Unreachable(f"ring position {index} is empty: no daemon holds it now")
        with self._lock:
            stub = self._stubs.get((index, address))  # a replacement has a new address
            if stub is None:
                channel = self.options.security.channel(address, self._max_message_bytes)
                stub = self._stubs[(index, address)] = peer_pb2_grpc.PeerStub(channel)
            return stub


class _Unreachable(grpc.RpcError):
    """A call to a ring position no daemon holds now (etcd emptied it between a look at
    the members and the call), or given up on a peer found dead meanwhile."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details
