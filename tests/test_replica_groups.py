"""Data-parallel replica groups: a replicated shard is copied once per group, not per rank.

Real daemon processes on loopback; the group's lowest rank (its copier)
snapshots, the other members copy nothing and are held, committed and
restored through its copies. (Bad input: tests/test_bad_input.py.)
"""

import os
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.clients.jax import BubbleSnapshotOptions, BubbleSnapshotter, SnapshotClient
from bubblesnap.protos import daemon_pb2 as pb
from tests.test_peers import wait_for

JOB = "dp"


def stage_state(stage: int, step: int) -> dict[str, np.ndarray]:
    """Each pipeline stage has its own layout; its data-parallel replicas share it."""
    n = 1024 * (stage + 1)
    return {"w": np.arange(n, dtype=np.float32) * (stage + 1) + step,
            f"stage{stage}/b": np.full((stage + 2, 8), step * 10 + stage, dtype=np.int32)}


def dp_client(daemon, rank: int, world: int, group) -> NumpyClient:
    return NumpyClient(JOB, rank, world, ClientOptions(daemon=daemon.address,
                                                       restore_timeout_seconds=60),
                       replica_group=group)


def job_status(daemon) -> pb.JobStatus:
    return daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs[0]


def assert_same(arrays, expected) -> None:
    assert sorted(arrays) == sorted(expected)
    for name, array in expected.items():
        assert arrays[name].tobytes() == array.tobytes(), name


