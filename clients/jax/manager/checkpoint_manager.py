"""``CheckpointManager``: Orbax's own, with the daemons' memory in front of its pytree items.

A loop written for ``orbax.checkpoint.CheckpointManager`` runs unchanged apart from the
import (or with nothing changed, under ``python -m bubblesnap.run``)::

    from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions

    with CheckpointManager("/ckpt/run1", options=CheckpointManagerOptions(
            max_to_keep=3)) as mngr:
        if (latest := mngr.latest_step()) is not None:
            state = mngr.restore(latest, args=ocp.args.StandardRestore(abstract_state))
        for step in range(...):
            state = train_step(state)
            mngr.save(step, args=ocp.args.StandardSave(state))

The class *is* Orbax's ``CheckpointManager`` (subclassed), so its options, policies,
methods, errors, step folders and metadata are Orbax's, as Orbax's own tests check them.
What changes is who moves the bytes of its pytree items (those of Orbax's stock
Standard and PyTree handlers; every other item is its own handler's, as in Orbax):

- ``save`` copies each item into this host's daemon (its memory: the copy is all the
  training thread pays for) and the daemon writes it into the step's folder, as the
  process's part of Orbax's save, while training goes on; Orbax finalizes the step
  when every write is durable. So the steps the policy keeps are on disk, as Orbax
  writes them, when ``wait_until_finished()`` or ``close()`` returns.
- ``restore`` takes each item from the fastest tier holding the step (this host's
  memory, a neighbour's) when the arguments are ones memory answers exactly, else
  Orbax reads the folder.
- ``memory_interval_steps`` (CheckpointManagerOptions) adds a local tier: steps held
  in the daemons' memory, listed and restored beside the ones the policy keeps
  (tier/memory_steps.py; Orbax's emergency manager gives its local options instead).

The daemon writes the steps when ``directory`` lies inside its ``--durable-dir``;
elsewhere (or with no daemon answering) Orbax writes them itself, as plain Orbax, and
one warning says so. Each pytree item is a job of the daemon named by its whole
folder: two managers never share one.
"""

import contextlib
import logging

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_manager as orbax_manager

from bubblesnap.clients.jax.manager.manager_options import (
    CheckpointManagerOptions,
    bubblesnap_settings,
)
from bubblesnap.clients.jax.tier.local_policy import LocalPolicy
from bubblesnap.clients.jax.tier.memory_steps import KEPT, MemorySteps
from bubblesnap.clients.jax.tier.memory_tier import MemoryTier
from bubblesnap.clients.results import RestoreError

log = logging.getLogger("bubblesnap.client")
StepAlreadyExistsError = orbax_manager.StepAlreadyExistsError


