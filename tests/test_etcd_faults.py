"""Faults of a group coordinated through etcd: a daemon cut off past its lease while a spare
host takes its position, etcd cut off from every daemon, the minority side of a partition,
a frozen daemon, a restarted daemon whose position another took, and a restore asked while
a restarted group is still publishing what it holds.

The Cluster tests (each host a network namespace; skipped where none can be made) drive
training as tests/test_network_faults.py does and record a History; a :class:`RingWatch`
records, as the test runs, who publishes under which ring index, so the checker finds two
publishers under one index. The others run on loopback daemons and a real etcd.
"""

import base64
import threading
import time
import types

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

from bubblesnap.clients import NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.coordination import keys as keys_lib
from bubblesnap.service.coordination.etcd_kv import EtcdKV, EtcdUnavailable, parse_endpoints
from bubblesnap.testing import free_port, wait_connected, wait_for
from bubblesnap.testing.history import History, violations
from tests import test_peers
from tests.test_etcd import keys, slots
from tests.test_network_faults import FLAGS, JOB, Training, assert_recovers, digest, options

#: The Cluster's daemons keep their group under the default --coordination-prefix.
CLUSTER_PREFIX = "/bubblesnap/default"


class RingWatch:
    """Who publishes under which ring index, polled on one thread as a test runs, into
    ``history`` (``History.published``): a daemon while it says it holds the index (its
    ``bubblesnap_ring_index``), the address in etcd's slot while its key is there, and
    the holder of the lease a holding key under the index was put with (a lease that
    holds no slot counts as a publisher of its own). Observations are made one after
    another and each dated when its answer came, so two publishers whose runs overlap
    did hold one index at once. :meth:`held_under` says which copies were ever published
    under an index (from a watch, which misses none)."""

    def __init__(self, history: History, etcd_url: str, prefix: str, daemons):
        host, port = parse_endpoints(etcd_url)[0]
        self._gateway = Etcd3Client(host=host, port=port, api_path="/v3/", timeout=5)
        self._kv = EtcdKV(parse_endpoints(etcd_url))
        self._keys = keys_lib.Keys(prefix)
        self._history, self._daemons = history, daemons
        self._held: set[tuple[str, int, int, int]] = set()  # (job, rank, step, index)
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, int, str], list[float]] = {}  # -> [first, last] seen
        self._owners: dict[str, str] = {}  # lease -> the address whose slot it held
        self._stopped = threading.Event()
        self._errors: list[BaseException] = []  # a watcher that died saw nothing after
        self._threads = [threading.Thread(target=self._guarded, args=(f,), daemon=True)
                         for f in (self._poll, self._watch)]

    @classmethod
    def of(cls, cluster, history: History) -> "RingWatch":
        """Watches every host of ``cluster``, those added later included."""
        return cls(history, cluster.etcd.url, CLUSTER_PREFIX,
                   lambda: [h.daemon for h in cluster.hosts if h.daemon is not None])

    def __enter__(self) -> "RingWatch":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        deadline = time.monotonic() + 30
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                self._kv.close()  # again: a watch may have opened after the last close
                thread.join(timeout=0.1)
        for (_, index, who), (start, last) in self._runs.items():
            self._history.published(index, who, start, last)
        if self._errors and exc[0] is None:
            raise AssertionError(f"the ring watch stopped watching: {self._errors[0]!r}")

    def _guarded(self, watch) -> None:
        try:
            watch()
        except BaseException as err:
            self._errors.append(err)
            raise

    def _poll(self) -> None:
        while not self._stopped.wait(0.05):
            self._observe_etcd()
            for daemon in self._daemons():
                try:
                    index = daemon.ring_index(timeout=0.5)
                except OSError:  # frozen or gone: nothing seen
                    index = -1
                who = daemon.ready["peer_address"]
                self._seen(f"daemon {who}", {(index, who)} if index >= 0 else set())

    def _observe_etcd(self) -> None:
        ranges = [{"request_range": {"key": _b64(p), "range_end": _b64(keys_lib.prefix_end(p))}}
                  for p in (self._keys.slots(), self._keys.holdings())]
        try:
            answer = self._gateway.post(self._gateway.get_url("/kv/txn"),
                                        json={"success": ranges})
        except (Etcd3Exception, requests.RequestException):  # busy: nothing seen this round
            return
        held_slots, holdings = ([_kv(kv) for kv in r.get("response_range", {}).get("kvs", [])]
                                for r in answer.get("responses", []))
        seen_slots, seen_holdings = set(), set()
        for key, value, lease in held_slots:
            self._owners[lease] = value.decode()
            seen_slots.add((int(key.rsplit("/", 1)[1]), value.decode()))
        for key, _, lease in holdings:
            seen_holdings.add((int(key.rsplit("/", 1)[1]), self._owners.get(lease,
                                                                            f"lease {lease}")))
        self._seen("etcd slot", seen_slots)
        self._seen("etcd holding", seen_holdings)

    def _seen(self, source: str, seen: set[tuple[int, str]]) -> None:
        now = time.monotonic()
        for index, who in seen:
            self._runs.setdefault((source, index, who), [now, now])[1] = now
        for key in [k for k in self._runs if k[0] == source and k[1:] not in seen]:
            start, last = self._runs.pop(key)
            self._history.published(key[1], key[2], start, last)

    def _watch(self) -> None:
        prefix = self._keys.holdings()
        while not self._stopped.is_set():
            try:
                revision, found = self._kv.range(prefix)
            except EtcdUnavailable:
                self._stopped.wait(0.2)
                continue
            self._put(found)
            self._kv.watch(prefix, revision + 1,
                           lambda events, _: self._put({k: v for k, v in events if v}),
                           self._stopped)

    def _put(self, found) -> None:
        for key in found:
            job, rank, step, index = key[len(self._keys.holdings()):].split("/")
            with self._lock:
                self._held.add((job, int(rank), int(step), int(index)))

    def held_under(self, index: int) -> set[tuple[int, int]]:
        """(rank, step) of every copy ever published under ring ``index``."""
        with self._lock:
            return {(rank, step) for _, rank, step, i in self._held if i == index}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _kv(kv: dict) -> tuple[str, bytes, str]:
    """(key, value, lease) of a key the gateway answered (a holding's value is a
    HeldCopy message, not text)."""
    return (base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
            kv.get("lease", "0"))


