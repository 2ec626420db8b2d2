"""Orbax's emergency ``CheckpointManager``, with the daemons' memory as its local tier.

A loop written for ``orbax.checkpoint.experimental.emergency.checkpoint_manager`` runs
unchanged apart from the import (or with nothing changed, under
``python -m bubblesnap.run``)::

    # was: from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
    from bubblesnap.clients.jax import emergency

    options = emergency.CheckpointManagerOptions(
        local=emergency.LocalCheckpointOptions(save_interval_steps=10),
        persistent=emergency.PersistentCheckpointOptions(save_interval_steps=100))
    with emergency.CheckpointManager(local_dir, persistent_dir, mesh, abstract_state,
                                     options=options) as mngr:
        ...
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

The class is Orbax's (subclassed: its methods, args and errors), built on one
bubblesnap ``CheckpointManager`` over ``persistent_directory``. The persistent tier
follows the persistent options exactly (the steps they save are written there, by the
daemons, as Orbax writes them). The local tier is the daemons' memory: every step the
local ``save_interval_steps`` names is held in memory only (``memory_interval_steps``),
replicated to the daemons' peers, so it needs no second slice and survives the loss of a
host; ``local_directory`` is not written. A restore takes the newest step of either tier
(memory, a neighbour's, then disk) onto the mesh and process count of
``abstract_state``. Steps held in memory are kept as the daemons' ``--keep`` says (the
local ``max_to_keep`` is not used); a local save decision policy or ``should_save_fn``
is not supported (a warning says so, and the interval is used).
"""

import dataclasses
import logging

import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency

from bubblesnap.clients.jax.manager.checkpoint_manager import CheckpointManager as Manager
from bubblesnap.clients.jax.manager.manager_options import (
    CheckpointManagerOptions as ManagerOptions,
)

log = logging.getLogger("bubblesnap.client")

CheckpointManagerOptions = orbax_emergency.CheckpointManagerOptions
LocalCheckpointOptions = orbax_emergency.LocalCheckpointOptions
PersistentCheckpointOptions = orbax_emergency.PersistentCheckpointOptions
MultiprocessingOptions = orbax_emergency.MultiprocessingOptions


class CheckpointManager(orbax_emergency.CheckpointManager):
    """Orbax's emergency manager, its local tier the daemons' memory (the module's text).
    Takes Orbax's constructor arguments."""

    def __init__(self, local_directory, persistent_directory, global_mesh, abstract_state,
                 *, options=None, metadata=None, logger=None, item_handlers=None,
                 handler_registry=None, persistent_non_replicated_directory=None):
        options = options or CheckpointManagerOptions()
        self._global_mesh, self._abstract_state = global_mesh, abstract_state
        # One manager for the whole job: every process copies its own shards into its
        # daemon, whatever the slices (Orbax's single-slice code paths, below).
        self._slice_count = 1
        self._checkpoint_manager = Manager(
            persistent_directory, options=_options(options, primary_host=0),
            metadata=metadata, logger=logger)
        self._non_replicated_checkpoint_manager = None
        if persistent_non_replicated_directory is not None:  # the dataset item, as Orbax
            self._non_replicated_checkpoint_manager = Manager(
                persistent_non_replicated_directory,
                options=_options(options, primary_host=0, local=False,
                                 barrier_sync_key_prefix="non_replicated"),
                metadata=metadata, item_handlers=item_handlers,
                handler_registry=handler_registry)
        log.info("bubblesnap: the emergency manager of %s holds its local steps (every %d) "
                 "in the daemons' memory; %s is not written", persistent_directory,
                 options.local.save_interval_steps, local_directory)


def _options(options, *, primary_host: int, local: bool = True,
             barrier_sync_key_prefix: str | None = None) -> ManagerOptions:
    """bubblesnap's manager options for Orbax's emergency ``options``: its persistent
    options as Orbax turns them into a manager's, and the local interval as the interval
    of steps held in memory only."""
    persistent = orbax_emergency._get_persistent_options(
        options, ocp.options.MultiprocessingOptions(
            primary_host=primary_host, barrier_sync_key_prefix=barrier_sync_key_prefix))
    fields = {f.name: getattr(persistent, f.name)
              for f in dataclasses.fields(persistent) if f.init}
    fields["create"] = True  # Orbax's emergency manager makes the folder before its manager
    if local and (options.local.save_decision_policy is not None or
                  options.local.should_save_fn is not None):
        log.warning("bubblesnap: the emergency manager's local save_decision_policy and "
                    "should_save_fn are not supported: a step is held in memory every "
                    "local save_interval_steps (%d)", options.local.save_interval_steps)
    interval = options.local.save_interval_steps if local and not options.local.read_only \
        else 0
    return ManagerOptions(**fields, memory_interval_steps=interval)
