"""Daemons as a group: replication, host loss, the durable tier, corrupt copies, the token.

Every daemon is a separate process on a loopback port (one per simulated
host); hosts die by SIGKILL.
"""

import os
import pathlib
import subprocess
import sys

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.testing import wait_for

JOB = "ring"


def state(rank: int, step: int, run: int = 0) -> dict[str, np.ndarray]:
    """Sizes differ per rank, values per rank, step and run: a mixed-up copy shows."""
    n = 2048 * (rank + 1)
    return {"w": (np.arange(n, dtype=np.float32) * (rank + 1) + step + 1000 * run),
            "m": np.full((rank + 1, 64), step * 10 + rank + 1000 * run, dtype=np.int32)}


def client(daemon, rank: int, world: int = 3) -> NumpyClient:
    return NumpyClient(JOB, rank, world, ClientOptions(daemon=daemon.address,
                                                       restore_timeout_seconds=60))


def snapshot_steps(ring, steps, world: int = 3, run: int = 0) -> None:
    clients = [client(ring.daemons[r], r, world) for r in range(world)]
    for step in steps:
        for rank, c in enumerate(clients):
            result = c.snapshot(step, state(rank, step, run))
            assert result.taken, result.reason
    for c in clients:
        c.close()


def job_status(daemon) -> pb.JobStatus:
    return daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs[0]


def committed(daemon, step: int) -> bool:
    return any(s.step == step and s.committed for s in job_status(daemon).steps)


def assert_restores(daemon, rank: int, step: int, source: str, run: int = 0,
                    world: int = 3) -> None:
    c = client(daemon, rank, world)
    got_step, arrays = c.restore()
    assert (got_step, c.last_restore_source) == (step, source)
    for name, expected in state(rank, step, run).items():
        assert arrays[name].tobytes() == expected.tobytes(), f"rank {rank} {name} differs"
    c.close()


def test_replicas_counted_and_step_committed_with_k_plus_one_copies(start_ring):
    ring = start_ring(3, "--replicas", "1")
    snapshot_steps(ring, range(3))
    wait_for(lambda: committed(ring.daemons[0], 2), "step 2 committed for the job")
    status = job_status(ring.daemons[1])
    rows = {(r.rank, s.step): r for s in status.steps for r in s.ranks}
    assert status.replicas == 1
    # daemon 1 holds its own rank 1 and the replica of rank 0 (its predecessor)
    assert not rows[(1, 2)].replica and rows[(0, 2)].replica
    assert rows[(1, 2)].copies == 2 and rows[(0, 2)].copies == 2
    assert (2, 2) not in rows
    # a peer's Holdings answer carries the steps it takes as committed (the others keep
    # them committed if its host goes before they saw them whole)
    wait_for(lambda: committed(ring.daemons[1], 2), "step 2 committed on daemon 1")
    held = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[1])).Holdings(
        ppb.HoldingsRequest(job=JOB), timeout=10)
    vouched = {c.job: list(c.steps) for c in held.committed}
    assert max(vouched[JOB]) == 2  # the newest step snapshotted, taken committed


def test_host_loss_is_restored_from_a_peer_and_re_replicated(start_ring):
    ring = start_ring(3, "--replicas", "1")
    snapshot_steps(ring, range(4))
    wait_for(lambda: committed(ring.daemons[0], 3), "step 3 committed")
    ring.daemons[1].kill()

    # The survivors bring every step back to two copies: rank 0 (whose replica
    # lived on host 1) goes to host 2, rank 1 (whose only copy is on host 2) to host 0.
    def back_to_two_copies():
        rows = [(r.rank, s.step, r.copies) for s in job_status(ring.daemons[2]).steps
                for r in s.ranks if s.step == 3]
        return sorted(rows) == [(0, 3, 2), (1, 3, 2), (2, 3, 2)] and rows
    wait_for(back_to_two_copies, "re-replication after host 1 died")

    replacement = ring.replace(1)
    assert_restores(replacement, 1, 3, "peer")
    assert_restores(ring.daemons[0], 0, 3, "memory")
    assert_restores(ring.daemons[2], 2, 3, "memory")
    # the replacement now holds rank 1 itself and serves it from memory
    assert_restores(replacement, 1, 3, "memory")


