"""The loops ``tests/soak.py`` strikes, as users write them: Orbax's ``CheckpointManager``
(a ``Composite`` of the state and a JSON item, ``save_interval_steps=2``,
``max_to_keep=3``) and Orbax v1's ``training.Checkpointer`` (``FixedIntervalPolicy(2)``,
``save_checkpointables_async``), each with bubblesnap's class (the import swapped), on a
4 MB state sharded over a mesh whose processes' devices interleave.

A target for ``bubblesnap.testing.multihost.JaxJob``: ``args["loop"]`` ("v0" or "v1"),
``args["directory"]``, ``args["daemons"]`` (each process's daemon), ``args["resume"]``
(the resume's name, for the events). It restores the latest step the loop lists, if any,
then trains and saves until it is killed. Its events: ``restoring`` (step) before the
restore, ``restored`` (step, digest of the state restored) after it, ``saving`` (step,
digest of the state it saves) before a save the policy takes, ``saved`` (step) once it
returned. Training is deterministic, so the state of step k is the same in every run.
"""

import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.testing.multihost import event
from tests.programs.orbax_loops import _mesh, digest

#: 1 Mi float32 elements: a 4 MB state.
_ELEMENTS = 1 << 20
_INTERVAL = 2
#: Steps a loop trains at most; the soak kills it long before.
_STEPS = 1_000_000


@jax.jit
def _update(w):
    return w * 0.999 + 1.0


def _initial():
    return jax.device_put(jnp.arange(_ELEMENTS, dtype=jnp.float32),
                          NamedSharding(_mesh(), P("data")))


def _abstract() -> dict:
    w = _initial()
    return {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)}


def _resumed(args: dict, latest: int, restore) -> jax.Array:
    event(event="restoring", step=latest, resume=args["resume"])
    state = restore(latest)
    event(event="restored", step=latest, resume=args["resume"], digest=digest(state))
    return _update(state["w"])


def v0(args: dict) -> None:
    from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions
    options = CheckpointManagerOptions(save_interval_steps=_INTERVAL, max_to_keep=3)
    with CheckpointManager(args["directory"], item_names=("state", "meta"),
                           options=options) as mngr:
        def restore(step: int) -> dict:
            restored = mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract()), meta=ocp.args.JsonRestore()))
            if restored["meta"] != {"step": step}:
                raise AssertionError(f"step {step}'s JSON item reads {restored['meta']}")
            return restored["state"]

        latest = mngr.latest_step()
        first, w = (0, _initial()) if latest is None else (latest + 1,
                                                           _resumed(args, latest, restore))
        for step in range(first, _STEPS):
            if mngr.should_save(step):
                event(event="saving", step=step, digest=digest({"w": w}))
                mngr.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"w": w}),
                    meta=ocp.args.JsonSave({"step": step})))
                event(event="saved", step=step)
            w = _update(w)


def v1(args: dict) -> None:
    from bubblesnap.clients.jax import training
    policy = training.save_decision_policies.FixedIntervalPolicy(_INTERVAL)
    with training.Checkpointer(args["directory"], save_decision_policy=policy) as ckptr:
        def restore(step: int) -> dict:
            return ckptr.load_checkpointables(step, {"state": _abstract()})["state"]

        latest = ckptr.latest.step if ckptr.latest is not None else None
        first, w = (0, _initial()) if latest is None else (latest + 1,
                                                           _resumed(args, latest, restore))
        for step in range(first, _STEPS):
            saves = step % _INTERVAL == 0  # what FixedIntervalPolicy takes
            if saves:
                event(event="saving", step=step, digest=digest({"w": w}))
            ckptr.save_checkpointables_async(step, {"state": {"w": w}})
            if saves:
                event(event="saved", step=step)
            w = _update(w)


LOOPS = {"v0": v0, "v1": v1}


def run(args: dict) -> None:
    os.environ["BUBBLESNAP_DAEMON"] = args["daemons"][jax.process_index()]
    LOOPS[args["loop"]](args)