def segment_bytes(arrays) -> int:
    return sum(-(-a.nbytes // 64) * 64 for a in arrays.values())


def test_two_replicas_copy_once_and_both_restore(daemon):
    c0, c1 = (dp_client(daemon, r, 2, (0, 1)) for r in range(2))
    state = stage_state(0, 3)
    skipped = c1.snapshot(3, state)
    assert (skipped.taken, skipped.copied_by) == (False, 0), skipped
    assert "held through rank 0" in skipped.reason
    result = c0.snapshot(3, state)
    assert result.taken and result.committed and result.copied_by is None, result

    status = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10)
    (step,) = status.jobs[0].steps
    assert step.committed and [r.rank for r in step.ranks] == [0]
    assert list(step.ranks[0].held_for) == [1]
    assert list(status.jobs[0].registered_ranks) == [0, 1]
    assert status.memory.used_bytes == segment_bytes(state)  # one state, not two

    for c in (c1, c0):
        got_step, arrays = c.restore()
        assert got_step == 3
        assert_same(arrays, state)
    table = subprocess.run([sys.executable, "-m", "bubblesnap", "status", "--daemon",
                            daemon.address], capture_output=True, text=True, check=True)
    assert "ranks [1] are held through rank 0's copies" in table.stdout
    for c in (c0, c1):
        c.close()


def test_pipeline_times_data_parallel_needs_every_group(daemon):
    groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    clients = {r: dp_client(daemon, r, 4, g) for r, g in groups.items()}
    for r in (1, 3):
        assert clients[r].snapshot(0, stage_state(r // 2, 0)).copied_by == r - 1
    first = clients[0].snapshot(0, stage_state(0, 0))
    assert first.taken and first.committed is False  # group {2, 3} holds nothing yet
    last = clients[2].snapshot(0, stage_state(1, 0))
    assert last.taken and last.committed
    (step,) = job_status(daemon).steps
    assert sorted((r.rank, tuple(r.held_for)) for r in step.ranks) == [(0, (1,)), (2, (3,))]
    for rank, c in clients.items():
        got_step, arrays = c.restore()
        assert got_step == 0
        assert_same(arrays, stage_state(rank // 2, 0))
        c.close()


def test_ring_replicates_a_group_once_and_a_member_survives_its_copier(start_ring):
    ring = start_ring(2, "--replicas", "1")
    c0, c1 = (dp_client(ring.daemons[r], r, 2, (0, 1)) for r in range(2))
    for step in range(3):
        assert c1.snapshot(step, stage_state(0, step)).copied_by == 0
        assert c0.snapshot(step, stage_state(0, step)).taken
    c0.close()
    c1.close()

    def rows_of_step_2():
        return sorted((i, r.rank, r.replica, r.copies, tuple(r.held_for), s.committed)
                      for i, d in enumerate(ring.daemons) for s in job_status(d).steps
                      if s.step == 2 for r in s.ranks)
    # One primary and one replica of rank 0, committed for both ranks; rank 1 has no
    # copy of its own anywhere. (Waited for: daemon 0 counts copies as it last gathered them.)
    expected = [(0, 0, False, 2, (1,), True), (1, 0, True, 2, (1,), True)]
    wait_for(lambda: rows_of_step_2() == expected, f"step 2 copied once: {expected}")

    ring.daemons[0].kill()
    survivor = dp_client(ring.daemons[1], 1, 2, (0, 1))
    got_step, arrays = survivor.restore()
    assert (got_step, survivor.last_restore_source) == (2, "memory")  # daemon 1's replica
    assert_same(arrays, stage_state(0, 2))
    survivor.close()


def test_replacement_daemon_restores_a_member_it_never_saw_register(start_ring):
    ring = start_ring(3, "--replicas", "1")
    # Rank 0's copies live on daemons 0 and 1; daemon 2 holds no copy at all.
    c0, c1 = dp_client(ring.daemons[0], 0, 2, (0, 1)), dp_client(ring.daemons[2], 1, 2, (0, 1))
    assert c1.snapshot(0, stage_state(0, 0)).copied_by == 0
    assert c0.snapshot(0, stage_state(0, 0)).taken
    c0.close()
    c1.close()
    wait_for(lambda: job_status(ring.daemons[2]).latest_committed_step == 0,
             "daemon 2 sees step 0 committed through rank 0's copies")
    ring.daemons[2].kill()
    replacement = ring.replace(2)
    fresh = dp_client(replacement, 1, 2, (0, 1))  # restores before it registers
    got_step, arrays = fresh.restore()
    assert (got_step, fresh.last_restore_source) == (0, "peer")
    assert_same(arrays, stage_state(0, 0))
    fresh.close()


def test_durable_tier_writes_a_group_once_and_restores_a_member(start_daemon, tmp_path):
    durable = tmp_path / "durable"
    flags = ("--durable-dir", str(durable), "--durable-every-steps", "1")
    daemon = start_daemon(*flags)
    c0, c1 = (dp_client(daemon, r, 2, (0, 1)) for r in range(2))
    assert c1.snapshot(0, stage_state(0, 0)).copied_by == 0
    assert c0.snapshot(0, stage_state(0, 0)).committed
    deadline = time.monotonic() + 60
    while list(job_status(daemon).durable_steps) != [0]:
        assert time.monotonic() < deadline, "step 0 never became durable for both ranks"
        time.sleep(0.2)
    step_dir = durable / JOB / "step_0"  # one checkpoint; the group is written once, by rank 0
    assert sorted(os.listdir(step_dir / ".bubblesnap")) == ["complete.json", "rank_0.json"]
    assert [p for p in os.listdir(step_dir) if p.startswith("ocdbt.process_")] == \
        ["ocdbt.process_0"]
    c0.close()
    c1.close()

    daemon.kill()
    fresh = dp_client(start_daemon(*flags), 1, 2, (0, 1))
    got_step, arrays = fresh.restore()
    assert (got_step, fresh.last_restore_source) == (0, "durable")
    assert_same(arrays, stage_state(0, 0))
    fresh.close()


def test_bubble_snapshotter_of_a_replica_copies_nothing(start_daemon):
    daemon = start_daemon("--max-interval", "1")
    options = ClientOptions(daemon=daemon.address)
    snaps = [BubbleSnapshotter(SnapshotClient(JOB, r, 2, options, replica_group=(0, 1)), 0,
                               BubbleSnapshotOptions(warmup_iterations=1))
             for r in range(2)]

    def receive():
        time.sleep(0.005)  # the neighbour's tensor arrives after a real wait
        return "tensor", time.perf_counter()

    for it in range(12):
        state = {"w": jnp.arange(4096, dtype=jnp.float32) + it}
        for snap in snaps:
            snap.begin_iteration(it)
            assert snap.bubble(0, receive) == "tensor"
            snap.end_iteration(it, state)
    for snap in snaps:
        snap.flush()
        snap.close()
    copier, replica = snaps
    assert copier.commits_acknowledged and copier.records
    assert replica.commits_acknowledged == [] and replica.records == []
    status = job_status(daemon)
    assert [r.rank for r in status.plan.ranks] == [0]  # the replica reported no bubbles
    assert {(r.rank, tuple(r.held_for)) for s in status.steps for r in s.ranks} == {(0, (1,))}
    step, arrays = dp_client(daemon, 1, 2, (0, 1)).restore()
    assert arrays["w"].tobytes() == np.asarray(jnp.arange(4096, dtype=jnp.float32)
                                               + step).tobytes()
