"""A step bubblesnap's manager saves is the step Orbax's manager saves for the same tree
(with typed PRNG keys): the same files in the step and item folders (nothing of
bubblesnap's), the daemon's ``_METADATA`` equal to Orbax's leaf for leaf (keys, key types,
value types), and a restore with no target gives the same tree of the same types, from
our manager (its memory) and from plain Orbax reading the daemon's step."""

import enum
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions


class Phase(enum.IntEnum):
    TRAIN = 1


def rich_tree(pytree: bool) -> dict:
    params = {"dense": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.zeros(4)}}
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params,
                                          tx=optax.adam(1e-3))
    tree = {"state": state, "count": 7, "lr": 0.125, "flag": True, "none": None, "empty": {},
            "nothing": [], "seq": [jnp.ones(2, jnp.bfloat16), 3], "pair": (1.5, np.arange(3)),
            "np": np.arange(6, dtype=np.int16).reshape(2, 3), "npscalar": np.float32(2.5),
            "key": jax.random.key(5), "keys": jax.random.split(jax.random.key(1), 3)}
    tree["phase"] = Phase.TRAIN  # an int subclass: saved and given back as an int
    if pytree:
        tree["name"] = "run-7"  # strings: Orbax's PyTree handler only
        tree["label"] = np.str_("np-string")
    return tree


def describe(tree) -> list:
    """Every leaf's path, type and value, in a form two runs can be compared by."""
    found = []
    def empty(x):
        return (x is None or (isinstance(x, (dict, list, tuple)) and not x))
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=empty)[0]:
        if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)  # a typed PRNG key, by its key data
            found.append(("key", jax.tree_util.keystr(path)))
        value = np.asarray(leaf).tolist() if hasattr(leaf, "dtype") else leaf
        found.append((jax.tree_util.keystr(path), type(leaf).__name__,
                      str(getattr(leaf, "dtype", "")), value))
    return found


def tree_metadata(path) -> tuple:
    with open(os.path.join(path, "_METADATA")) as f:
        found = json.load(f)
    return found["tree_metadata"], found["custom_metadata"]


@pytest.mark.parametrize("pytree", [False, True])
def test_the_persisted_step_is_orbax_s_for_the_same_tree(start_daemon, tmp_path, pytree):
    save = ocp.args.PyTreeSave if pytree else ocp.args.StandardSave
    tree = rich_tree(pytree)
    with ocp.CheckpointManager(tmp_path / "orbax") as theirs:
        theirs.save(0, args=save(tree, custom_metadata={"model": "mlp"}))
        theirs.wait_until_finished()
        expected = describe(theirs.restore(0))

    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable))
    with CheckpointManager(durable / "job", options=CheckpointManagerOptions(
            client=ClientOptions(daemon=daemon.address))) as mine:
        mine.save(0, args=save(tree, custom_metadata={"model": "mlp"}))
        mine.wait_until_finished()
        assert describe(mine.restore(0)) == expected  # from memory
    for folder in ("", "0", "0/default"):
        assert sorted(os.listdir(durable / "job" / folder)) == \
            sorted(os.listdir(tmp_path / "orbax" / folder)), folder
    assert tree_metadata(durable / "job" / "0" / "default") == \
        tree_metadata(tmp_path / "orbax" / "0" / "default")
    with ocp.CheckpointManager(durable / "job") as plain:
        assert describe(plain.restore(0)) == expected
