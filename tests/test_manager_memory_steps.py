"""Steps held in the daemons' memory only (``memory_interval_steps``): listed by the
manager between the steps its policy writes, never in Orbax's view of the folder,
restored bit for bit from memory; and still listed and restored after the daemon was
SIGKILLed and restarted (it adopts what it held), while the manager's session backs off
from the save that met no daemon."""

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.testing import DaemonProcess


def state(step: int) -> dict:
    return {"w": jnp.arange(32, dtype=jnp.float32) * (step + 1), "b": jnp.full(4, step)}


def same(restored, step: int) -> bool:
    expected = state(step)
    return all(np.asarray(restored[k]).tobytes() == np.asarray(expected[k]).tobytes()
               for k in expected)


def test_steps_held_in_memory_only_survive_a_daemon_restart(tmp_path, shm_dirs):
    socket, shm = f"unix://{tmp_path}/daemon.sock", shm_dirs()
    tier, directory = tmp_path / "tier", tmp_path / "tier" / "run"
    flags = ("--durable-dir", str(tier), "--listen", socket, "--keep", "4", "--shm-dir", shm)
    manager = CheckpointManager(directory, options=CheckpointManagerOptions(
        save_interval_steps=100, memory_interval_steps=1, client=ClientOptions(daemon=socket)))
    with DaemonProcess(*flags, own_shm_dir=False) as daemon:
        for step in range(3):
            assert manager.save(step, args=ocp.args.StandardSave(state(step)))
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 1, 2] and manager.latest_step() == 2
        assert ocp.CheckpointManager(directory).all_steps() == [0]  # Orbax's view: disk only
        assert same(manager.restore(2, args=ocp.args.StandardRestore(state(0))), 2)
        daemon.kill()
    # no daemon: the copy handed over is lost, and the manager's session backs off
    manager.save(3, args=ocp.args.StandardSave(state(3)))
    manager.wait_until_finished()
    with DaemonProcess(*flags, own_shm_dir=False):  # adopts what its predecessor held
        assert manager.all_steps() == [0, 1, 2]
        assert same(manager.restore(1, args=ocp.args.StandardRestore(state(0))), 1)
    manager.close()
