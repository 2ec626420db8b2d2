"""A job is its whole directory: two CheckpointManagers whose folders share their last name
(``a/run`` and ``b/run``, as public trainers lay out runs) are two jobs of the daemon,
on one daemon and across a ring, with steps held in memory only or not: neither lists,
restores nor overwrites the other's steps."""

import os

import grpc
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import wait_for


def manager(directory, address: str, memory: bool) -> CheckpointManager:
    extra = {"memory_interval_steps": 1, "save_interval_steps": 100} if memory else {}
    return CheckpointManager(directory, options=CheckpointManagerOptions(
        client=ClientOptions(daemon=address), **extra))


def save_run(directory, address: str, memory: bool, base: float, steps: int) -> None:
    with manager(directory, address, memory) as mngr:
        for step in range(steps):
            assert mngr.save(step, args=ocp.args.StandardSave({"x": jnp.full((4,), base + step)}))
        mngr.wait_until_finished()


def seen(directory, address: str, memory: bool) -> tuple[list[int], list[float]]:
    """The steps a manager of ``directory`` lists, and the value of each as restored."""
    with manager(directory, address, memory) as mngr:
        steps = list(mngr.all_steps())
        return steps, [float(np.asarray(mngr.restore(s)["x"])[0]) for s in steps]


def wait_held(daemon, job: str, step: int) -> None:
    def held() -> bool:
        try:
            status = daemon.stub.Status(pb.StatusRequest(job=job), timeout=10).jobs[0]
        except grpc.RpcError:
            return False
        return any(s.step == step and s.committed for s in status.steps)
    wait_for(held, f"step {step} of {job} held by {daemon.name}")


@pytest.mark.parametrize("memory", [False, True], ids=["on disk", "in memory only"])
def test_two_managers_whose_folders_share_their_last_name_never_meet(start_daemon, tmp_path,
                                                                     memory):
    daemon = start_daemon("--durable-dir", str(tmp_path), "--keep", "8", metrics="127.0.0.1:0")
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    save_run(a, daemon.address, memory, 10.0, 3)
    assert seen(b, daemon.address, memory) == ([], [])  # a fresh run: nothing of a's
    save_run(b, daemon.address, memory, 20.0, 2)
    assert seen(b, daemon.address, memory) == ([0, 1], [20.0, 21.0])
    assert seen(a, daemon.address, memory) == ([0, 1, 2], [10.0, 11.0, 12.0])
    assert set(daemon.restores_served()) == {"memory"}  # each from its own job's memory
    jobs = {j.job for j in daemon.stub.Status(pb.StatusRequest(), timeout=10).jobs}
    assert jobs == {f"{os.path.realpath(a)}/default", f"{os.path.realpath(b)}/default"}
    if memory:  # only step 0 is the policy's, on disk; the others are the daemons'
        assert ocp.CheckpointManager(a).all_steps() == [0]


@pytest.mark.parametrize("memory", [False, True], ids=["on disk", "in memory only"])
def test_across_a_ring_each_host_holds_both_jobs_apart(start_ring, tmp_path, memory):
    ring = start_ring(2, "--replicas", "1", "--durable-dir", str(tmp_path), "--keep", "8")
    first, second = ring.daemons
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    save_run(a, first.address, memory, 10.0, 3)  # host 0's job
    save_run(b, second.address, memory, 20.0, 2)  # host 1's job, the same last name
    # each host's daemon holds the other's copies (replicas): a job moved to the other host
    # finds its own steps there, never the other job's
    wait_held(first, f"{os.path.realpath(b)}/default", 1)
    wait_held(second, f"{os.path.realpath(a)}/default", 2)
    for directory, daemon, base, latest in ((b, first, 20.0, 1), (a, second, 10.0, 2)):
        steps, values = seen(directory, daemon.address, memory)
        # every step on disk, and of the steps held in memory only those the ring holds
        # whole (replication sends a rank's newest when it is behind): the latest
        assert steps[0] == 0 and steps[-1] == latest and set(steps) <= set(range(latest + 1))
        assert values == [base + step for step in steps]