def job_hosts(cluster, world: int):
    """The hosts the job's ranks run on (a spare host added later runs none), shaped as a
    Cluster for test_network_faults' helpers."""
    return types.SimpleNamespace(hosts=cluster.hosts[:world], daemons=cluster.daemons[:world])


def newest_committed(history: History) -> int:
    return max(c.step for c in history.commits)


def held_copies(daemon, job: str) -> set[tuple[int, int]]:
    """(rank, step) of the copies of ``job`` ``daemon`` holds (LOCAL: those it publishes)."""
    status = daemon.stub.Status(pb.StatusRequest(job=job), timeout=10)
    return {(row.rank, s.step) for j in status.jobs for s in j.steps for row in s.ranks
            if row.state == pb.LOCAL}


def published(etcd_url: str, prefix: str, job: str, index: int) -> set[tuple[int, int]]:
    """(rank, step) of the holdings etcd shows now under ring ``index``."""
    found = EtcdKV(parse_endpoints(etcd_url)).range(keys_lib.Keys(prefix).holdings(job))[1]
    return {(int(rank), int(step)) for rank, step, i in
            (key.rsplit("/", 3)[1:] for key in found) if int(i) == index}


def copied_again(daemon, rank: int, since: int) -> bool:
    """Whether ``daemon`` holds a replica of ``rank`` at a step from ``since`` on."""
    status = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10)
    return any(row.rank == rank and row.replica and s.step >= since
               for job in status.jobs for s in job.steps for row in s.ranks)


# -- on a Cluster -------------------------------------------------------------------------


