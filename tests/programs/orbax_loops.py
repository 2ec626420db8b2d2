"""Training loops written the way public JAX projects write them for Orbax's
``CheckpointManager``, each run as it is with Orbax's manager or with bubblesnap's.

``args["manager"]`` picks the one line a user changes: ``orbax`` (Orbax's),
``bubblesnap`` (the import swapped), or ``patched`` (the code unchanged,
``orbax.checkpoint.CheckpointManager`` itself, in a process started with
bubblesnap's switch: ``BUBBLESNAP_ORBAX=1`` and its bootstrap on PYTHONPATH).

A target for ``bubblesnap.testing.multihost.JaxJob`` (one process or several under
``jax.distributed``, one global mesh whose devices are ordered so a
process's devices are not contiguous). Every loop in ``args["loops"]`` runs
in turn in its own folder of ``args["root"]`` (named
``args["prefix"]`` and the loop's name): it resumes from its latest
step if there is one and trains, saving as its project does, until
``args["steps"]``; with ``args["kill"]`` it stops after ``args["kill_at"]``
(its last save finished) and, once every loop did, the process crashes
(``bubblesnap.testing.multihost.crash``: the parent SIGKILLs every process once each
got there). Each loop reports the step it resumed from, a digest of its final
global state (the same in any process count), ``all_steps()`` and the
metadata it read back.
"""

import hashlib
import importlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.testing.multihost import crash


def _managers(name: str):
    if name == "orbax":
        from orbax.checkpoint import CheckpointManager, CheckpointManagerOptions
    elif name == "bubblesnap":
        from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions
    else:  # unchanged code, in a patched process
        CheckpointManager, CheckpointManagerOptions = (ocp.CheckpointManager,
                                                       ocp.CheckpointManagerOptions)
        assert CheckpointManager.__module__.startswith("bubblesnap"), "the switch is off"
    return CheckpointManager, CheckpointManagerOptions


def chosen_module(name: str, ours: str, orbax: str, cls: str):
    """The module a loop takes ``cls`` from: Orbax's ``orbax`` (for ``orbax``), bubblesnap's
    ``ours`` (``bubblesnap``: the import swapped) or Orbax's in a process started with
    bubblesnap's switch (``patched``: checked to hold bubblesnap's class)."""
    module = importlib.import_module(ours if name == "bubblesnap" else orbax)
    if name == "patched":
        assert getattr(module, cls).__module__.startswith("bubblesnap"), "the switch is off"
    return module


def _mesh() -> Mesh:
    devices = np.array(jax.devices())
    devices = np.concatenate([devices[0::2], devices[1::2]])  # processes interleaved
    return Mesh(devices, ("data",))


def _shard(tree, mesh: Mesh):
    """Arrays whose first axis splits over the mesh are sharded on it, the rest replicated."""
    def put(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        split = leaf.ndim and leaf.shape[0] % mesh.size == 0
        return jax.device_put(leaf, NamedSharding(mesh, P("data") if split else P()))
    return jax.tree.map(put, tree)


def digest(tree) -> str:
    """SHA-256 of every leaf's global value (gathered from every process)."""
    found = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                                 jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)  # a typed PRNG key, by its key data
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        value = np.asarray(leaf)
        found.update(f"{jax.tree_util.keystr(path)}:{value.dtype}:{value.shape}".encode())
        found.update(value.tobytes())
    return found.hexdigest()


def _batch(step: int) -> jax.Array:
    return jnp.sin(jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * (step + 1))


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


def _loss(params, apply_fn, x):
    return jnp.mean((apply_fn({"params": params}, x) - x) ** 2)


def _fresh_train_state(mesh: Mesh) -> train_state.TrainState:
    model = _Mlp()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(1e-2))
    return _shard(state, mesh)


@jax.jit
def _train_state_step(state, x):
    grads = jax.grad(_loss)(state.params, state.apply_fn, x)
    return state.apply_gradients(grads=grads)


