"""The emergency manager's local tier (the daemons' memory) as Orbax's emergency tests
define it: the steps its LocalCheckpointOptions save and keep are listed beside the
persistent ones, by a new manager too, and restored from memory when no folder holds
them. One process, a mesh of two replicas (Orbax's "two slices"), a real daemon."""

import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.checkpoint_managers import preservation_policy

from bubblesnap.clients.jax import emergency


@pytest.fixture
def setup(start_daemon, tmp_path, monkeypatch):
    # the daemon keeps as many steps of a job as the local policies below keep
    daemon = start_daemon("--durable-dir", str(tmp_path), "--keep", "10")
    monkeypatch.setenv("BUBBLESNAP_DAEMON", daemon.address)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("replica", "data"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = {"w": jax.device_put(np.arange(16, dtype=np.float32), sharding),
             "b": jax.device_put(np.full(4, 3, np.int32), sharding)}
    return tmp_path, mesh, state


def manager(folder, mesh, state, local, persistent):
    persistent_dir = folder / "persistent"
    persistent_dir.mkdir(exist_ok=True)
    return emergency.CheckpointManager(
        folder / "local", persistent_dir, mesh,
        jax.tree.map(ocp.utils.to_shape_dtype_struct, state),
        options=emergency.CheckpointManagerOptions(
            local=emergency.LocalCheckpointOptions(**local),
            persistent=emergency.PersistentCheckpointOptions(**persistent)))


def save(mngr, step: int, state) -> bool:
    return mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))


def same(restored, state) -> bool:
    return all(np.asarray(restored[k]).tobytes() == np.asarray(state[k]).tobytes()
               for k in state)


@pytest.mark.parametrize("local, persistent, steps, listed", [
    ({"save_interval_steps": 1, "max_to_keep": 2},
     {"save_interval_steps": 2, "max_to_keep": 4}, 10, [2, 4, 6, 8, 9]),
    ({"save_interval_steps": 1, "max_to_keep": 2},
     {"save_interval_steps": 10, "max_to_keep": 4}, 10, [0, 8, 9]),
    ({"save_interval_steps": 3, "max_to_keep": 2},
     {"save_interval_steps": 5, "max_to_keep": 3}, 17, [5, 10, 12, 15]),
    ({"should_save_fn": lambda step, _: step in (1, 5, 7, 8), "max_to_keep": 10},
     {"save_interval_steps": 4, "max_to_keep": 10}, 10, [0, 1, 4, 5, 7, 8]),
    ({"save_interval_steps": 1, "preservation_policy": preservation_policy.LatestN(2)},
     {"save_interval_steps": 4, "max_to_keep": 10}, 10, [0, 4, 8, 9]),
])
def test_the_local_options_name_the_steps_listed(setup, local, persistent, steps, listed):
    folder, mesh, state = setup
    mngr = manager(folder, mesh, state, local, persistent)
    for step in range(steps):
        save(mngr, step, state)
        mngr.wait_until_finished()
    assert mngr.all_steps() == listed and mngr.latest_step() == listed[-1]
    again = manager(folder, mesh, state, local, persistent)
    assert again.all_steps() == listed and again.latest_step() == listed[-1]
    assert same(again.restore(listed[-1]).state, state)
    mngr.close()
    again.close()


def test_a_local_step_whose_folder_is_gone_comes_from_memory(setup):
    folder, mesh, state = setup
    double = jax.tree.map(lambda x: x * 2, state)
    mngr = manager(folder, mesh, state, {"save_interval_steps": 1, "max_to_keep": 2},
                   {"save_interval_steps": 1, "max_to_keep": 2})
    for step, tree in enumerate([state, state, double]):
        save(mngr, step, tree)
    mngr.wait_until_finished()
    for child in (folder / "persistent").iterdir():  # the persistent tier lost
        if child.name.isdigit():
            shutil.rmtree(child)
    assert same(mngr.restore(2).state, double)
    assert not mngr.should_save(2) and mngr.should_save(3)
    mngr.close()


def test_a_daemon_keeping_fewer_steps_than_the_policy_is_said(start_daemon, tmp_path,
                                                             monkeypatch, caplog):
    monkeypatch.setenv("BUBBLESNAP_DAEMON", start_daemon("--durable-dir", str(tmp_path)).address)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("replica", "data"))
    state = {"w": jax.device_put(np.arange(8, dtype=np.float32),
                                 jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))}
    mngr = manager(tmp_path, mesh, state, {"save_interval_steps": 1, "max_to_keep": 4},
                   {"save_interval_steps": 100})
    for step in range(5):  # the daemon keeps 2 steps of a job (its default --keep)
        save(mngr, step, state)
        mngr.wait_until_finished()
    with caplog.at_level("WARNING", logger="bubblesnap.client"):
        assert mngr.all_steps() == [0, 3, 4]  # 0 on disk; 1 and 2 gone from memory
    assert "raise the daemons' --keep" in caplog.text
    mngr.close()


def test_process_metadata_is_refused_as_orbax_refuses_it(setup):
    folder, mesh, state = setup
    mngr = manager(folder, mesh, state, {"save_interval_steps": 1},
                   {"save_interval_steps": 5})
    with pytest.raises(ValueError, match="reserved"):
        mngr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                             process_metadata=ocp.args.JsonSave({})))
    with pytest.raises(ValueError, match="Composite"):
        mngr.save(0, args=ocp.args.PyTreeSave(state))
    mngr.close()