def test_a_daemon_cut_off_past_its_lease_steps_down_for_its_replacement(start_cluster):
    # four positions for three hosts: the one cut off finds a free one when it is back
    cluster, history = start_cluster(3, *FLAGS, "--group-size", "4", etcd=True), History()
    with RingWatch.of(cluster, history) as watch:
        training = Training(cluster, history)
        wait_for(lambda: history.commits, "a first committed step")
        cluster.partition([0], [1, 2, "etcd"])
        history.fault("host 0 cut off from etcd and its peers", keeps="committed")
        spare = cluster.add_host(index=0)  # returns once host 0's lease ran out
        assert cluster.daemons[spare].ring_index() == 0
        # host 0 stepped down before etcd could give its position away
        assert cluster.daemons[0].ring_index() == -1
        cluster.heal()
        healed = time.monotonic()
        wait_for(lambda: cluster.daemons[0].ring_index() == 3,
                 "host 0 to take the free position 3")
        wait_for(lambda: watch.held_under(3), "host 0's copies published under position 3")
        assert_recovers(job_hosts(cluster, 3), training, history, healed, "the heal")
    # it said so: whether a renewal failed past its lease (stepping down) before the heal
    # depends on timing; finding the lease gone after it does not
    logged = cluster.daemons[0].stderr_text()
    assert "the etcd lease of ring position 0 ran out" in logged
    assert "took ring position 3 (position 0 is another daemon's now)" in logged
    assert violations(history) == []


def test_etcd_cut_off_from_every_daemon_while_training_then_healed(start_cluster):
    cluster, history = start_cluster(3, *FLAGS, etcd=True), History()
    with RingWatch.of(cluster, history):
        training = Training(cluster, history)
        wait_for(lambda: history.commits, "a first committed step")
        cluster.partition(["etcd"], [0, 1, 2])
        history.fault("etcd cut off from every daemon", keeps="committed")
        wait_for(lambda: all(d.ring_index() == -1 for d in cluster.daemons),
                 "every daemon to step down once its lease may have run out")
        cut_at = newest_committed(history)
        # restores go on without etcd: each rank's copy from memory, the step asked
        # judged on what the peers answer
        steps, digests = {}, {}
        for rank, daemon in enumerate(cluster.daemons):
            client = NumpyClient(JOB, rank, 3, options(daemon))
            steps[rank], arrays = client.restore(cut_at, alone=True)
            assert client.last_restore_source == "memory"
            digests[rank] = digest(arrays)
            client.close()
        history.restored(JOB, steps, digests)
        cluster.heal()
        healed = time.monotonic()
        wait_for(lambda: [d.ring_index() for d in cluster.daemons] == [0, 1, 2],
                 "every daemon back at its own position")
        assert_recovers(cluster, training, history, healed, "the heal")
    assert violations(history) == []


def test_the_minority_side_of_a_partition_steps_down_and_takes_its_position_again(
        start_cluster):
    cluster, history = start_cluster(3, *FLAGS, etcd=True), History()
    with RingWatch.of(cluster, history):
        training = Training(cluster, history)
        wait_for(lambda: history.commits, "a first committed step")
        cluster.partition([0], [1, 2, "etcd"])
        history.fault("host 0 alone on the minority side", keeps="committed")
        cut_at = newest_committed(history)
        wait_for(lambda: cluster.daemons[0].ring_index() == -1
                 and cluster.daemons[1].peers_seen() == cluster.daemons[2].peers_seen() == {1, 2},
                 "host 0 to step down and the majority to drop its position")
        # rank 0's copy on host 1 is pushed on to host 2 (its primary was on host 0)
        wait_for(lambda: copied_again(cluster.daemons[2], 0, cut_at),
                 "rank 0's copies re-replicated on the majority side")
        cluster.heal()
        healed = time.monotonic()
        wait_for(lambda: cluster.daemons[0].ring_index() == 0, "host 0 back at position 0")
        assert_recovers(cluster, training, history, healed, "the heal")
    assert violations(history) == []


