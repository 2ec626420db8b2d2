"""``python -m bubblesnap.run train.py`` runs a program that builds Orbax's manager itself,
unchanged, with bubblesnap's manager behind every name Orbax's is reached by
(``orbax.checkpoint.CheckpointManager``, ``orbax.checkpoint.checkpoint_manager``'s,
``checkpoint_managers``'); the processes it starts inherit the switch; one log line lists
what was replaced, and one says where code inside Orbax built Orbax's own manager. Without
the switch nothing changes."""

import json
import os
import subprocess
import sys

from bubblesnap.run import orbax_patch
from bubblesnap.testing import DaemonProcess
from tests.helpers import ROOT

SCRIPT = str(ROOT / "tests" / "programs" / "framework_train.py")


def run(*command: str, env: dict) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, *command], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    return done.returncode, done.stdout, done.stderr


def answer(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_bubblesnap_run_puts_its_manager_behind_orbax_in_an_unchanged_program(tmp_path):
    expected_code, out, _ = run(SCRIPT, str(tmp_path / "orbax" / "job"), "6", env={})
    assert expected_code == 0 and "manager: orbax.checkpoint" in out
    expected = answer(out)

    durable = tmp_path / "durable"
    with DaemonProcess("--durable-dir", str(durable)) as daemon:
        env = {"BUBBLESNAP_DAEMON": daemon.address}
        directory = str(durable / "job")
        code, out, err = run("-m", "bubblesnap.run", SCRIPT, directory, "6", "2", env=env)
        assert code == -9 and "manager: bubblesnap.clients.jax.manager.checkpoint_manager" in out
        patched = [line for line in err.splitlines() if "are now bubblesnap's" in line]
        assert len(patched) == 1 and "BUBBLESNAP_ORBAX" in patched[0]
        for name in orbax_patch.NAMES:
            assert f"{name}.CheckpointManager" in patched[0]
        code, out, _ = run("-m", "bubblesnap.run", "--daemon", daemon.address, SCRIPT,
                           directory, "6", env={})
        assert code == 0
        assert answer(out) == {**expected, "resumed_from": 2}


def test_the_switch_is_inherited_and_off_by_default(tmp_path):
    code, out, _ = run("-m", "bubblesnap.run", "--pythonpath", env={})
    assert code == 0 and out.strip() == orbax_patch.bootstrap_path()
    probe = "import orbax.checkpoint as ocp; print(ocp.CheckpointManager.__module__)"
    path = os.pathsep.join(filter(None, [orbax_patch.bootstrap_path(),
                                         os.environ.get("PYTHONPATH")]))
    code, out, _ = run("-c", probe, env={"PYTHONPATH": path})
    assert code == 0 and out.strip().startswith("orbax.")  # on the path, switch off
    code, out, _ = run("-c", probe, env={"PYTHONPATH": path, orbax_patch.ENV: "1"})
    assert code == 0 and out.strip() == "bubblesnap.clients.jax.manager.checkpoint_manager"
    # a process the program starts (a launcher's worker) is patched too
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {probe!r}])"
    script = tmp_path / "launcher.py"
    script.write_text(child)
    code, out, _ = run("-m", "bubblesnap.run", str(script), env={})
    assert code == 0 and out.strip() == "bubblesnap.clients.jax.manager.checkpoint_manager"