def test_two_adjacent_hosts_lost_restore_from_the_durable_tier(start_ring, tmp_path):
    durable = tmp_path / "durable"
    ring = start_ring(3, "--replicas", "1", "--durable-dir", str(durable),
                      "--durable-every-steps", "2")
    # Step 2 is written before step 4 commits: writes that fall behind collapse into
    # the roundest step, and the retention checked below needs both on disk.
    snapshot_steps(ring, range(3))
    wait_for(lambda: 2 in job_status(ring.daemons[0]).durable_steps, "step 2 written durably")
    snapshot_steps(ring, range(3, 6))
    wait_for(lambda: 4 in job_status(ring.daemons[0]).durable_steps, "step 4 written durably")
    wait_for(lambda: committed(ring.daemons[0], 5), "step 5 committed")
    held = {(r.rank, s.step) for s in job_status(ring.daemons[0]).steps for r in s.ranks}
    assert (1, 4) not in held, held
    ring.daemons[1].proc.kill()  # both at once
    ring.daemons[2].kill()
    ring.daemons[1].kill()
    # Rank 1 lived on hosts 1 and 2 only: step 5 is lost, step 4 is on disk.
    new1, new2 = ring.replace(1), ring.replace(2)
    assert_restores(new1, 1, 4, "durable")
    assert_restores(ring.daemons[0], 0, 4, "memory")
    assert_restores(new2, 2, 4, "peer")  # host 0 held rank 2's replica
    # --durable-keep 2 keeps the two newest steps every rank wrote (test_durable.py
    # checks that older ones go)
    assert {"step_2", "step_4"} <= set(os.listdir(durable / JOB))

    # The job resumed from step 4: the old run's step 5 (still in host 0's memory)
    # is gone, and the new run snapshots step 5 again, with its own values.
    snapshot_steps(ring, [5], run=1)
    wait_for(lambda: committed(ring.daemons[0], 5), "the new step 5 committed")
    for rank in range(3):
        assert_restores(ring.daemons[rank], rank, 5, "memory", run=1)


def test_a_stage_restored_alone_leaves_the_others_later_copies(start_ring):
    ring = start_ring(3, "--replicas", "1")
    sender = client(ring.daemons[0], 0)
    sender.register(state(0, 0))  # a rank logs once registered
    for step in range(4):  # what stage 0 sent stage 1
        sender.log(step, bytes([step]) * 1024, stream="act/mb0")
    sender.wait_log()
    snapshot_steps(ring, range(3))
    wait_for(lambda: committed(ring.daemons[0], 2), "step 2 committed")
    # --keep 2: step 1 is the group's oldest kept snapshot; older records are gone
    wait_for(lambda: [s for s, _ in sender.read_log(1, stream="act/mb0")] == [2, 3]
             and not sender.read_log(-1, stream="act/mb0"),
             "boundary records of step 1 and older dropped")
    sender.close()
    for rank in (0, 2):  # these stages finish step 3; rank 1's trainer dies before its copy
        c = client(ring.daemons[rank], rank)
        assert c.snapshot(3, state(rank, 3)).taken
        c.close()
    def held_at_host_0():  # rank 0's copy and rank 2's replica
        return {(r.rank, s.step) for s in job_status(ring.daemons[0]).steps for r in s.ranks}
    wait_for(lambda: {(0, 3), (2, 3)} <= held_at_host_0(), "the step-3 copies at host 0")
    stage = client(ring.daemons[1], 1)
    step, arrays = stage.restore(alone=True)  # the others keep their state: no rollback
    assert step == 2 and arrays["w"].tobytes() == state(1, 2)["w"].tobytes()
    assert {(0, 3), (2, 3)} <= held_at_host_0()
    assert stage.snapshot(3, state(1, 3)).taken  # rank 1 replayed step 3
    stage.close()
    wait_for(lambda: committed(ring.daemons[0], 3), "step 3 committed without a retake")
    for rank in range(3):
        assert_restores(ring.daemons[rank], rank, 3, "memory")


