"""``CheckpointManager`` with Orbax's API and meaning, over the daemon: change one import.

A loop written for ``orbax.checkpoint.CheckpointManager`` runs unchanged apart
from the import (or with nothing changed, under ``python -m bubblesnap.run``)::

    from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions

    with CheckpointManager("/ckpt/run1", options=CheckpointManagerOptions(
            max_to_keep=3)) as mngr:
        if (latest := mngr.latest_step()) is not None:
            state = mngr.restore(latest, args=ocp.args.StandardRestore(abstract_state))
        for step in range(...):
            state = train_step(state)
            mngr.save(step, args=ocp.args.StandardSave(state))

Every pytree Orbax saves, ``item_names``/``item_handlers`` with ``Composite``
args of Standard, PyTree and Json items, Orbax's options, policies and
methods keep their meaning. Underneath, ``save`` copies the state into the
host daemon's memory (checked, replicated and committed in the background;
non-array leaves and JSON items travel in it, its record); the daemon
persists every ``--durable-every-steps``-th step into ``directory`` as
Orbax's CheckpointManager lays it out, so plain Orbax restores it;
``restore`` takes the step from the fastest tier that holds it (this host's
memory, a neighbour's, the durable tier), into any mesh.
``directory``: the job's folder (its parent the daemon's ``--durable-dir``);
Orbax's own steps there, and items of other args types, go through Orbax.
"""

import logging
import os

import grpc
import jax
import orbax.checkpoint as ocp
from etils import epath

from bubblesnap.clients.jax import checkpoint_items, step_metadata, step_restore
from bubblesnap.clients.jax._manager_steps import StepInfo, Steps
from bubblesnap.clients.jax._save_errors import SaveErrors
from bubblesnap.clients.jax.client import SnapshotClient
from bubblesnap.clients.jax.manager_options import (
    CheckpointManagerOptions,
    asks_saving_in_progress,
    preservation_policy,
    resolve,
    save_decision_policy,
    step_naming,
)
from bubblesnap.clients.jax.orbax_steps import StepFolders
from bubblesnap.clients.jax.step_snapshot import RecordTooBig, StepSnapshots
from bubblesnap.clients.results import RestoreError

log = logging.getLogger("bubblesnap.client")
StepAlreadyExistsError = ocp.checkpoint_manager.StepAlreadyExistsError
#: Steps the preservation policy dropped that are deleted together.
_RETIRE_BATCH = 4


