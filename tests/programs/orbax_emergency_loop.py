"""A training loop written for Orbax's emergency ``CheckpointManager`` the way a current
public LLM trainer writes it (MaxText 0.2.5's ``enable_emergency_checkpoint``): a Flax
``TrainState`` saved as the ``state`` item of a ``Composite`` whenever
``should_save`` says, a local period of ``args["local"]`` steps and a persistent one of
``args["persistent"]``, resumed from ``latest_step()`` with the abstract state given at
construction.

``args["manager"]``: ``orbax`` (Orbax's emergency module), ``bubblesnap`` (the import
swapped) or ``patched`` (the code unchanged, in a process started with bubblesnap's
switch). A target for ``bubblesnap.testing.multihost.JaxJob`` (one process or several under
``jax.distributed``, devices interleaved over the processes). With ``args["kill"]`` it
stops after step ``args["kill_at"]`` (its save finished), writes the digest of the
state it had into ``<root>/killed.digest`` and crashes. It reports the step it resumed
from, the digest of the state restored, of the final global state, its step and the
steps listed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state

from bubblesnap.testing.multihost import crash
from tests.programs.orbax_loops import _batch, _mesh, _Mlp, _shard, chosen_module, digest


@jax.jit
def _train_step(state, x):
    def loss(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def train(args: dict) -> dict:
    emergency = chosen_module(args["manager"], "bubblesnap.clients.jax.emergency",
                              "orbax.checkpoint.experimental.emergency.checkpoint_manager",
                              "CheckpointManager")
    mesh = _mesh()
    model = _Mlp()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8)))["params"]
    state = _shard(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adamw(1e-2)).replace(
            step=jnp.zeros((), jnp.int32)), mesh)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state)
    options = emergency.CheckpointManagerOptions(
        local=emergency.LocalCheckpointOptions(save_interval_steps=args["local"],
                                               max_to_keep=2),
        persistent=emergency.PersistentCheckpointOptions(
            save_interval_steps=args["persistent"], max_to_keep=3))
    stop = args["kill_at"] + 1 if args.get("kill") else args["steps"]
    with emergency.CheckpointManager(args["root"] + "/local", args["root"] + "/persistent",
                                     mesh, abstract, options=options) as mngr:
        latest, restored = mngr.latest_step(), None
        if latest is not None:
            state = mngr.restore(latest).state
            restored = digest(state)
        for step in range(0 if latest is None else latest + 1, stop):
            state = _train_step(state, _batch(step))
            if mngr.should_save(step):
                mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        mngr.wait_until_finished()
        if args.get("kill"):
            killed = digest(state)  # every process takes part: it gathers the arrays
            if jax.process_index() == 0:
                with open(f"{args['root']}/killed.digest", "w") as f:
                    f.write(killed)
            crash()
        return {"resumed_from": latest, "restored": restored, "digest": digest(state),
                "step": int(np.asarray(jax.device_get(state.step))),
                "all_steps": list(mngr.all_steps())}
