"""A training loop written for ``orbax.checkpoint.CheckpointManager``, run as it is with
Orbax's manager or with bubblesnap's: ``args["manager"]`` picks the import, the one
line a user changes.

A target for ``bubblesnap.testing.multihost.JaxJob`` (one process or several under
``jax.distributed``; one global mesh whose devices are ordered so that a
process's devices are not contiguous): it resumes from the latest step if
there is one, trains to ``steps``, saves every step, and at ``kill_at``
waits for the save to finish and crashes (``bubblesnap.testing.multihost.crash``: the parent
SIGKILLs every process once each got there, then runs the loop again).
It returns the step it resumed from and a digest of its final local shards.
bubblesnap's manager finds its daemon through $BUBBLESNAP_DAEMON.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.testing.multihost import crash


def _import_manager(name: str):
    if name == "orbax":
        from orbax.checkpoint import CheckpointManager, CheckpointManagerOptions
    else:
        from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions
    return CheckpointManager, CheckpointManagerOptions


def train(args: dict) -> dict:
    CheckpointManager, CheckpointManagerOptions = _import_manager(args["manager"])

    # ---- from here on, the loop as written for Orbax ----
    devices = np.array(jax.devices())
    devices = np.concatenate([devices[0::2], devices[1::2]])  # processes interleaved
    mesh = Mesh(devices.reshape(-1, 1), ("data", "model"))
    sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    @jax.jit
    def train_step(state):
        w = state["params"]["w"] * 0.999 + jnp.sin(state["step"].astype(jnp.float32))
        return {"params": {"w": w, "b": state["params"]["b"] + w.sum() * 1e-4},
                "step": state["step"] + 1}

    state = {"params": {"w": jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32)
                                            .reshape(64, 8) / 64, sharding),
                        "b": jax.device_put(jnp.zeros((8,), jnp.float32), replicated)},
             "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    options = CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3)
    with CheckpointManager(args["directory"], options=options) as mngr:
        start, latest = 0, mngr.latest_step()
        if latest is not None:
            state = mngr.restore(latest, args=ocp.args.StandardRestore(abstract))
            start = latest + 1
        for step in range(start, args["steps"]):
            state = train_step(state)
            mngr.save(step, args=ocp.args.StandardSave(state))
            if step == args.get("kill_at"):
                mngr.wait_until_finished()
                crash()
        mngr.wait_until_finished()
        mngr.check_for_errors()
    # ---- end of the loop ----

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
            digest.update(np.asarray(shard.data).tobytes())
    return {"resumed_from": latest, "step": int(state["step"]), "digest": digest.hexdigest()}