class CheckpointManager:
    """Orbax's ``CheckpointManager`` over the daemon (see the module docstring).

    Takes Orbax's constructor arguments (``checkpointers`` and
    ``handler_registry`` only as far as they name items and handlers; a
    ``logger`` is not used) and bubblesnap's or Orbax's options.
    ``process_index`` and ``process_count`` default to JAX's: one manager per
    process, each saving the regions of the global arrays its devices hold.
    """

    def __init__(self, directory, checkpointers=None, options=None, metadata=None,
                 item_names=None, item_handlers=None, logger=None, handler_registry=None, *,
                 process_index: int | None = None, process_count: int | None = None):
        self._options = resolve(options)
        self._directory = os.path.abspath(os.fspath(directory))
        job = os.path.basename(self._directory)
        if not job:
            raise ValueError(f"CheckpointManager: directory {directory!r} names no job folder "
                             "(use <the daemon's --durable-dir>/<job>)")
        if logger is not None:
            log.warning("CheckpointManager: the logger is not used by bubblesnap's manager")
        handlers = checkpoint_items.legacy_handlers(checkpointers, handler_registry) or \
            item_handlers
        self._handlers, self._single = checkpoint_items.handler_kinds(handlers, item_names)
        self._item_names = tuple(item_names or ())
        rank = jax.process_index() if process_index is None else process_index
        self._world = jax.process_count() if process_count is None else process_count
        primary = self._options.multiprocessing_options.primary_host
        self._primary = rank == (primary or 0)
        self._client = SnapshotClient(job, rank, self._world, options=self._options.client)
        self._folders = StepFolders(self._directory, *step_naming(self._options),
                                    self._options.step_name_format)
        self._folders.prepare(create=self._options.create,
                              writer=self._primary and not self._options.read_only)
        self._save_policy = save_decision_policy(self._options)
        self._progress_matters = self._options.enable_should_save_is_saving_in_progress_check \
            and asks_saving_in_progress(self._save_policy)
        self._keep_policy = preservation_policy(self._options)
        self._steps = Steps(self._client, self._folders, self._options.record_bytes,
                            self._primary)
        self._errors = SaveErrors()
        self._warned: set[str] = set()
        self._snapshots = StepSnapshots(self._options, self._world, self._primary,
                                        self._folders, self._warn_once)
        self._uncommitted: int | None = None  # the newest save not known committed yet
        self._closed: list[int] | None = None  # all_steps() when closed
        self._since_retire = 0  # saves since the last deletions
        if metadata is not None and self._primary and not self._options.read_only \
                and self._options.save_root_metadata:
            self._folders.write_root_metadata(metadata)
        self._steps.reload()
        self._folders.check_daemon(self._client, self._options.client.daemon)

    @property
    def directory(self) -> epath.Path:
        """The job's folder in the durable tier (one folder per step, as Orbax's)."""
        return epath.Path(self._directory)

    # -- which steps ---------------------------------------------------------

    def all_steps(self, read: bool = False) -> list[int]:
        """The steps this manager keeps (its preservation policy) that some tier can
        restore, oldest first. ``read``: Orbax's (the tiers are always asked)."""
        del read
        if self._closed is not None:
            return list(self._closed)  # as the manager last saw them
        held = self._steps.restorable()
        kept = {info.step for info, keep in self._preserved() if keep}
        return [step for step in held if step in kept]

    def _preserved(self) -> list[tuple[StepInfo, bool]]:
        """Each tracked step and whether the preservation policy keeps it (Orbax's)."""
        infos = self._steps.infos()
        return list(zip(infos, self._keep_policy.should_preserve(
            infos, context=ocp.checkpoint_managers.PreservationContext()), strict=True))

    def latest_step(self) -> int | None:
        """The newest of :meth:`all_steps`, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by ``best_fn`` / ``best_mode`` (the latest without ``best_fn``)."""
        if self._options.best_fn is None:
            return self.latest_step()
        restorable = set(self.all_steps())
        scored = [info for info in self._steps.infos() if info.step in restorable
                  and info.metrics is not None]
        if not scored:
            return None
        scored.sort(key=lambda info: self._options.best_fn(info.metrics),
                    reverse=self._options.best_mode == "min")
        return scored[-1].step

    def reload(self) -> None:
        """Reads again which steps the tiers hold (a directory changed by others)."""
        self._steps.reload()

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would save, by the save decision policy (Orbax's)."""
        if self._options.read_only:
            self._warn_once("read_only", "%s is read only: save and delete are skipped",
                            self._directory)
            return False
        infos = self._steps.infos()
        if infos and infos[-1].step >= step:
            return False
        context = ocp.checkpoint_managers.DecisionContext(
            is_saving_in_progress=self._progress_matters and self.is_saving_in_progress(),
            reached_preemption=self.reached_preemption(step),
            multiprocessing_options=self._options.multiprocessing_options)
        return bool(self._save_policy.should_save(StepInfo.now(step), previous_steps=infos,
                                                  context=context))

    # -- save ----------------------------------------------------------------

    def save(self, step: int, items=None, save_kwargs=None, metrics=None, force: bool = False,
             args=None, custom_metadata: dict | None = None) -> bool:
        """Saves ``args`` (or the legacy ``items``) as ``step`` when :meth:`should_save` or
        ``force`` says so; whether it saved. Daemon trouble never raises here (the
        step is not saved, False, and :meth:`check_for_errors` raises it)."""
        if self._options.read_only:
            return self.should_save(step)  # False, with the warning
        single = self._mode(args)
        to_save = checkpoint_items.save_items(args, items, save_kwargs, single, self._handlers)
        if not force and not self.should_save(step):
            return False
        if step in self._steps.known():
            raise StepAlreadyExistsError(f"Checkpoint for step {step} already exists.")
        if self._options.best_fn is None or self._options.prevent_write_metrics:
            metrics = None  # Orbax keeps metrics only to track the best steps
        try:
            names, leaves, record = self._snapshots.build(step, to_save, metrics,
                                                          custom_metadata)
        except RecordTooBig as err:  # never an exception that stops training
            log.error("%s", err)
            self._errors.add(str(err))
            return False
        wait = False if self._options.enable_async_checkpointing else "job"
        result = self._client.snapshot_leaves(step, names, leaves, wait=wait)
        self._note_late_failures()
        if self._errors.failed(result):
            return False
        self._uncommitted = step
        self._steps.add(StepInfo(step, step_metadata.step_time(record), metrics))
        self._retire()
        return True

    def wait_until_finished(self) -> None:
        """Waits until the last save is committed for the whole job (every rank's copy
        checked and replicated), at most ``async_options.timeout_secs`` (else
        ``ClientOptions.commit_timeout_seconds``); a failure is kept for
        :meth:`check_for_errors`."""
        self._client.wait()
        self._note_late_failures()
        if self._uncommitted is None:
            return
        step, timeout = self._uncommitted, self._commit_timeout()
        try:
            committed, latest = self._client.session.wait_committed(step, timeout)
        except grpc.RpcError as err:
            self._errors.add(f"step {step}: waiting for its commit failed: "
                                f"{err.code().name}: {err.details()}")
            return
        if not committed:
            self._errors.add(f"step {step} was not committed for the job within "
                                f"{timeout:.0f} s (latest committed: {latest})")
            return
        self._uncommitted = None
        self._retire()
        callback = getattr(self._options.async_options, "post_finalization_callback", None)
        if callback is not None:
            callback()

    def is_saving_in_progress(self) -> bool:
        """Whether the last save is not committed for the job yet."""
        if self._uncommitted is None:
            return False
        try:
            committed, _ = self._client.session.wait_committed(self._uncommitted, 0.0)
        except grpc.RpcError:
            return True
        if committed:
            self._uncommitted = None
        return not committed

    def check_for_errors(self) -> None:
        """Raises RuntimeError naming every save that failed since the last call."""
        self._errors.raise_any()

    # -- restore -------------------------------------------------------------

    def restore(self, step: int | None = None, items=None, restore_kwargs=None,
                directory=None, args=None):
        """The items of ``step`` (default: the latest), into ``args``' targets
        (``StandardRestore(abstract_state)``, ``Composite`` of them; none: as saved),
        from the fastest tier that holds them. FileNotFoundError when there is no
        such step, as Orbax."""
        if directory is not None and os.path.abspath(os.fspath(directory)) != self._directory:
            other = StepFolders(os.fspath(directory), *step_naming(self._options),
                                self._options.step_name_format)
            return other.restore_with_orbax(step, args, self._item_names, self._handlers)
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"No steps found in {self._directory}.")
        if step not in self.all_steps():
            raise FileNotFoundError(f"Checkpoint at {self._folders.path(step)} not found.")
        single = self._mode(args) if args is not None else self._single_of(step)
        record = self._steps.record(step)
        if record is None:  # a step plain Orbax wrote
            return self._folders.restore_with_orbax(step, args, self._item_names,
                                                    self._handlers)
        wanted = checkpoint_items.restore_items(args, items, restore_kwargs, single,
                                                self._handlers, record["items"])
        try:
            # Restoring the newest step any tier holds resumes the job from it; any other
            # step, or a read-only manager's (an evaluator), leaves every step as it is.
            alone = self._options.read_only or step != self._steps.newest_held()
            out = step_restore.restore_items(self._client, self._folders, self._handlers,
                                             record, wanted, step, alone=alone)
        except RestoreError as err:
            folder = self._folders.find().get(step)
            if folder is None:
                raise
            log.warning("step %d: the daemon could not restore it (%s); Orbax reads it from "
                        "%s", step, err, folder)
            return self._folders.restore_with_orbax(step, args, self._item_names,
                                                    self._handlers)
        self._uncommitted = None
        if single:
            return out[checkpoint_items.DEFAULT_ITEM]
        return ocp.handlers.CompositeResults(**out)

    # -- metadata ------------------------------------------------------------

    def metadata(self, step: int | None = None):
        """Orbax's RootMetadata (no step: the ``metadata`` given at construction), or
        the StepMetadata of ``step``: item handlers and metadata, metrics, custom metadata."""
        if step is None:
            return ocp.metadata.RootMetadata(custom_metadata=self._folders.root_metadata())
        record = self._steps.record(step)
        if record is None:
            return self._folders.metadata_with_orbax(step, self._item_names, self._handlers)
        return step_metadata.from_record(record, self._folders.path(step), self._single_of(step))

    def item_metadata(self, step: int):
        """The metadata of ``step``'s items (``metadata(step).item_metadata``)."""
        return self.metadata(step).item_metadata

    def metrics(self, step: int):
        """The metrics saved with ``step`` (None without)."""
        return next((i.metrics for i in self._steps.infos() if i.step == step), None)

    # -- delete, preemption, closing -------------------------------------------

    def delete(self, step: int) -> None:
        """Deletes ``step`` from every tier (FileNotFoundError when there is none)."""
        if self._options.read_only:
            self._warn_once("read_only", "%s is read only: save and delete are skipped",
                            self._directory)
            return
        if step not in self._steps.known():
            raise FileNotFoundError(f"Requested deleting a non-existent step: {step}.")
        self._steps.delete(step)

    def reached_preemption(self, step: int) -> bool:
        """Whether the job reached JAX's preemption sync point at ``step`` (a host was
        told to stop): save now, as with Orbax. False outside ``jax.distributed``."""
        from jax.experimental import multihost_utils
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # no preemption service: not a distributed job
            return False

    def close(self) -> None:
        """Waits for the last save, then lets go of the daemon connection (``all_steps``
        goes on answering what it last saw)."""
        if self._closed is not None:
            return
        self.wait_until_finished()
        self._closed = self.all_steps()
        self._client.close()
        self._folders.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------

    def _mode(self, args) -> bool:
        """Default-item mode, decided by the first call's args when the constructor did
        not (Orbax's rule)."""
        if self._single is None and args is not None:
            self._single = not checkpoint_items.is_composite(args)
        return True if self._single is None else self._single

    def _single_of(self, step: int) -> bool:
        if self._single is not None:
            return self._single
        record = self._steps.record(step)
        return record is None or list(record["items"]) == [checkpoint_items.DEFAULT_ITEM]

    def _retire(self) -> None:
        """Deletes the steps the preservation policy no longer keeps (Orbax's), once a
        newer step is committed (never the newest one a tier holds), a few at a time:
        one Status call per batch, not one per save, and none a save waits for. They
        are not listed meanwhile."""
        dropped = [info.step for info, keep in self._preserved() if not keep]
        self._since_retire += 1
        if not dropped or (self._since_retire < _RETIRE_BATCH and self._uncommitted is not None):
            return
        self._since_retire = 0
        self._steps.retire(dropped, wait=self._uncommitted is None)

    def _commit_timeout(self) -> float:
        timeout = getattr(self._options.async_options, "timeout_secs", None)
        return float(timeout) if timeout else self._options.client.commit_timeout_seconds

    def _note_late_failures(self) -> None:
        """Keeps the saves that returned and failed after (a commit refused or never
        answered); a failed last save is nothing to wait for."""
        for failure in self._client.session.take_late_failures():
            self._errors.failed(failure)
            if failure.step == self._uncommitted:
                self._uncommitted = None

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


__all__ = ["CheckpointManager", "CheckpointManagerOptions", "RestoreError",
           "StepAlreadyExistsError"]
