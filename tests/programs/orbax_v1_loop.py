"""A training loop written for Orbax v1's ``training.Checkpointer`` the way a current
public LLM trainer writes it (MaxText 0.2.5's checkpointing): a Flax ``TrainState`` as a
PyTree checkpointable and the data iterator as a checkpointable of its own (its own
save and load, one file per process, as Grain's iterators are saved), saved every
``args["every"]`` steps by a ``FixedIntervalPolicy``, the newest three kept
(``LatestN``), resumed from ``ckptr.latest`` with abstract targets.

``args["checkpointer"]`` picks the one line a user changes: ``orbax`` (Orbax v1's
``training`` module), ``bubblesnap`` (the import swapped) or ``patched`` (the code
unchanged, in a process started with bubblesnap's switch). A target for
``bubblesnap.testing.multihost.JaxJob``: one process or several under ``jax.distributed``, one
global mesh whose devices are interleaved over the processes. With ``args["kill"]`` it
stops after step ``args["kill_at"]`` (its save finished) and crashes
(``bubblesnap.testing.multihost.crash``). It reports the step it resumed from, how many
checkpointables came back from the daemons' memory, a digest of the final global state,
the iterator's position and the steps kept.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from bubblesnap.testing.multihost import crash
from tests.programs.orbax_loops import _batch, _mesh, _Mlp, _shard, chosen_module, digest


class DataIterator:
    """Batches by position; saved and loaded by itself (Orbax v1's StatefulCheckpointable),
    each process its own file."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        batch = _batch(self.position)
        self.position += 1
        return batch

    async def save(self, directory):
        position = self.position

        async def write():
            path = await directory.await_creation()
            (path / f"process_{jax.process_index()}.json").write_text(
                json.dumps({"position": position}))
        return write()

    async def load(self, directory):
        async def read():
            text = (directory / f"process_{jax.process_index()}.json").read_text()
            self.position = json.loads(text)["position"]
        return read()


@jax.jit
def _train_step(state, x):
    def loss(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def _fresh_state():
    model = _Mlp()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(1e-2))
    return _shard(state.replace(step=jnp.zeros((), jnp.int32)), _mesh())


def train(args: dict) -> dict:
    training = chosen_module(args["checkpointer"], "bubblesnap.clients.jax.training",
                             "orbax.checkpoint.experimental.v1.training", "Checkpointer")
    memory_loads = _count_memory_loads() if args["checkpointer"] != "orbax" else None
    state, iterator = _fresh_state(), DataIterator()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state)
    stop = args["kill_at"] + 1 if args.get("kill") else args["steps"]
    with training.Checkpointer(
            args["directory"],
            save_decision_policy=training.save_decision_policies.FixedIntervalPolicy(
                args["every"]),
            preservation_policy=training.preservation_policies.LatestN(3)) as ckptr:
        latest = ckptr.latest
        if latest is not None:
            state = ckptr.load_checkpointables(latest.step, {"state": abstract,
                                                             "data": iterator})["state"]
        for step in range(0 if latest is None else latest.step + 1, stop):
            state = _train_step(state, next(iterator))
            ckptr.save_checkpointables(step, {"state": state, "data": iterator})
        ckptr.wait()
        if args.get("kill"):
            crash()
        return {"resumed_from": None if latest is None else latest.step,
                "memory_loads": memory_loads and memory_loads[0],
                "digest": digest(state), "position": iterator.position,
                "kept": [c.step for c in ckptr.checkpoints],
                "step": int(np.asarray(jax.device_get(state.step)))}


def _count_memory_loads() -> list:
    """Counts the checkpointables bubblesnap's manager restores from memory."""
    from bubblesnap.clients.jax.manager.checkpoint_manager import CheckpointManager

    count, restore = [0], CheckpointManager.restore_from_memory

    def counted(self, *a, **k):
        found = restore(self, *a, **k)
        count[0] += found is not None
        return found
    CheckpointManager.restore_from_memory = counted
    return count
