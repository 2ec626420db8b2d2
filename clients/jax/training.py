"""Orbax v1's ``training.Checkpointer``, with the daemons' memory in front of its pytrees.

A loop written for ``orbax.checkpoint.experimental.v1.training`` runs unchanged apart from
the import (or with nothing changed, under ``python -m bubblesnap.run``)::

    from bubblesnap.clients.jax import training   # was: from orbax...v1 import training

    with training.Checkpointer(directory, save_decision_policy=
            training.save_decision_policies.FixedIntervalPolicy(100)) as ckptr:
        if ckptr.latest is not None:
            state = ckptr.load_checkpointables(None, {"state": abstract_state})["state"]
        for step in range(...):
            ckptr.save_checkpointables(step, {"state": state, "data": iterator_state})

The class *is* Orbax's (subclassed): its options, policies, step naming, metadata,
errors and files are Orbax's. Its manager is bubblesnap's CheckpointManager
(manager/checkpoint_manager.py) with the options Orbax's Checkpointer gives it, so what holds
for a manager holds here: the user's policies decide what persists, each checkpointable
Orbax's v1 PyTreeHandler saves is copied into this host's daemon and written by it into
the step's folder (``wait`` returns with it on disk), other checkpointables are their
own handlers', and a job is the whole directory. ``load``/``load_checkpointables`` with
abstract targets take each pytree from the daemons' memory where it gives exactly what
Orbax reads; anything else Orbax reads from the folder.

The module re-exports the rest of Orbax's ``training`` module (policies, metadata types,
errors), so swapping the import is the whole change.
"""

from orbax.checkpoint.experimental.v1 import training as orbax_training

from bubblesnap.clients.jax.manager.checkpoint_manager import CheckpointManager
from bubblesnap.clients.jax.tier import orbax_v1

save_decision_policies = orbax_training.save_decision_policies
preservation_policies = orbax_training.preservation_policies
errors = orbax_training.errors
CheckpointMetadata = orbax_training.CheckpointMetadata
RootMetadata = orbax_training.RootMetadata


#: Orbax's own manager class, the one bubblesnap's subclasses.
_ORBAX_MANAGER = CheckpointManager.__mro__[1]


class Checkpointer(orbax_training.Checkpointer):
    """Orbax v1's ``training.Checkpointer`` with bubblesnap's memory tier (the module's
    text). Takes Orbax's constructor arguments."""

    def __init__(self, directory, **kwargs):
        super().__init__(directory, **kwargs)
        built = self._manager  # Orbax's, built by Orbax's constructor: ours takes its place
        if isinstance(built, _ORBAX_MANAGER):  # (not a stand-in a test patched in)
            self._manager = CheckpointManager(
                built.directory, options=built._options,
                metadata=kwargs.get("custom_metadata"), logger=self._logger)
            # v1 lists its checkpoints from Orbax's own records of saved steps: no steps
            # held in memory only ($BUBBLESNAP_MEMORY_INTERVAL_STEPS) for it, for now
            self._manager._memory_steps = None
            built.close()

    def load_checkpointables(self, step=None, abstract_checkpointables=None):
        """Orbax's load, each pytree of ``abstract_checkpointables`` that memory answers
        (orbax_v1.restore_args) from the fastest tier holding the step; the rest, and
        everything without abstract targets, Orbax reads from the step's folder."""
        if not abstract_checkpointables:
            return super().load_checkpointables(step, abstract_checkpointables)
        step = self._resolve_existing_checkpoint(step).step
        folder = self.directory / self._step_name_format.build_name(step)
        loaded = {}
        for name, abstract in abstract_checkpointables.items():
            args = orbax_v1.restore_args(abstract)
            found = None if args is None else \
                self._manager.restore_from_memory(step, name, folder / name, args)
            if found is not None:
                loaded[name] = found.value
        rest = {k: v for k, v in abstract_checkpointables.items() if k not in loaded}
        if rest:
            loaded.update(super().load_checkpointables(step, rest))
        return {name: loaded[name] for name in abstract_checkpointables}
