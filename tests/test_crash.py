"""A trainer killed with SIGKILL at any point of a snapshot never leaves a partial step."""

import json
import random
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions
from bubblesnap.clients.jax import SnapshotClient
from bubblesnap.protos import daemon_pb2 as pb
from tests.programs.trainer import PAUSE_POINTS, abstract, state_at


def _trainer(daemon, *flags):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.programs.trainer", "--daemon", daemon.address, *flags],
        stdout=subprocess.PIPE, text=True)


def _events(proc):
    for line in proc.stdout:
        yield json.loads(line)


def _check_restorable(daemon, job, rows):
    """The latest committed step restores whole and equals the state of that step."""
    client = SnapshotClient(job, options=ClientOptions(daemon=daemon.address))
    restored = client.restore(abstract(rows))
    expected = state_at(restored.step, rows)
    for name in expected:
        assert np.asarray(restored.state[name]).tobytes() == np.asarray(expected[name]).tobytes(), \
            f"step {restored.step}: {name} differs from the state of that step"
    client.close()
    return restored.step


@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_kill_at_each_point_of_a_snapshot(daemon, point):
    proc = _trainer(daemon, "--job", point, "--steps", "10", "--pause-step", "4",
                    "--pause-at", point)
    for event in _events(proc):
        if event["event"] == "paused":
            break
    assert event == {"event": "paused", "step": 4, "at": point}
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    status = daemon.stub.Status(pb.StatusRequest(job=point), timeout=10).jobs[0]
    assert status.latest_committed_step == 3
    assert 4 not in [s.step for s in status.steps if s.committed]
    assert _check_restorable(daemon, point, 64) == 3
    with pytest.raises(grpc.RpcError) as info:
        daemon.stub.Restore(pb.RestoreRequest(job=point, rank=0, step=4), timeout=10)
    assert info.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)

    # A restarted trainer reattaches, restores step 3 and snapshots step 4 whole.
    resumed = _trainer(daemon, "--job", point, "--steps", "6", "--resume")
    events = list(_events(resumed))
    assert resumed.wait() == 0
    assert events[0] == {"event": "restored", "step": 3, "matches": True}
    assert [e["step"] for e in events[1:] if e["committed"]] == [4, 5]
    assert _check_restorable(daemon, point, 64) == 5


def test_kill_at_random_moments(daemon):
    """Repeated SIGKILLs at random times of a trainer snapshotting every step."""
    rows, rng, last = 2048, random.Random(1234), -1  # ~6 MB per step
    for _ in range(4):
        flags = ["--job", "random", "--rows", str(rows), "--steps", "100000"]
        proc = _trainer(daemon, *flags, *(["--resume"] if last >= 0 else []))
        events = _events(proc)
        first = next(events)
        if last >= 0:
            assert first["event"] == "restored" and first["matches"] and first["step"] >= last
        seen = 0
        for event in events:  # let a random number of snapshots commit, then kill mid-flight
            seen += event["event"] == "snapshot"
            if seen >= rng.randint(2, 8):
                break
        subprocess.run(["sleep", str(rng.uniform(0, 0.05))])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        step = _check_restorable(daemon, "random", rows)
        assert step >= last
        last = step
    assert last > 0