def test_a_frozen_daemon_past_its_lease_takes_a_free_position_when_thawed(start_cluster):
    cluster, history = start_cluster(3, *FLAGS, "--group-size", "4", etcd=True), History()
    with RingWatch.of(cluster, history):
        training = Training(cluster, history)
        wait_for(lambda: history.commits, "a first committed step")
        cluster.freeze(1)
        history.fault("host 1's daemon frozen", keeps="committed")
        frozen_at = newest_committed(history)
        wait_for(lambda: cluster.daemons[0].peers_seen() == cluster.daemons[2].peers_seen()
                 == {0, 2}, "the others to declare the frozen daemon dead")
        wait_for(lambda: copied_again(cluster.daemons[0], 1, frozen_at),
                 "rank 1's copies re-replicated to host 0")
        spare = cluster.add_host(index=1)
        assert cluster.daemons[spare].ring_index() == 1
        cluster.thaw(1)
        thawed = time.monotonic()
        wait_for(lambda: cluster.daemons[1].ring_index() == 3,
                 "the thawed daemon to take the free position 3")
        wait_connected(cluster.daemons, 60)
        assert_recovers(job_hosts(cluster, 3), training, history, thawed, "the thaw")
    assert violations(history) == []


def test_a_daemon_whose_position_was_taken_stays_out_until_one_frees(start_cluster):
    cluster, history = start_cluster(2, *FLAGS, etcd=True), History()
    with RingWatch.of(cluster, history):
        test_peers.snapshot_steps(cluster, range(3), world=2)
        wait_for(lambda: test_peers.committed(cluster.daemons[0], 2), "step 2 committed")
        history.committed(test_peers.JOB, 2, {r: digest(test_peers.state(r, 2))
                                              for r in range(2)})
        cluster.partition([0], [1, "etcd"])
        history.fault("host 0 cut off from etcd and host 1", keeps="committed")
        spare = cluster.add_host()  # the one position free once host 0's lease ran out
        assert cluster.daemons[spare].ring_index() == 0
        cluster.heal()
        wait_for(lambda: "out of the ring" in cluster.daemons[0].stderr_text(),
                 "host 0 to find every position held")
        assert cluster.daemons[0].ring_index() == -1
        # out of the ring it still serves its trainer what the group committed
        restored = _restore(cluster.daemons[0], 0, 2, history)
        assert restored == 2
        cluster.kill(spare)
        wait_for(lambda: cluster.daemons[0].ring_index() == 0,
                 "host 0 to take position 0 once the spare's lease ran out", timeout=30)
        # nothing it held is lost: all of it is published under the position it took
        # (the spare's keys went with its lease before the position could be taken)
        held = held_copies(cluster.daemons[0], test_peers.JOB)
        wait_for(lambda: published(cluster.etcd.url, CLUSTER_PREFIX, test_peers.JOB, 0) == held,
                 f"host 0's copies {sorted(held)} published under position 0")
        test_peers.snapshot_steps(cluster, [3], world=2)
        wait_for(lambda: test_peers.committed(cluster.daemons[1], 3), "step 3 committed")
    assert violations(history) == []


# -- on loopback daemons ------------------------------------------------------------------


def test_a_daemon_thawed_past_its_lease_takes_a_free_position_not_its_old_one(
        start_etcd_ring, etcd):
    ring, history = start_etcd_ring(2, *FLAGS, "--group-size", "3"), History()
    with RingWatch(history, etcd.url, start_etcd_ring.prefix, lambda: list(ring.daemons)):
        frozen = ring.daemons[1]
        frozen.freeze()  # alive, renewing nothing
        try:
            wait_for(lambda: 1 not in slots(etcd, start_etcd_ring.prefix),
                     "the frozen daemon's lease to run out", timeout=30)
            replacement = ring.replace(1)  # the lowest free position: 1
            assert replacement.ready["peer_index"] == 1
        finally:
            frozen.thaw()
        ring.daemons.append(frozen)
        wait_for(lambda: frozen.ring_index() == 2, "the thawed daemon to take position 2")
        ring.wait_connected()
    assert violations(history) == []


def test_a_named_position_another_daemon_took_makes_way_for_a_free_one(
        start_etcd_ring, start_daemon, etcd):
    ring = start_etcd_ring(2, *FLAGS, "--group-size", "4")
    prefix, old = start_etcd_ring.prefix, ring.peers[1]
    ring.daemons[1].kill()
    wait_for(lambda: 1 not in slots(etcd, prefix), "daemon 1's lease to run out",
             timeout=30)
    assert ring.replace(1).ready["peer_index"] == 1  # a replacement took it
    # daemon 1 back on its old address: names/ says position 1, another daemon's now,
    # so it takes the first free one at once instead of waiting for 1
    back = start_daemon(*_etcd_flags(etcd, prefix, old), name="daemon 1 again")
    assert back.ready["peer_index"] == 2
    # killed and started again at once, a daemon waits for its own position (its earlier
    # run's lease runs out within a TTL) rather than taking the free one
    first = ring.peers[0]
    ring.daemons[0].kill()
    again = start_daemon(*_etcd_flags(etcd, prefix, first), name="daemon 0 again")
    assert again.ready["peer_index"] == 0
    assert slots(etcd, prefix) == {0: first, 1: ring.peers[1], 2: old}


