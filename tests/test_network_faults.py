"""Faults of the network, on a Cluster (each host a network namespace): a daemon cut off from
its ring while training runs, a frozen daemon, a slow link under a restore. Every test
records what the job was told and what it restored, and the history checker says whether
the contract held."""

import hashlib
import threading
import time

import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import wait_for
from bubblesnap.testing.history import History, violations

JOB = "net"
#: Faster than the default 5 s, so that a fault is found within a test's few seconds.
FLAGS = ("--replicas", "1", "--dead-after", "1")


def state(rank: int, step: int, size: int = 16384) -> dict[str, np.ndarray]:
    return {"w": np.arange(size, dtype=np.float32) * (rank + 1) + step,
            "step": np.full((4,), step * 10 + rank, dtype=np.int64)}


def digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode() + arrays[name].tobytes())
    return h.hexdigest()


def options(daemon, **more) -> ClientOptions:
    return ClientOptions(daemon=daemon.address, commit_timeout_seconds=3.0,
                         restore_timeout_seconds=60.0, **more)


class Training:
    """A job of one rank per host, each a thread snapshotting every step into its host's
    daemon and waiting for the job to commit it (at most 3 s), as a training loop whose
    step is ``compute`` seconds long. The ranks step together, as a job's collectives make
    them (a barrier per step): a rank whose daemon is sick holds the others up. The steps
    the job was told are committed go into ``history``."""

    def __init__(self, cluster, history: History, compute: float = 0.05):
        self.cluster, self.history, self.compute = cluster, history, compute
        self.world = len(cluster.hosts)
        self._stop = threading.Event()
        self._step_done = threading.Barrier(self.world)
        self._recorded: set[int] = set()
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._rank, args=(r,), daemon=True)
                         for r in range(self.world)]
        for thread in self._threads:
            thread.start()

    def _rank(self, rank: int) -> None:
        client = NumpyClient(JOB, rank, self.world, options(self.cluster.daemons[rank]))
        try:
            step = 0
            while not self._stop.is_set():
                result = client.snapshot(step, state(rank, step), wait="job")
                if result.committed:
                    self._committed(step)
                step += 1
                self._step_done.wait()  # the job's collectives: no rank runs ahead
                self._stop.wait(self.compute)
        except threading.BrokenBarrierError:
            pass  # stopped: stop() broke the barrier the others wait at
        except BaseException as err:
            self.errors.append(err)
        finally:
            client.close()

    def _committed(self, step: int) -> None:
        with self._lock:
            if step in self._recorded:
                return
            self._recorded.add(step)
        self.history.committed(JOB, step, {r: digest(state(r, step)) for r in range(self.world)})

    def committed_since(self, since: float) -> bool:
        return any(c.at > since for c in self.history.commits)

    def stop(self) -> None:
        self._stop.set()
        self._step_done.abort()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not self.errors, self.errors
        self.history.fault("training stopped", keeps="committed")


def restore_every_rank(cluster, history: History) -> dict[int, str]:
    """Each rank restores from its host's daemon, into the history; rank -> source."""
    steps, digests, sources = {}, {}, {}
    for rank, daemon in enumerate(cluster.daemons):
        client = NumpyClient(JOB, rank, len(cluster.hosts), options(daemon))
        steps[rank], arrays = client.restore()
        digests[rank], sources[rank] = digest(arrays), client.last_restore_source
        client.close()
    history.restored(JOB, steps, digests)
    return sources


def assert_recovers(cluster, training: Training, history: History, since: float,
                    what: str) -> None:
    """A step commits after ``since`` (the fault's end); then every rank restores, and the
    history keeps the contract."""
    wait_for(lambda: training.committed_since(since), f"a step committed after {what}")
    training.stop()
    restore_every_rank(cluster, history)
    assert violations(history) == []


def test_a_daemon_cut_off_from_its_ring_while_training_then_healed(start_cluster):
    cluster, history = start_cluster(3, *FLAGS), History()
    training = Training(cluster, history)
    wait_for(lambda: history.commits, "a first committed step")
    cluster.partition([0], [1, 2])
    history.fault("host 0 cut off from hosts 1 and 2")
    wait_for(lambda: cluster.daemons[1].peers_seen() == {1, 2}
             and cluster.daemons[0].peers_seen() == {0}, "both sides to see the partition")
    cluster.heal()
    assert_recovers(cluster, training, history, time.monotonic(), "the heal")


def test_a_frozen_daemon_is_declared_dead_its_copies_made_again_and_it_rejoins(start_cluster):
    cluster, history = start_cluster(3, *FLAGS), History()
    training = Training(cluster, history)
    wait_for(lambda: history.commits, "a first committed step")
    cluster.freeze(1)
    history.fault("host 1's daemon frozen")
    frozen_at = max(c.step for c in history.commits)
    wait_for(lambda: cluster.daemons[0].peers_seen() == cluster.daemons[2].peers_seen()
             == {0, 2}, "the others to declare the frozen daemon dead")

    def rank1_copied_again() -> bool:  # its copy on host 2 pushed on to host 0
        status = cluster.daemons[0].stub.Status(pb.StatusRequest(job=JOB), timeout=10)
        return any(row.rank == 1 and row.replica and s.step >= frozen_at
                   for job in status.jobs for s in job.steps for row in s.ranks)
    wait_for(rank1_copied_again, "rank 1's copies re-replicated to host 0")
    cluster.thaw(1)
    thawed = time.monotonic()
    wait_for(lambda: all(d.peers_seen() == {0, 1, 2} for d in cluster.daemons),
             "the thawed daemon to be seen again by every daemon")
    assert_recovers(cluster, training, history, thawed, "the thaw")


def test_a_restore_from_a_peer_over_a_slowed_link_finishes_bit_for_bit(start_cluster):
    cluster, history = start_cluster(3, *FLAGS), History()
    arrays = state(0, 3, size=1 << 21)  # 8 MiB: most of a second at 100 Mbit/s
    client = NumpyClient(JOB, 0, 1, options(cluster.daemons[0]))
    assert client.snapshot(3, arrays, wait="job").committed
    client.close()
    history.committed(JOB, 3, {0: digest(arrays)})
    cluster.kill(0)  # host 0 lost with its memory; its replica is on host 1
    history.fault("host 0 lost", keeps="committed")

    def copied_to_host_2() -> bool:  # the replica pushed on: the group holds 1 + k again
        status = cluster.daemons[2].stub.Status(pb.StatusRequest(job=JOB), timeout=10)
        return any(s.step == 3 and row.replica for job in status.jobs for s in job.steps
                   for row in s.ranks)
    # then nothing is pushed to the restarted host 0: its restore pulls over its link
    wait_for(copied_to_host_2, "rank 0's copy re-replicated to host 2")
    cluster.restart(0)
    cluster.slow(0, "100mbit")
    client = NumpyClient(JOB, 0, 1, options(cluster.daemons[0]))
    step, restored = client.restore()
    assert client.last_restore_source == "peer"
    client.close()
    history.restored(JOB, {0: step}, {0: digest(restored)})
    assert violations(history) == []