def flax_train_state(Manager, Options, directory: str, args: dict, pytree: bool = False):
    """Flax's TrainState (a Python int ``step``), saved with StandardSave and restored
    into ``jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh_state)``: Flax's guide;
    ``pytree``: the same with PyTreeSave / PyTreeRestore, as older examples do."""
    mesh = _mesh()
    state = _fresh_train_state(mesh)
    save = ocp.args.PyTreeSave if pytree else ocp.args.StandardSave
    restore = ocp.args.PyTreeRestore if pytree else ocp.args.StandardRestore
    with Manager(directory, options=Options(max_to_keep=2, save_interval_steps=1)) as mngr:
        latest = mngr.latest_step()
        if latest is not None:
            target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            state = mngr.restore(latest, args=restore(target))
        for step in range(0 if latest is None else latest + 1, _stop(args)):
            state = _train_state_step(state, _batch(step))
            mngr.save(step, args=save(state))
        mngr.wait_until_finished()
        return {"resumed_from": latest, "digest": digest(state), "step": int(state.step),
                "all_steps": list(mngr.all_steps())}


def flax_pytree(Manager, Options, directory: str, args: dict):
    return flax_train_state(Manager, Options, directory, args, pytree=True)


def composite_json(Manager, Options, directory: str, args: dict):
    """``item_names=("state", "meta")``: the state and a JSON item (the data position),
    ``Composite`` args, custom metadata per step."""
    mesh = _mesh()
    state = _fresh_train_state(mesh)
    meta = {"next_batch": 0, "lr": 1e-2, "note": "run-1"}
    with Manager(directory, item_names=("state", "meta"),
                 options=Options(max_to_keep=3)) as mngr:
        latest = mngr.latest_step()
        if latest is not None:
            restored = mngr.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                            state)),
                meta=ocp.args.JsonRestore()))
            state, meta = restored.state, restored.meta
        for step in range(meta["next_batch"], _stop(args)):
            state = _train_state_step(state, _batch(step))
            meta = {**meta, "next_batch": step + 1}
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)),
                      custom_metadata={"epoch": step // 3})
        mngr.wait_until_finished()
        last = mngr.latest_step()
        return {"resumed_from": latest, "digest": digest(state), "meta": meta,
                "all_steps": list(mngr.all_steps()),
                "custom_metadata": mngr.metadata(last).custom_metadata}


class Checkpointer:
    """A framework's own manager class (the shape of MaxText's and others'): it builds
    Orbax's manager itself, with item handlers and a save decision policy, saves
    with save_args and custom metadata, and restores with restore_args."""

    def __init__(self, Manager, Options, directory: str, every: int):
        self.manager = Manager(
            directory,
            item_handlers={"items": ocp.PyTreeCheckpointHandler(),
                           "metrics": ocp.JsonCheckpointHandler()},
            options=Options(save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
                every), max_to_keep=2, enable_async_checkpointing=True))

    def save(self, step: int, state, loss: float) -> bool:
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(), state)
        return self.manager.save(step, args=ocp.args.Composite(
            items=ocp.args.PyTreeSave(state, save_args=save_args),
            metrics=ocp.args.JsonSave({"loss": loss})), custom_metadata={"framework": "x"})

    def restore(self, step: int, abstract, shardings):
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract, shardings)
        return self.manager.restore(step, args=ocp.args.Composite(
            items=ocp.args.PyTreeRestore(abstract, restore_args=restore_args),
            metrics=ocp.args.JsonRestore()))


def framework_manager(Manager, Options, directory: str, args: dict):
    mesh = _mesh()
    state = {"params": _fresh_train_state(mesh).params, "step": 0,
             "rng": jax.random.key_data(jax.random.PRNGKey(3))}
    shardings = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None,
                             state)
    checkpointer = Checkpointer(Manager, Options, directory, every=2)
    latest = checkpointer.manager.latest_step()
    metrics = None
    if latest is not None:
        restored = checkpointer.restore(latest, state, shardings)
        state, metrics = restored["items"], restored["metrics"]
        item_metadata = checkpointer.manager.metadata(latest).item_metadata
        assert set(item_metadata.keys()) >= {"items", "metrics"}, item_metadata
    for step in range(0 if latest is None else latest + 1, _stop(args)):
        params = jax.tree.map(lambda p, step=step: p * 0.99 + 0.01 * jnp.cos(p * step),
                              state["params"])
        state = {**state, "params": params, "step": state["step"] + 1}
        checkpointer.save(step, state, float(step) / 10)
    checkpointer.manager.wait_until_finished()
    last = checkpointer.manager.latest_step()
    custom = checkpointer.manager.metadata(last).custom_metadata
    checkpointer.manager.close()
    return {"resumed_from": latest, "digest": digest(state), "metrics": metrics,
            "all_steps": list(checkpointer.manager.all_steps()), "custom_metadata": custom}


