"""A job that saves its data iterator through the iterator's own handler every step, beside
its state (tests/programs/iterator_loop.py), SIGKILLed and resumed, gets the iterator's
position back with the state: from the daemon's memory, and after the daemon's memory is
lost (from disk); and from a step held in memory only. Its final state is, bit for bit,
that of the same loop run by Orbax without a kill."""

import os
import shutil

import orbax.checkpoint as ocp

from bubblesnap.testing import DaemonProcess
from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT

LOOP = str(ROOT / "tests" / "programs" / "iterator_loop.py") + ":train"
STEPS, KILL_AT = 8, 4


def run(args: dict, env: dict | None = None) -> dict:
    [result] = JaxJob(LOOP, 1, {"steps": STEPS, **args}, env=env, timeout=240).results()
    return result


def killed(args: dict, env: dict) -> None:
    job = JaxJob(LOOP, 1, {"steps": STEPS, "kill_at": KILL_AT, **args}, env=env, timeout=240)
    assert job.wait_crash() == [-9]


def test_the_iterator_comes_back_from_memory_and_after_memory_is_lost(tmp_path, shm_dirs):
    reference = run({"manager": "orbax", "directory": str(tmp_path / "reference")})
    assert reference["resumed_from"] is None and reference["position"] == STEPS
    expected = {**reference, "resumed_from": KILL_AT, "iterator_from": "step folder"}

    durable, shm = tmp_path / "durable", shm_dirs()
    flags = ("--durable-dir", str(durable), "--shm-dir", shm)
    ours = {"manager": "bubblesnap", "directory": str(durable / "memory")}
    lost = {"manager": "bubblesnap", "directory": str(durable / "lost")}
    with DaemonProcess(*flags, metrics="127.0.0.1:0") as daemon:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        killed(ours, env)
        assert run(ours, env) == expected
        assert set(daemon.restores_served()) == {"memory"}
        killed(lost, env)
        daemon.kill()
    shutil.rmtree(shm)  # the host's memory is gone, as after a reboot
    os.makedirs(shm)
    with DaemonProcess(*flags, metrics="127.0.0.1:0") as fresh:
        assert run(lost, {"BUBBLESNAP_DAEMON": fresh.address}) == expected
        assert fresh.restores_served() == {}  # read from disk


def test_a_step_held_in_memory_only_brings_its_iterator_back(tmp_path):
    reference = run({"manager": "orbax", "directory": str(tmp_path / "reference")})
    durable = tmp_path / "durable"
    args = {"manager": "bubblesnap", "directory": str(durable / "run"), "every": 3,
            "memory": True}
    with DaemonProcess("--durable-dir", str(durable), "--keep", "4") as daemon:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        killed(args, env)  # step 4: not one the policy saves (every third)
        assert ocp.CheckpointManager(durable / "run").all_steps() == [0, 3]
        resumed = run(args, env)
    assert resumed == {**reference, "resumed_from": KILL_AT, "iterator_from": "memory step"}
    assert ocp.CheckpointManager(durable / "run").all_steps() == [0, 3, 6]
