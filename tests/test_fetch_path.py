"""The device-to-host path (clients/jax/fetch_path.py): Orbax's transfer module where it
picks exactly JAX's replica-0 shards, else JAX's public API, taking the same shards and
bytes; chosen once and logged; a save and restore through the daemon on either path."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from bubblesnap.clients.jax import fetch_path as fp

PUBLIC = fp.FetchPath("jax", "asked by the test")
SPECS = [PartitionSpec(), PartitionSpec("a"), PartitionSpec("b"), PartitionSpec("a", "b"),
         PartitionSpec(None, "a")]


def arrays():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    return [jax.device_put(value, NamedSharding(mesh, spec)) for spec in SPECS]


def key(shard) -> tuple:
    return shard.device, tuple((i.start, i.stop) for i in shard.index)


def test_this_orbax_is_used_and_picks_what_jax_names_replica_zero():
    chosen = fp.fetch_path()
    assert chosen.name == "orbax", chosen.why
    for array in arrays():
        orbax = fp.replica_shards(array, chosen)
        public = fp.replica_shards(array, PUBLIC)
        assert [key(s) for s in orbax] == [key(s) for s in public], array.sharding
        # each distinct region once: replicated regions are copied by one device only
        assert len({key(s)[1] for s in public}) == len(public)


def test_both_paths_transfer_the_same_bytes():
    values = arrays()
    through_orbax = fp.transfer(values, fp.fetch_path())
    through_jax = fp.transfer(values, PUBLIC)
    for array, ours, theirs in zip(values, through_jax, through_orbax, strict=True):
        assert len(ours) == len(theirs) == len(fp.replica_shards(array, PUBLIC))
        for shard, mine, other in zip(fp.replica_shards(array, PUBLIC), ours, theirs,
                                      strict=True):
            np.testing.assert_array_equal(mine, np.asarray(array)[shard.index])
            np.testing.assert_array_equal(mine, other)


@pytest.mark.parametrize("forced", [None, "jax"])
def test_a_manager_saves_and_restores_through_the_daemon_on_either_path(daemon, tmp_path,
                                                                         forced):
    """A process whose fetch path is forced to the public API (or left to choose)
    saves a sharded state through the daemon and restores it bit for bit; its log says
    which path, once."""
    env = {**os.environ, "BUBBLESNAP_DAEMON": daemon.address,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.pop(fp.ENV, None)
    if forced:
        env[fp.ENV] = forced
    program = f"""
import logging, sys
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec
from bubblesnap.clients.jax import CheckpointManager
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
state = {{"w": jax.device_put(np.arange(48, dtype=np.float32).reshape(8, 6),
                              NamedSharding(mesh, PartitionSpec("a")))}}
with CheckpointManager({str(tmp_path / "run")!r}) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    back = mngr.restore(0, args=ocp.args.StandardRestore(state))
    print("same", bool(np.array_equal(back["w"], state["w"])))
"""
    run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stdout.splitlines() if "device-to-host fetch" in line]
    assert len(said) == 1, run.stdout[-3000:]
    assert ("JAX's public API" if forced else "Orbax's replica_slices") in said[0]
    assert "same True" in run.stdout