class CheckpointManager(orbax_manager.CheckpointManager):
    """Orbax's ``CheckpointManager`` with bubblesnap's memory tier (the module's text).

    Takes Orbax's constructor arguments and Orbax's or bubblesnap's options;
    ``local_policy`` (a ``LocalPolicy``) names the local tier's steps instead of
    ``memory_interval_steps`` (Orbax's emergency manager's local options)."""

    def __init__(self, directory, checkpointers=None, options=None, metadata=None,
                 item_names=None, item_handlers=None, logger=None, handler_registry=None,
                 *, local_policy: LocalPolicy | None = None):
        settings = bubblesnap_settings(options)
        multiprocessing = getattr(options, "multiprocessing_options", None) or \
            ocp.options.MultiprocessingOptions()
        # Made first: Orbax configures its handlers (the tier's hook) inside its __init__.
        self._tier = MemoryTier(directory, settings, multiprocessing.primary_host)
        self._seen_items: set[str] = set()
        self._orbax_view = 0  # > 0 while Orbax's own code asks for its steps
        self._finish_left(options)
        super().__init__(directory, checkpointers=checkpointers, options=options,
                         metadata=metadata, item_names=item_names, item_handlers=item_handlers,
                         logger=logger, handler_registry=handler_registry)
        self._tier.check_daemon()
        if local_policy is None and settings.memory_interval_steps:
            local_policy = LocalPolicy.every(settings.memory_interval_steps, KEPT)
        read_only = getattr(options, "read_only", False)
        self._memory_steps = MemorySteps(self, self._tier, local_policy) \
            if local_policy is not None and self._tier.local and not read_only else None

    def _finish_left(self, options) -> None:
        """Before Orbax lists the steps: the daemons finish (or drop) every save an earlier
        run of this directory left in flight when its trainer died, so that every process
        lists the same steps, a step the daemons held whole among them."""
        if getattr(options, "read_only", False) or not self._tier.local or \
                not self._tier.persists(self._tier.root):
            return
        self._tier.saves.finish_left()
        if self._tier.world_size > 1:  # the primary finished them before anyone lists
            ocp.multihost.sync_global_processes("bubblesnap:finish_left")

    def _configure_checkpointer_common(self, handler, options, use_async):
        self._tier.install(handler)
        return super()._configure_checkpointer_common(handler, options, use_async)

    # -- which steps ------------------------------------------------------------------

    def all_steps(self, read: bool = False):
        """Orbax's steps, and the local steps the daemons hold (tier/memory_steps.py)."""
        steps = super().all_steps(read)
        if self._memory_steps is None or self._orbax_view:
            return steps  # Orbax's own decisions count the steps it saved
        return sorted(set(steps) | set(self._memory_steps.held()))

    def latest_step(self):
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Orbax's decision, or a local step is due."""
        if self._policy_saves(step):
            return True
        return self._memory_steps is not None and self._memory_steps.due(step)

    def _policy_saves(self, step: int) -> bool:
        """Orbax's ``should_save``, deciding on the steps Orbax saved (it asks
        ``latest_step``, which otherwise lists the steps held in memory only too)."""
        with self._orbax_deciding():
            return super().should_save(step)

    @contextlib.contextmanager
    def _orbax_deciding(self):
        """While Orbax's own code runs: ``all_steps`` lists the steps Orbax saved."""
        self._orbax_view += 1
        try:
            yield
        finally:
            self._orbax_view -= 1

    @contextlib.contextmanager
    def _at_step(self, step: int, custom_metadata=None):
        """Orbax saves or restores ``step`` (with ``custom_metadata``): its handlers (the
        tier's) are told which, and its own decisions see its own steps."""
        self._tier.step, self._tier.custom_metadata = step, custom_metadata
        try:
            with self._orbax_deciding():
                yield
        finally:
            self._tier.step, self._tier.custom_metadata = None, None

    # -- save and restore -----------------------------------------------------------------

    def save(self, step: int, items=None, save_kwargs=None, metrics=None, force=False,
             args=None, custom_metadata=None) -> bool:
        """Orbax's save, each pytree item copied into the daemon's memory and written by
        it; a local step the policy does not save is held in memory only."""
        self._drop_abandoned(step, args, items)
        local = self._memory_steps is not None and not force and self._memory_steps.due(step)
        if local and not self._policy_saves(step):
            return self._memory_steps.save(step, args)
        handler = getattr(self._checkpointer, "handler", None)
        if hasattr(handler, "_get_or_set_handler"):  # Orbax v1 brings one to every save
            self._tier.install(handler)
        with self._at_step(step, custom_metadata):
            saved = super().save(step, items=items, save_kwargs=save_kwargs, metrics=metrics,
                                 force=force, args=args, custom_metadata=custom_metadata)
        self._tier.saves.sweep(before=step)  # Orbax waited for the saves before it
        if local and saved and args is not None:  # a local step too: kept as the tier keeps
            self._memory_steps.save(step, args, persisted=True)
        return saved

    def restore(self, step, items=None, restore_kwargs=None, directory=None, args=None, *,
                from_memory: bool | None = None):
        """Orbax's restore, each pytree item from the fastest tier holding the step;
        ``from_memory`` True: the local step from the local tier whether its folder is
        there or not (False: Orbax's folder; None: the local tier when no folder is)."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"No steps found in {self.directory}.")
        if from_memory is None:
            from_memory = self._memory_steps is not None and directory is None and \
                not self._on_disk(step) and step in self._memory_steps.held()
        if from_memory:
            return self._memory_steps.restore(step, args)
        with self._at_step(step):
            return super().restore(step, items=items, restore_kwargs=restore_kwargs,
                                   directory=directory, args=args)

    def held_locally(self, step: int) -> bool:
        """Whether ``step`` is a local step the daemons hold whole (tier/memory_steps.py)."""
        return self._memory_steps is not None and step in self._memory_steps.held()

    def _on_disk(self, step: int) -> bool:
        """Whether Orbax lists ``step`` and its folder is there (a local step's may be
        gone: its policy, or someone, removed it)."""
        if step not in super().all_steps():
            return False
        try:
            return self._get_read_step_directory(step, self.directory).exists()
        except ValueError:  # Orbax finds no folder of that step
            return False

    def restore_from_memory(self, step: int, item: str, folder, args):
        """``item`` of ``step`` from the daemons' memory as Orbax's ``args`` (of a pytree
        item) restore it from ``folder``: a ``Found``, or None where memory does not give
        exactly that (Orbax v1's loads, which do not go through the manager: training.py)."""
        with self._at_step(step):
            return self._tier.restore_item(item, folder, args)

    def wait_until_finished(self):
        """Orbax's wait (every step the policy saved is on disk), and the local steps are
        committed in the daemons (the newest one for the whole job)."""
        super().wait_until_finished()
        self._tier.wait()
        if self._memory_steps is not None:
            self._memory_steps.wait()
        self._tier.saves.sweep()

    def delete(self, step: int):
        """Orbax's delete, and the daemons' copies of the step go too (a step saved again
        must not meet them)."""
        super().delete(step)
        if not self._options.read_only:
            self._tier.forget([step])
            if self._memory_steps is not None:
                self._memory_steps.forget([step])

    def close(self):
        super().close()
        self._tier.saves.close()
        self._tier.close()

    def _drop_abandoned(self, step: int, args, items) -> None:
        """The first save of an item by this manager: the daemons drop what they hold of
        it from this step on (a run before this one got there and stopped: its copies
        are not this run's). Before Orbax's barrier at the start of a save, so that no
        process's new copy is dropped by another's."""
        names = _item_names(args, items)
        fresh = [name for name in names if name not in self._seen_items]
        if not fresh or self._options.read_only or not self._tier.local:
            return
        self._seen_items.update(fresh)
        self._tier.drop_after([self._tier.job(name) for name in fresh], step - 1)
        if self._tier.world_size > 1:  # every process dropped before any saves again
            ocp.multihost.sync_global_processes("bubblesnap:drop_after")


def _item_names(args, items) -> list[str]:
    """The items a save may name (Orbax's default item when its args are no Composite;
    the legacy ``items`` may be either: both are named, an item no daemon holds costs a
    call that drops nothing)."""
    if isinstance(args, ocp.args.Composite):
        return list(args.keys())
    if args is None and isinstance(items, dict):
        return [*items, orbax_manager.DEFAULT_ITEM_NAME]
    return [orbax_manager.DEFAULT_ITEM_NAME]


__all__ = ["CheckpointManager", "CheckpointManagerOptions", "RestoreError",
           "StepAlreadyExistsError"]
