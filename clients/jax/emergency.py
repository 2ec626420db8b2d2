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
daemons, as Orbax writes them). The local tier is the daemons' memory: the steps the
local options name (``save_interval_steps``, ``should_save_fn``,
``save_decision_policy``; kept as ``max_to_keep`` or ``preservation_policy`` say, and
as long as the daemons hold them) are held there, replicated to the daemons' peers, so
it needs no second slice's copy and survives the loss of a host; ``local_directory`` is
not written. ``all_steps``/``latest_step`` list both tiers, as every process agrees
(process 0's view); a restore takes the step from the fastest tier holding it (memory,
a neighbour's, then disk) onto the mesh and process count of ``abstract_state``. Unlike
Orbax's, a mesh of one slice (replica) has the local tier too: the daemons' peers hold
the copies a second slice would (Orbax drops the local options there).
"""

import dataclasses
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint._src.multihost import multihost, multislice
from orbax.checkpoint.experimental.emergency import checkpoint_manager as orbax_emergency

from bubblesnap.clients.jax.manager.checkpoint_manager import CheckpointManager as Manager
from bubblesnap.clients.jax.manager.manager_options import (
    CheckpointManagerOptions as ManagerOptions,
)
from bubblesnap.clients.jax.tier.local_policy import LocalPolicy

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
        self._replica_axis_index = options.replica_axis_index
        # Orbax's single-slice code paths (one manager for the whole job: every process
        # copies its own shards into its daemon, whatever the slices).
        self._slice_count = multislice.replica_count(
            global_mesh, replica_axis_index=options.replica_axis_index)
        if self._slice_count <= 0:
            raise ValueError(f"Slice count must be positive, but got {self._slice_count} "
                             f"for mesh {global_mesh}.")
        self._local = not options.local.read_only
        self._checkpoint_manager = Manager(
            persistent_directory, options=_options(options, primary_host=0),
            metadata=metadata, logger=logger,
            local_policy=LocalPolicy.of(options.local) if self._local else None)
        self._non_replicated_checkpoint_manager = None
        if persistent_non_replicated_directory is not None:  # the dataset item, as Orbax
            self._non_replicated_checkpoint_manager = Manager(
                persistent_non_replicated_directory,
                options=_options(options, primary_host=0,
                                 barrier_sync_key_prefix="non_replicated"),
                metadata=metadata, item_handlers=item_handlers,
                handler_registry=handler_registry)
        self._latest = None
        if self._local:
            self.all_steps()  # the steps every process agrees on, as Orbax's manager starts
            log.info("bubblesnap: the emergency manager of %s holds its local steps in the "
                     "daemons' memory; %s is not written", persistent_directory,
                     local_directory)

    @property
    def in_primary_slice(self) -> bool:
        """Whether this process is in the slice (replica) of index 0, as Orbax says."""
        if self._slice_count == 1:
            return True
        return multislice.in_replica(multihost.process_index(), self._global_mesh,
                                     replica_axis_index=self._replica_axis_index,
                                     replica_id=0)

    def all_steps(self, read: bool | None = None):
        """Both tiers' steps, as process 0 sees them (every process calls it, as Orbax's
        multi-slice manager's, which agrees on the local steps too)."""
        steps = list(self._checkpoint_manager.all_steps(read=bool(read)))
        if self._local:
            steps = _agreed(steps) if jax.process_count() > 1 else steps
            self._latest = steps[-1] if steps else None
        return steps

    def latest_step(self):
        """The newest step of either tier: of the last ``all_steps``, or saved since."""
        if not self._local:
            return self._checkpoint_manager.latest_step()
        return self._latest

    def restore(self, step, args=None):
        """Orbax's restore into ``abstract_state`` (and its ``dataset`` item); ``step``
        None: the newest step every process agreed on. A local step the daemons hold
        comes from memory, as Orbax's takes a local step from the local tier first; every
        process takes the same tier (process 0's view)."""
        if not self._local:
            return super().restore(step, args)
        if step is None:
            step = self._latest
            if step is None:
                raise FileNotFoundError(f"No steps found in {self.directory}.")
        dataset = None
        if args is not None and "dataset" in args.keys():
            if self._non_replicated_checkpoint_manager is None:
                raise ValueError("Non-replicated checkpoint manager is None, but dataset was "
                                 f"requested to be restored at step {step}.")
            dataset = self._non_replicated_checkpoint_manager.restore(step, args=args.dataset)
        local = self._checkpoint_manager.held_locally(step)
        if jax.process_count() > 1:
            local = bool(multihost_utils.broadcast_one_to_all(np.int32(local)))
        state = self._checkpoint_manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=self._abstract_state,
                restore_args=ocp.checkpoint_utils.construct_restore_args(
                    self._abstract_state))), from_memory=local).state
        return ocp.args.Composite(state=state, **({"dataset": dataset} if dataset else {}))

    def save(self, step, args, *, force=False, custom_metadata=None) -> bool:
        """Orbax's save, its checks of the items as Orbax's multi-slice manager's."""
        if self._slice_count > 1:
            if not isinstance(args, ocp.args.Composite):
                raise ValueError(
                    f"Expected args must be a Composite object, but got {type(args)}.")
            if "state" not in args.keys():
                raise ValueError("state is a required key and should be specified by the "
                                 "user.")
            if "process_metadata" in args.keys():
                raise ValueError("process_metadata is a reserved key and should not be "
                                 "specified by the user.")
        saved = super().save(step, args, force=force, custom_metadata=custom_metadata)
        if self._slice_count > 1:
            saved = bool(multihost.global_max([int(saved)])[0])
        if saved and self._local:
            self._latest = step if self._latest is None else max(self._latest, step)
        return saved


def _agreed(steps: list[int]) -> list[int]:
    """Process 0's ``steps`` on every process (one sees a step committed a moment before
    another: the job must agree on what it can restore)."""
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(steps))))
    padded = np.full(count, -1, np.int64)
    padded[:min(count, len(steps))] = steps[:count]
    return sorted(int(s) for s in multihost_utils.broadcast_one_to_all(padded))


def _options(options, *, primary_host: int,
             barrier_sync_key_prefix: str | None = None) -> ManagerOptions:
    """bubblesnap's manager options for Orbax's emergency ``options``: its persistent
    options as Orbax turns them into a manager's (the local tier is a LocalPolicy)."""
    persistent = orbax_emergency._get_persistent_options(
        options, ocp.options.MultiprocessingOptions(
            primary_host=primary_host, barrier_sync_key_prefix=barrier_sync_key_prefix))
    fields = {f.name: getattr(persistent, f.name)
              for f in dataclasses.fields(persistent) if f.init}
    fields["create"] = True  # Orbax's emergency manager makes the folder before its manager
    # Orbax's options class may be bubblesnap's already (bubblesnap.run binds it), its
    # fields bubblesnap's too: no interval of its own (the local tier is the policy's).
    return ManagerOptions(**{**fields, "memory_interval_steps": 0})
