"""A training loop that saves its data iterator beside its state, the way public JAX
trainers do: the iterator through a handler of its own (the shape of Grain's:
``process_<i>-of-<n>.json`` in the item's folder), the state through Orbax's Standard
handler, both in every step's ``Composite``; on resume, as frameworks do, the iterator
is restored only if the step's folder has it (``directory/<step>/iter``).

A target for ``bubblesnap.testing.multihost.JaxJob``: ``args["manager"]`` picks Orbax's manager or
bubblesnap's (the import swapped); it resumes from the latest step, trains to
``args["steps"]`` reading batch ``position`` from the iterator, saves every
``args["every"]`` steps (``args["memory"]``: every step held in memory only between
them, ``memory_interval_steps=1``), and with ``args["kill_at"]`` waits for that step's
save and crashes. It reports where it resumed, whether the iterator came back and from
where, its final position and a digest of its state.
"""

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from bubblesnap.testing.multihost import crash


class PositionHandler(ocp.CheckpointHandler):
    """A data iterator's position, one file per process, as Grain's handler writes it."""

    def save(self, directory: epath.Path, args: "PositionSave"):
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(json.dumps({"position": args.position}))

    def restore(self, directory: epath.Path, args: "PositionRestore | None" = None):
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        return json.loads((directory / name).read_text())["position"]

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(PositionHandler, for_save=True)
@dataclasses.dataclass
class PositionSave(ocp.args.CheckpointArgs):
    position: int


@ocp.args.register_with_handler(PositionHandler, for_restore=True)
@dataclasses.dataclass
class PositionRestore(ocp.args.CheckpointArgs):
    pass


def batch(position: int) -> jax.Array:
    """The data at ``position``: a run that reads other data ends with another state."""
    return jnp.cos(jnp.arange(32, dtype=jnp.float32) * (position + 1))


@jax.jit
def train_step(state, x):
    w = state["w"] * 0.9 + x
    return {"w": w, "step": state["step"] + 1}


def train(args: dict) -> dict:
    if args["manager"] == "orbax":
        from orbax.checkpoint import CheckpointManager, CheckpointManagerOptions
        extra = {}
    else:
        from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions
        extra = {"memory_interval_steps": 1} if args.get("memory") else {}
    options = CheckpointManagerOptions(save_interval_steps=args.get("every", 1), max_to_keep=3,
                                       **extra)
    state = {"w": jnp.zeros((32,), jnp.float32), "step": jnp.zeros((), jnp.int32)}
    position, iterator_from = 0, None
    with CheckpointManager(args["directory"], item_names=("state", "iter"),
                           options=options) as mngr:
        latest = mngr.latest_step()
        if latest is not None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            if (mngr.directory / str(latest) / "iter").exists():
                iterator_from = "step folder"
            elif args["manager"] != "orbax":
                iterator_from = "memory step"  # held in memory only: no folder of its own
            restore = {"state": ocp.args.StandardRestore(abstract)}
            if iterator_from is not None:
                restore["iter"] = PositionRestore()
            restored = mngr.restore(latest, args=ocp.args.Composite(**restore))
            state = restored.state
            position = restored.iter if iterator_from is not None else 0
        for step in range(0 if latest is None else latest + 1, args["steps"]):
            state = train_step(state, batch(position))
            position += 1
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    iter=PositionSave(position)))
            if step == args.get("kill_at"):
                mngr.wait_until_finished()
                crash()
        mngr.wait_until_finished()
    digest = hashlib.sha256(np.asarray(state["w"]).tobytes()).hexdigest()
    return {"resumed_from": latest, "iterator_from": iterator_from, "position": position,
            "step": int(state["step"]), "digest": digest}