def test_every_name_of_orbax_s_manager_and_v1_checkpointer_is_replaced(tmp_path):
    """Orbax's manager names, Orbax v1's Checkpointer (imported after the switch) and its
    emergency manager are bubblesnap's, each said once; a manager built by code inside
    Orbax (here a module named as Orbax's) is Orbax's own, and the log says where."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys, tempfile\n"
        "from orbax.checkpoint.checkpoint_manager import CheckpointManager\n"
        "from orbax.checkpoint import checkpoint_managers\n"
        "from orbax.checkpoint.experimental.v1 import training\n"
        "print(CheckpointManager.__module__, checkpoint_managers.CheckpointManager.__module__)\n"
        "for _ in range(2):\n"
        "    built = training.Checkpointer(tempfile.mkdtemp(dir=sys.argv[1]))\n"
        "    print(type(built).__module__, type(built._manager).__module__)\n"
        "inside = {'__name__': 'orbax.checkpoint.some_builder', 'M': CheckpointManager,\n"
        "          'd': tempfile.mkdtemp(dir=sys.argv[1])}\n"
        "exec('built = M(d)', inside)\n"
        "print(type(inside['built']).__module__)\n"
        "from orbax.checkpoint.experimental.emergency import checkpoint_manager as em\n"
        "print(em.CheckpointManager.__module__)\n"
        "from bubblesnap.clients.jax import CheckpointManagerOptions\n"
        "print(CheckpointManagerOptions().memory_interval_steps)\n")
    code, out, err = run("-m", "bubblesnap.run", "--memory-interval-steps", "3", str(probe),
                         str(tmp_path), env={})
    assert code == 0, err
    ours = "bubblesnap.clients.jax.manager.checkpoint_manager"
    v1 = "bubblesnap.clients.jax.training"
    assert out.split() == [ours, ours, v1, ours, v1, ours,
                           "orbax.checkpoint.checkpoint_manager",
                           "bubblesnap.clients.jax.emergency", "3"]
    assert len([line for line in err.splitlines()
                if "emergency.checkpoint_manager.CheckpointManager is now" in line]) == 1
    assert len([line for line in err.splitlines()
                if "v1.training.Checkpointer is now bubblesnap's" in line]) == 1
    told = [line for line in err.splitlines() if "built Orbax's own CheckpointManager" in line]
    assert len(told) == 1 and "orbax.checkpoint.some_builder" in told[0]


def test_bubblesnap_run_explains_itself():
    code, out, _ = run("-m", "bubblesnap.run", "--help", env={})
    assert code == 0 and "orbax.checkpoint.CheckpointManager" in out and "PYTHONPATH" in out
    assert "--memory-interval-steps" in out and "--durable-dir" in out
    code, _, err = run("-m", "bubblesnap.run", "--memory-interval-steps", "often", "x.py",
                       env={})
    assert code == 2 and "whole number of steps" in err
    code, _, err = run("-m", "bubblesnap.run", env={})
    assert code == 2 and "give the program to run" in err


def test_a_module_takes_its_own_flags_and_the_bootstrap_may_be_on_the_path_twice(tmp_path):
    (tmp_path / "flagged.py").write_text(
        "import sys, orbax.checkpoint as ocp\n"
        "print(sys.argv[1:], ocp.CheckpointManager.__module__)\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                       os.environ.get("PYTHONPATH")]))}
    code, out, err = run("-m", "bubblesnap.run", "-m", "flagged", "--config", "x.yml", "-v",
                         env=env)
    assert code == 0, err
    assert out.strip() == ("['--config', 'x.yml', '-v'] "
                           "bubblesnap.clients.jax.manager.checkpoint_manager")
    link = tmp_path / "bootstrap-link"
    link.symlink_to(orbax_patch.bootstrap_path())
    twice = os.pathsep.join(filter(None, [orbax_patch.bootstrap_path(), str(link),
                                          os.environ.get("PYTHONPATH")]))
    code, out, err = run("-c", "import orbax.checkpoint as o; print(o.CheckpointManager."
                         "__module__)", env={"PYTHONPATH": twice, orbax_patch.ENV: "1"})
    assert code == 0 and "Error in sitecustomize" not in err
    assert out.strip() == "bubblesnap.clients.jax.manager.checkpoint_manager"


def test_the_bootstrap_folder_s_old_place_on_the_path_still_patches_and_says_it_moved():
    old = os.path.join(os.path.dirname(os.path.dirname(orbax_patch.bootstrap_path())),
                       "bootstrap")
    path = os.pathsep.join(filter(None, [old, os.environ.get("PYTHONPATH")]))
    code, out, err = run("-c", "import orbax.checkpoint as o; print(o.CheckpointManager."
                         "__module__)", env={"PYTHONPATH": path, orbax_patch.ENV: "1"})
    assert code == 0 and "Error in sitecustomize" not in err, err
    assert out.strip() == "bubblesnap.clients.jax.manager.checkpoint_manager"
    assert f"moved to {orbax_patch.bootstrap_path()}" in err


def test_a_daemon_started_with_the_switch_is_not_patched(tmp_path):
    path = os.pathsep.join(filter(None, [orbax_patch.bootstrap_path(),
                                         os.environ.get("PYTHONPATH")]))
    with DaemonProcess("--durable-dir", str(tmp_path / "d"),
                       env={orbax_patch.ENV: "1", "PYTHONPATH": path}, log_level="INFO",
                       stderr=tmp_path / "daemon.log") as daemon:
        assert daemon.healthy()
        assert "are now bubblesnap's" not in daemon.stderr_text()
