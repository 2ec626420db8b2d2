"""bubblesnap's CheckpointManager runs a loop written for Orbax's unchanged apart from the
import (tests/programs/orbax_loop.py, the README's loop): save every step, SIGKILL, restore
the latest, go on, in two processes under jax.distributed (one process, and this loop's
kind among others: tests/test_orbax_loops.py); the final state equals, bit for bit, that
of the same loop with Orbax's manager run without a kill. Where the daemon cannot
write the steps (a directory outside its durable tier, no durable tier, no daemon) the
manager works all the same, Orbax writing them, and one warning says why and what to do."""

import logging
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.testing import DaemonProcess
from bubblesnap.testing.multihost import JaxJob

LOOP = os.path.join(os.path.dirname(__file__), "programs", "orbax_loop.py") + ":train"
STEPS, KILL_AT = 8, 4


def run(processes: int, args: dict, env: dict | None = None) -> list[dict]:
    return JaxJob(LOOP, processes, {"steps": STEPS, **args}, env=env, timeout=240).results()


def run_killed(processes: int, args: dict, env: dict | None = None) -> None:
    job = JaxJob(LOOP, processes, {"steps": STEPS, "kill_at": KILL_AT, **args}, env=env,
                 timeout=240)
    assert job.wait_crash() == [-9] * processes


def test_an_orbax_loop_runs_unchanged_with_the_import_swapped(tmp_path):
    processes = 2
    reference = run(processes, {"manager": "orbax", "directory": str(tmp_path / "reference")})
    assert all(r["resumed_from"] is None and r["step"] == STEPS for r in reference)

    # The same kill and resume with Orbax itself: the loop's own behaviour.
    orbax_dir = str(tmp_path / "orbax")
    run_killed(processes, {"manager": "orbax", "directory": orbax_dir})
    resumed = run(processes, {"manager": "orbax", "directory": orbax_dir})
    assert [r["resumed_from"] for r in resumed] == [KILL_AT] * processes
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]

    durable = tmp_path / "durable"
    with DaemonProcess("--durable-dir", str(durable)) as daemon:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        args = {"manager": "bubblesnap", "directory": str(durable / "runs" / "run1")}
        run_killed(processes, args, env)
        resumed = run(processes, args, env)
    assert [r["resumed_from"] for r in resumed] == [KILL_AT] * processes
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]
    # the steps the loop's policy keeps are in its directory, as Orbax writes them
    assert ocp.CheckpointManager(durable / "runs" / "run1").all_steps() == \
        ocp.CheckpointManager(orbax_dir).all_steps()


def saved_and_restored(directory, address: str) -> np.ndarray:
    options = CheckpointManagerOptions(client=ClientOptions(daemon=address))
    with CheckpointManager(directory, options=options) as manager:
        manager.save(3, args=ocp.args.StandardSave({"x": jnp.arange(4.0)}))
        manager.wait_until_finished()
        assert manager.all_steps() == [3]
        restored = manager.restore(3)["x"]
    assert ocp.CheckpointManager(directory).all_steps() == [3]  # on disk, written by Orbax
    return np.asarray(restored)


@pytest.mark.parametrize("where", ["outside", "no durable tier", "no daemon"])
def test_where_the_daemon_cannot_write_orbax_does_and_says_so(start_daemon, tmp_path, caplog,
                                                              where):
    flags = () if where == "no durable tier" else ("--durable-dir", str(tmp_path / "tier"))
    address = start_daemon(*flags).address if where != "no daemon" else \
        f"unix://{tmp_path}/nobody.sock"
    with caplog.at_level(logging.WARNING, logger="bubblesnap.client"):
        restored = saved_and_restored(tmp_path / "elsewhere" / "run", address)
    assert restored.tolist() == [0.0, 1.0, 2.0, 3.0]
    said = [r.getMessage() for r in caplog.records if r.name == "bubblesnap.client"]
    assert len([m for m in said if "Orbax writes the steps" in m or
                "Orbax writes its steps" in m]) == 1, said
    hint = {"outside": "--durable-dir at or above", "no durable tier": "no durable tier",
            "no daemon": "no daemon answers"}[where]
    assert hint in " ".join(said)


def test_a_directory_inside_the_durable_tier_is_written_by_the_daemon(start_daemon, tmp_path,
                                                                      caplog):
    daemon = start_daemon("--durable-dir", str(tmp_path), log_level="INFO",
                          stderr=tmp_path / "daemon.log")
    with caplog.at_level(logging.WARNING, logger="bubblesnap.client"):
        restored = saved_and_restored(tmp_path / "deep" / "er" / "run", daemon.address)
    assert restored.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not [r for r in caplog.records if r.name == "bubblesnap.client"]
    assert "durable: wrote step 3 of rank 0" in daemon.stderr_text()
