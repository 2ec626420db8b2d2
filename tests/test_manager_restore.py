"""A restore from the daemons' memory gives exactly what Orbax gives reading the same step
from disk: for every form of restore arguments memory answers (none, StandardRestore
with abstract or concrete targets, numpy targets, another mesh; PyTreeRestore with and
without restore_args, shardings, meshes, dtypes, restore types), the same tree, leaf
types, dtypes, shapes, shardings and bytes, side by side with plain Orbax; and memory did
answer each of them. Arguments memory does not answer (partial restores, placeholders)
come back as Orbax gives them."""

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.serialization import type_handlers

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions


class Phase(enum.IntEnum):
    TRAIN = 1


def mesh(devices=None) -> Mesh:
    return Mesh(np.array(devices or jax.devices()), ("x",))


def tree(pytree: bool) -> dict:
    sharded = NamedSharding(mesh(), P("x"))
    params = {"dense": {"kernel": jax.device_put(jnp.arange(32.0).reshape(8, 4), sharded),
                        "bias": jnp.zeros(4)}}
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params,
                                          tx=optax.adam(1e-3))
    out = {"state": state, "count": 7, "lr": 0.125, "flag": True, "none": None, "empty": {},
           "seq": [jnp.ones(2, jnp.bfloat16), 3], "np": np.arange(6, dtype=np.int16),
           "npscalar": np.float32(2.5), "key": jax.random.key(5), "phase": Phase.TRAIN}
    if pytree:
        out["name"] = "run-7"
    return out


def describe(restored) -> list:
    """Every leaf: its path, type, dtype, shape, sharding and bytes."""
    found = [("structure", str(jax.tree.structure(restored)))]
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                                 jax.dtypes.prng_key):
            found.append(("key", str(jax.random.key_impl(leaf))))
            leaf = jax.random.key_data(leaf)
        sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
        found.append((jax.tree_util.keystr(path), type(leaf).__name__,
                      str(getattr(leaf, "dtype", "")), getattr(leaf, "shape", None),
                      sharding, np.asarray(leaf).tobytes() if hasattr(leaf, "dtype")
                      else leaf))
    return found


def abstract(value, sharding=None):
    """A Standard restore target of ``value``: its jax arrays as ShapeDtypeStructs, its
    numpy scalars as arrays (Orbax's Standard handler refuses scalars as targets)."""
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)
        return np.asarray(x) if isinstance(x, np.generic) else x
    return jax.tree.map(leaf, value)


def argument_forms(saved: dict, pytree: bool) -> dict:
    other = NamedSharding(mesh(jax.devices()[:2]), P())  # another mesh: two devices
    forms = {"none": None}
    if not pytree:
        forms.update({
            "standard abstract": ocp.args.StandardRestore(abstract(saved)),
            "standard concrete": ocp.args.StandardRestore(saved),  # Orbax refuses its scalar
            "standard another mesh": ocp.args.StandardRestore(abstract(saved, other)),
            "standard numpy": ocp.args.StandardRestore(jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, (jax.Array, np.generic)) and not
                jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, saved)),
            "standard no target": ocp.args.StandardRestore(),
        })
    else:
        shardings = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None,
                                 saved)
        restore_args = ocp.checkpoint_utils.construct_restore_args(jax.tree.map(
            lambda x: np.asarray(x) if isinstance(x, np.generic) else x, saved), shardings)

        def changed(change):
            """restore_args with each jax.Array's (not a PRNG key's) changed."""
            return jax.tree.map(lambda x, a: change(a) if isinstance(x, jax.Array) and not
                                jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else a,
                                saved, restore_args)
        forms.update({
            "pytree no args": ocp.args.PyTreeRestore(),
            "pytree target": ocp.args.PyTreeRestore(saved),
            "pytree restore_args": ocp.args.PyTreeRestore(saved, restore_args=restore_args),
            "pytree mesh and axes": ocp.args.PyTreeRestore(saved, restore_args=changed(
                lambda a: type_handlers.ArrayRestoreArgs(mesh=mesh(), mesh_axes=P()))),
            "pytree dtype": ocp.args.PyTreeRestore(saved, restore_args=changed(
                lambda a: dataclasses.replace(a, dtype=jnp.float16))),
            "pytree numpy": ocp.args.PyTreeRestore(saved, restore_args=changed(
                lambda a: type_handlers.RestoreArgs(restore_type=np.ndarray))),
        })
    return forms


