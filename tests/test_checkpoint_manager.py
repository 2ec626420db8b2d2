"""bubblesnap's CheckpointManager runs a loop written for Orbax's unchanged apart from the
import (tests/programs/orbax_loop.py): save every step, SIGKILL, restore the latest, go on,
in one process and in two under jax.distributed; the final state equals, bit for bit,
that of the same loop with Orbax's manager run without a kill."""

import os

import pytest

from bubblesnap.multihost import JaxJob
from bubblesnap.testing import DaemonProcess

LOOP = os.path.join(os.path.dirname(__file__), "programs", "orbax_loop.py") + ":train"
STEPS, KILL_AT = 8, 4


def run(processes: int, args: dict, env: dict | None = None) -> list[dict]:
    return JaxJob(LOOP, processes, {"steps": STEPS, **args}, env=env, timeout=240).results()


def run_killed(processes: int, args: dict, env: dict | None = None) -> None:
    job = JaxJob(LOOP, processes, {"steps": STEPS, "kill_at": KILL_AT, **args}, env=env,
                 timeout=240)
    assert job.wait_crash() == [-9] * processes


@pytest.mark.parametrize("processes", [1, 2])
def test_an_orbax_loop_runs_unchanged_with_the_import_swapped(processes, tmp_path):
    reference = run(processes, {"manager": "orbax", "directory": str(tmp_path / "reference")})
    assert all(r["resumed_from"] is None and r["step"] == STEPS for r in reference)

    # The same kill and resume with Orbax itself: the loop's own behaviour.
    orbax_dir = str(tmp_path / "orbax")
    run_killed(processes, {"manager": "orbax", "directory": orbax_dir})
    resumed = run(processes, {"manager": "orbax", "directory": orbax_dir})
    assert [r["resumed_from"] for r in resumed] == [KILL_AT] * processes
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]

    durable = tmp_path / "durable"
    daemon = DaemonProcess("--durable-dir", str(durable), "--durable-every-steps", "2")
    try:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        args = {"manager": "bubblesnap", "directory": str(durable / "run1")}
        run_killed(processes, args, env)
        resumed = run(processes, args, env)
        assert [r["resumed_from"] for r in resumed] == [KILL_AT] * processes
        assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]
        # the directory the manager was given is the durable tier: steps as Orbax's
        # CheckpointManager lays them out, which it lists
        import orbax.checkpoint as ocp
        assert ocp.CheckpointManager(durable / "run1").all_steps()
    finally:
        daemon.stop()


def test_a_directory_the_daemon_does_not_write_to_is_warned_of(start_daemon, tmp_path, caplog):
    from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable), "--durable-every-steps", "1")
    options = CheckpointManagerOptions(client=ClientOptions(daemon=daemon.address))
    with caplog.at_level("WARNING", logger="bubblesnap.client"):
        CheckpointManager(durable / "run1", options=options).close()
        assert not caplog.records  # the daemon's own --durable-dir: as it should be
        CheckpointManager(tmp_path / "elsewhere" / "run1", options=options).close()
    assert "not to" in caplog.text and str(durable) in caplog.text
    with pytest.raises(ValueError, match="save_interval_steps"):
        CheckpointManagerOptions(save_interval_steps=0)
