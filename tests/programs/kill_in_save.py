"""Loops killed in the middle of saving a step their policy keeps, the way users write
them: Orbax's ``CheckpointManager`` with a ``Composite`` of the state and a JSON item
(``save_interval_steps=5``, ``max_to_keep=3``), Orbax v1's ``training.Checkpointer``
(``FixedIntervalPolicy(5)``, ``save_checkpointables_async``) and the emergency manager
(a local step every 2, a persistent one every 5), each with bubblesnap's class (the
import swapped), on a 16 MB state sharded over every process's devices.

A target for ``bubblesnap.testing.multihost.JaxJob``. ``args["loop"]`` names the loop,
``args["directory"]`` its folder, ``args["daemons"]`` each process's daemon. Without
``args["resume"]`` it saves steps 0 .. ``args["kill_at"]`` and crashes
(``bubblesnap.testing.multihost.crash``) right after the last ``save`` returned, before
Orbax could finalize it; ``args["crash_in_save"] = [process, step]`` has that process
crash inside that save instead, before its part of the state reached its daemon (once
the file ``args["part_written"]`` exists, if given: another process's part is durable). With
``args["resume"]`` it resumes as the loop does and reports what it lists, the step it
restored and whether the state is bit for bit the one saved at that step
(``args["resume"] == "orbax"``: Orbax's own manager reads the folder).
"""

import os
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.testing.multihost import crash
from tests.programs.orbax_loops import _mesh, digest

#: 4 Mi float32 elements: the 16 MB state of the issue's loop.
_ELEMENTS = 1 << 22


def _state(step: int) -> dict:
    mesh = _mesh()
    w = jnp.arange(_ELEMENTS, dtype=jnp.float32) * 0.5 + step
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data"))),
            "b": jax.device_put(jnp.full((8,), step, jnp.float32), NamedSharding(mesh, P())),
            "step": step}


def _abstract() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, _state(0))


def _crash_inside_save(args: dict) -> None:
    """Has ``args["crash_in_save"]``'s process crash in that step's save, before its part
    reaches its daemon."""
    if not args.get("crash_in_save"):
        return
    process, step = args["crash_in_save"]
    if jax.process_index() != process:
        return
    from bubblesnap.clients.jax.tier.memory_tier import MemoryTier
    save_item = MemoryTier.save_item

    def crashing(self, item, handler, directory, item_args):
        if self.step == step:
            # (once another process's part is durable, when asked: the job dies then)
            for _ in range(600):
                if os.path.exists(args.get("part_written", "")) or \
                        "part_written" not in args:
                    break
                time.sleep(0.1)
            crash()
        return save_item(self, item, handler, directory, item_args)
    MemoryTier.save_item = crashing


def v0(args: dict) -> dict:
    manager_module = ocp if args.get("resume") == "orbax" else \
        __import__("bubblesnap.clients.jax", fromlist=["CheckpointManager"])
    options = manager_module.CheckpointManagerOptions(save_interval_steps=5, max_to_keep=3)
    with manager_module.CheckpointManager(args["directory"], item_names=("state", "meta"),
                                          options=options) as mngr:
        if args.get("resume"):
            latest = mngr.latest_step()
            restored = mngr.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract()), meta=ocp.args.JsonRestore()))
            return _resumed(list(mngr.all_steps()), latest, restored["state"],
                            restored["meta"] == {"step": latest})
        for step in range(args["kill_at"] + 1):
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(step)),
                                                    meta=ocp.args.JsonSave({"step": step})))
        crash()


def v1(args: dict) -> dict:
    if args.get("resume") == "orbax":
        from orbax.checkpoint.experimental.v1 import training
    else:
        from bubblesnap.clients.jax import training
    policy = training.save_decision_policies.FixedIntervalPolicy(5)
    with training.Checkpointer(args["directory"], save_decision_policy=policy) as ckptr:
        if args.get("resume"):
            latest = ckptr.latest.step
            state = ckptr.load_checkpointables(latest, {"state": _abstract()})["state"]
            return _resumed([c.step for c in ckptr.checkpoints], latest, state, True)
        for step in range(args["kill_at"] + 1):
            ckptr.save_checkpointables_async(step, {"state": _state(step)})
        crash()


def emergency(args: dict) -> dict:
    from bubblesnap.clients.jax import emergency as module
    options = module.CheckpointManagerOptions(
        local=module.LocalCheckpointOptions(save_interval_steps=2),
        persistent=module.PersistentCheckpointOptions(save_interval_steps=5, max_to_keep=3))
    with module.CheckpointManager(args["directory"] + "/local", args["directory"],
                                  _mesh(), _abstract(), options=options) as mngr:
        if args.get("resume"):
            latest = mngr.latest_step()
            return _resumed(list(mngr.all_steps()), latest, mngr.restore(latest).state, True)
        for step in range(args["kill_at"] + 1):
            if mngr.should_save(step):
                mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
                    _state(step))))
        crash()


def _resumed(steps: list, latest: int, state, other_items_match: bool) -> dict:
    return {"all_steps": steps, "latest": latest, "items_match": other_items_match,
            "bit_for_bit": digest(state) == digest(_state(latest))}


LOOPS = {"v0": v0, "v1": v1, "emergency": emergency}


def run(args: dict) -> dict:
    os.environ["BUBBLESNAP_DAEMON"] = args["daemons"][jax.process_index()]
    _crash_inside_save(args)
    return LOOPS[args["loop"]](args)