def test_flipped_byte_in_a_replica_is_skipped_and_reported(start_ring):
    ring = start_ring(3, "--replicas", "2")
    snapshot_steps(ring, range(2))
    wait_for(lambda: committed(ring.daemons[0], 1), "step 1 committed with 3 copies")
    ring.daemons[1].kill()
    # Corrupt host 0's copies of rank 1 (the first holder a restore asks).
    rank1_bytes = sum(a.nbytes for a in state(1, 0).values())
    shm = pathlib.Path(ring.daemons[0].shm_dir)
    flipped = 0
    for seg in shm.iterdir():
        if rank1_bytes <= seg.stat().st_size < rank1_bytes + 128:
            with open(seg, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
            flipped += 1
    assert flipped >= 1
    replacement = ring.replace(1)
    assert_restores(replacement, 1, 1, "peer")
    corrupt = job_status(replacement).corrupt_copies
    assert corrupt and corrupt[0].rank == 1 and corrupt[0].step == 1
    assert ring.peers[0] in corrupt[0].source and "checksum" in corrupt[0].detail
    table = subprocess.run([sys.executable, "-m", "bubblesnap", "status", "--daemon",
                            replacement.address], capture_output=True, text=True, check=True)
    assert "corrupt copy skipped: step 1 rank 1 from peer" in table.stdout


def test_peer_calls_without_the_token_are_unauthenticated(start_ring, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    ring = start_ring(2, "--replicas", "1", "--peer-token-file", str(token_file))
    snapshot_steps(ring, range(2), world=2)
    # with the token the daemons replicate to each other
    wait_for(lambda: committed(ring.daemons[0], 1), "step 1 committed between token holders")
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[0]))
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.Holdings(ppb.HoldingsRequest(job=JOB), timeout=10, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "--peer-token" in info.value.details()
    held = stub.Holdings(ppb.HoldingsRequest(job=JOB), timeout=10,
                         metadata=(("authorization", "Bearer s3cret-token"),))
    assert {(c.rank, c.step) for c in held.copies} >= {(0, 1), (1, 1)}
    # the daemon refused the calls and lost nothing
    assert committed(ring.daemons[0], 1)


def test_bad_peer_input_gets_precise_codes(start_ring):
    ring = start_ring(2, "--replicas", "1")
    snapshot_steps(ring, range(1), world=2)
    wait_for(lambda: committed(ring.daemons[0], 0), "step 0 committed")
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[0]))
    cases = [
        ("OpenRead", ppb.OpenReadRequest(job=JOB, rank=0, step=99), grpc.StatusCode.NOT_FOUND),
        ("OpenRead", ppb.OpenReadRequest(job="../x", rank=0, step=0),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("Join", ppb.JoinRequest(index=7, address="x:1"), grpc.StatusCode.INVALID_ARGUMENT),
        ("Replicate", ppb.ReplicateRequest(job=JOB, world_size=2, rank=1, step=5),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]
    cases += [
        ("OpenRead", ppb.OpenReadRequest(job=JOB, rank=0, step=-5),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("Replicate", ppb.ReplicateRequest(job=JOB, world_size=2, rank=1, step=5,
                                           data_address="no-port", tensors=[_spec()]),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for method, request, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, timeout=10)
        assert info.value.code() == code, (method, info.value.details())
    wait_for(lambda: committed(ring.daemons[0], 0), "step 0 still committed")
    # Restoring a step nobody holds is refused before anything is rolled back.
    with pytest.raises(grpc.RpcError) as info:
        ring.daemons[1].stub.Restore(pb.RestoreRequest(job=JOB, rank=1, step=7), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "restorable steps: [0]" in info.value.details()
    for rank in range(2):
        assert_restores(ring.daemons[rank], rank, 0, "memory", world=2)


def _spec():
    return pb.TensorSpec(name="w", dtype="float32", global_shape=[4], shards=[
        pb.ShardSpec(index=[pb.Slice(start=0, stop=4)], nbytes=16)])