def outcome(restore, *args, **kwargs) -> tuple:
    """What ``restore(*args, **kwargs)`` gave: ("restored", every leaf described), or
    the exception's type and text (memory must refuse what Orbax refuses, as Orbax does)."""
    try:
        restored = restore(*args, **kwargs)
    except Exception as err:  # the exception is what is compared
        return ("raised", type(err).__name__, str(err))
    return ("restored", describe(restored))


def differences(got: tuple, expected: tuple) -> list:
    """The leaves described differently (the assertion's message)."""
    if got[0] != "restored" or expected[0] != "restored":
        return [got, expected]
    return [(a, b) for a, b in zip(got[1], expected[1], strict=False) if a != b]


def restored_something(found: tuple) -> bool:
    return found[0] == "restored" and len(found[1]) > 1


@pytest.mark.parametrize("pytree", [False, True], ids=["StandardSave", "PyTreeSave"])
def test_memory_gives_what_orbax_reads_from_disk(start_daemon, tmp_path, pytree):
    daemon = start_daemon("--durable-dir", str(tmp_path), metrics="127.0.0.1:0")
    saved = tree(pytree)
    save = ocp.args.PyTreeSave if pytree else ocp.args.StandardSave
    options = CheckpointManagerOptions(client=ClientOptions(daemon=daemon.address))
    with CheckpointManager(tmp_path / "run", options=options) as mine:
        mine.save(0, args=save(saved))
        mine.wait_until_finished()
    answered = []
    for name, args in argument_forms(saved, pytree).items():
        with ocp.CheckpointManager(tmp_path / "run") as theirs:
            expected = outcome(theirs.restore, 0, args=args)
        served = daemon.restores_served().get("memory", 0)
        with CheckpointManager(tmp_path / "run", options=options) as mine:
            got = outcome(mine.restore, 0, args=args)
        assert got == expected, (name, differences(got, expected))
        if restored_something(expected):
            assert daemon.restores_served().get("memory", 0) > served, f"{name}: not from memory"
            answered.append(name)
    assert len(answered) >= 4, answered  # the forms are restores, not only refusals


def test_arguments_memory_does_not_answer_come_back_as_orbax_gives_them(start_daemon,
                                                                         tmp_path):
    daemon = start_daemon("--durable-dir", str(tmp_path), metrics="127.0.0.1:0")
    saved = {"a": jnp.arange(4.0), "b": {"c": jnp.ones(3), "d": 5}}
    options = CheckpointManagerOptions(client=ClientOptions(daemon=daemon.address))
    with CheckpointManager(tmp_path / "run", options=options) as mine:
        mine.save(0, args=ocp.args.PyTreeSave(saved))
        mine.wait_until_finished()
    forms = {"partial": ocp.args.PyTreeRestore({"a": jnp.zeros(4)}, partial_restore=True),
             "placeholder": ocp.args.PyTreeRestore(
                 {"a": type_handlers.PLACEHOLDER, "b": {"c": jnp.zeros(3), "d": 0}})}
    for name, args in forms.items():
        with ocp.CheckpointManager(tmp_path / "run") as theirs:
            expected = outcome(theirs.restore, 0, args=args)
        assert restored_something(expected), (name, expected)
        with CheckpointManager(tmp_path / "run", options=options) as mine:
            assert outcome(mine.restore, 0, args=args) == expected, name