def test_a_restore_waits_for_a_restarted_daemon_to_publish_what_it_adopted(
        start_daemon, shm_dirs, etcd, tmp_path):
    prefix, world = "/test/restore-waits", 2
    peers, shms = [f"127.0.0.1:{free_port()}" for _ in range(world)], [shm_dirs(), shm_dirs()]

    def launch(rank: int):
        return start_daemon(*_etcd_flags(etcd, prefix, peers[rank], size=world), "--replicas",
                            "0", "--shm-dir", shms[rank], own_shm_dir=False,
                            name=f"daemon {rank}", stderr=str(tmp_path / f"daemon{rank}.log"),
                            log_level="INFO")
    ring = types.SimpleNamespace(daemons=[launch(r) for r in range(world)])
    test_peers.snapshot_steps(ring, range(4), world=world)
    wait_for(lambda: all(test_peers.committed(d, 3) for d in ring.daemons), "step 3 committed")
    for daemon in ring.daemons:  # the whole group restarts; each rank's copy is on its host
        daemon.kill()
    ring.daemons[0] = launch(0)
    wait_for(lambda: 1 not in slots(etcd, prefix), "daemon 1's old lease to run out",
             timeout=30)
    started: list = []  # daemon 1, or why it did not start
    starting = threading.Thread(target=lambda: started.append(_started(launch, 1)))
    starting.start()
    try:
        wait_for(lambda: 1 in slots(etcd, prefix) or started, "daemon 1 to take its position",
                 interval=0.01)
        if started and isinstance(started[0], BaseException):
            raise started[0]
        # daemon 1 adopts rank 1's copies and publishes them a moment after taking its
        # position: the restore must not pick a step (or fail) on what etcd shows now
        test_peers.assert_restores(ring.daemons[0], 0, 3, "memory", world=world)
    finally:
        starting.join(timeout=150)
    if isinstance(started[0], BaseException):
        raise started[0]
    test_peers.assert_restores(started[0], 1, 3, "memory", world=world)
    assert set(keys(etcd, f"{prefix}/ready/").values()) == {p.encode() for p in peers}


def test_the_claim_order_and_who_is_ready_are_decided_from_what_etcd_shows():
    own, other = "10.0.0.1:7", "10.0.0.2:7"
    assert keys_lib.claim_order(4, 1, True, {1: other}, own) == [1]  # --index: that one
    assert keys_lib.claim_order(4, 1, False, {1: own, 0: other}, own) == [1]  # its own run's
    assert keys_lib.claim_order(4, 1, False, {1: other, 0: other}, own) == [2, 3]
    assert keys_lib.claim_order(4, 2, False, {0: other}, own) == [2, 1, 3]
    assert keys_lib.claim_order(2, -1, False, {0: other, 1: other}, own) == []
    assert keys_lib.unready({0: own, 1: other, 2: "x"}, {0: own, 1: "old", 3: other}) == {1, 2}


def _started(launch, rank: int):
    try:
        return launch(rank)
    except Exception as err:  # handed to the test's thread, raised there
        return err


def _restore(daemon, rank: int, world: int, history: History) -> int:
    client = test_peers.client(daemon, rank, world)
    step, arrays = client.restore()
    client.close()
    history.restored(test_peers.JOB, {rank: step}, {rank: digest(arrays)})
    return step


def _etcd_flags(etcd, prefix: str, peer: str, size: int = 4) -> tuple[str, ...]:
    return ("--coordination", etcd.url, "--coordination-prefix", prefix, "--group-size",
            str(size), "--peer-listen", peer, *FLAGS)