class _NnxNet(nnx.Module):
    """A layer and a dropout that keeps its own RNG stream (a typed PRNG key in the state)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def nnx_state(Manager, Options, directory: str, args: dict):
    """``nnx.state((model, optimizer))`` with StandardSave, restored into a fresh model's
    state and put back with ``nnx.update``."""
    def fresh():
        model = _NnxNet(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    model, optimizer = fresh()

    @nnx.jit
    def step_fn(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
        optimizer.update(model, grads)

    with Manager(directory, options=Options(max_to_keep=2)) as mngr:
        latest = mngr.latest_step()
        if latest is not None:
            target = nnx.state(fresh())
            nnx.update((model, optimizer), mngr.restore(
                latest, args=ocp.args.StandardRestore(target)))
        for step in range(0 if latest is None else latest + 1, _stop(args)):
            step_fn(model, optimizer, _batch(step))
            mngr.save(step, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
        mngr.wait_until_finished()
        return {"resumed_from": latest, "digest": digest(nnx.state((model, optimizer))),
                "all_steps": list(mngr.all_steps())}


def keep_three(Manager, Options, directory: str, args: dict):
    """``max_to_keep=3``, every step saved: which steps the manager keeps."""
    with Manager(directory, options=Options(max_to_keep=3)) as mngr:
        latest = mngr.latest_step()
        value = jnp.zeros((4,), jnp.float32)
        if latest is not None:
            value = mngr.restore(latest, args=ocp.args.StandardRestore({"v": value}))["v"]
        for step in range(0 if latest is None else latest + 1, _stop(args)):
            value = value + step
            mngr.save(step, args=ocp.args.StandardSave({"v": value}))
        mngr.wait_until_finished()
        return {"resumed_from": latest, "digest": digest({"v": value}),
                "all_steps": list(mngr.all_steps())}


LOOPS = {"flax_train_state": flax_train_state, "flax_pytree": flax_pytree,
         "composite_json": composite_json, "framework_manager": framework_manager,
         "nnx_state": nnx_state, "keep_three": keep_three}


def _stop(args: dict) -> int:
    return args["kill_at"] + 1 if args.get("kill") else args["steps"]


def train(args: dict) -> dict:
    Manager, Options = _managers(args["manager"])
    prefix = args.get("prefix", "")  # runs sharing a root keep apart
    results = {name: LOOPS[name](Manager, Options,
                                 os.path.join(args["root"], prefix + name), args)
               for name in args["loops"]}
    if args.get("kill"):
        crash()
    return results


def _sharded_state(step: int):
    """A state sharded over every process's devices, with a Python int and a JSON-able
    float, its value a function of ``step``."""
    mesh = _mesh()
    grid = jnp.arange(24 * 6, dtype=jnp.float32).reshape(24, 6)  # splits over 4 or 6
    return {"w": jax.device_put(grid * (step + 1), NamedSharding(mesh, P("data"))),
            "b": jax.device_put(jnp.ones((6,), jnp.bfloat16) * step, NamedSharding(mesh, P())),
            "step": step, "lr": 0.5 / (step + 1)}


def save_steps(args: dict) -> dict:
    """Saves steps 1.. ``args["steps"]`` of :func:`_sharded_state`; their digests."""
    from bubblesnap.clients.jax import CheckpointManager
    digests = {}
    with CheckpointManager(args["directory"]) as mngr:
        for step in range(1, args["steps"] + 1):
            state = _sharded_state(step)
            mngr.save(step, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()
            digests[step] = digest(state)
        mngr.check_for_errors()
    return {"digests": digests}


def resume_steps(args: dict) -> dict:
    """A new run (possibly another process count) resumes from the latest step; or, with
    nothing to restore, says what ``restore`` raises."""
    from bubblesnap.clients.jax import CheckpointManager
    with CheckpointManager(args["directory"]) as mngr:
        latest, steps = mngr.latest_step(), list(mngr.all_steps())
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _sharded_state(0))
        try:
            state = mngr.restore(latest, args=ocp.args.StandardRestore(abstract))
        except Exception as err:  # what a loop with nothing to resume from sees
            return {"latest": latest, "all_steps": steps, "raised": type(err).__name__}
        return {"latest": latest, "all_steps": steps, "digest": digest(state),
                "types": [type(state["step"]).__name__, type(state["lr"]).__name__]}
