"""``CheckpointManager`` shaped like Orbax's, over the daemon: change one import.

A training loop written for ``orbax.checkpoint.CheckpointManager`` runs
unchanged apart from the import::

    from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions

    with CheckpointManager("/ckpt/run1", options=CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=3)) as mngr:
        if (latest := mngr.latest_step()) is not None:
            state = mngr.restore(latest, args=ocp.args.StandardRestore(abstract_state))
        for step in range(...):
            state = train_step(state)
            mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()

What differs underneath: ``save`` copies the state into the host daemon's
memory (the fetch off the device and one memcpy; the daemon checks,
replicates and commits it in the background), the daemon writes every
``--durable-every-steps``-th step to its ``--durable-dir``, and ``restore``
takes the step from the fastest tier that holds it (this host's memory, a
neighbour's, the durable tier). ``directory`` is the job's folder of that
durable tier: its last component names the job and its parent must be the
daemon's ``--durable-dir``; each step there is an Orbax checkpoint
(``directory/step_N``) that plain Orbax restores. Every process of a
multi-host job makes one, as with Orbax.
"""

import dataclasses
import logging
import os

import grpc
import jax

from bubblesnap.clients.jax.client import SnapshotClient
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import RestoreError
from bubblesnap.options import require
from bubblesnap.protos import daemon_pb2 as pb

log = logging.getLogger("bubblesnap.client")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
    """Orbax's names where they mean the same thing, then ours.

    Attributes:
      save_interval_steps: ``save`` snapshots every this many steps (Orbax's
        meaning; default 1, every step: a snapshot into memory is cheap).
      max_to_keep: the newest committed steps kept in the daemons' memory
        for this job; older ones are deleted as newer ones commit, a batch of
        max_to_keep at a time (one Status call per batch). None (the
        default): the daemon's ``--keep`` alone decides. The durable tier
        keeps what the daemon's durable retention says.
      enable_async_checkpointing: True (default, as Orbax): ``save`` returns
        once the state is off the device; the daemon commits it in the
        background and ``wait_until_finished`` waits for that. False: every
        ``save`` waits until the whole job committed the step.
      client: how to reach the daemon (socket, deadlines).
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    enable_async_checkpointing: bool = True
    client: ClientOptions = ClientOptions()

    def __post_init__(self):
        require(self, "save_interval_steps", isinstance(self.save_interval_steps, int)
                and self.save_interval_steps >= 1, "an int >= 1")
        require(self, "max_to_keep", self.max_to_keep is None or (
            isinstance(self.max_to_keep, int) and self.max_to_keep >= 1), "None or an int >= 1")


class CheckpointManager:
    """Orbax's ``CheckpointManager`` API over the daemon (see the module docstring).

    ``process_index`` and ``process_count`` default to JAX's: one manager per
    process, each saving the regions of the global arrays its devices hold
    (each distinct region once in the job).
    """

    def __init__(self, directory, options: CheckpointManagerOptions | None = None, *,
                 process_index: int | None = None, process_count: int | None = None):
        self._directory = os.path.abspath(os.fspath(directory))
        self._options = options or CheckpointManagerOptions()
        job = os.path.basename(self._directory)
        if not job:
            raise ValueError(f"CheckpointManager: directory {directory!r} names no job folder "
                             "(use <the daemon's --durable-dir>/<job>)")
        self._client = SnapshotClient(
            job, jax.process_index() if process_index is None else process_index,
            jax.process_count() if process_count is None else process_count,
            options=self._options.client)
        self._saved: list[int] = []   # steps this process snapshotted, oldest first
        self._errors: list[str] = []  # why snapshots failed, since check_for_errors
        self._check_directory()

    @property
    def directory(self) -> str:
        """The job's folder in the durable tier (``step_N`` checkpoints)."""
        return self._directory

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would save: every ``save_interval_steps``-th step
        newer than the newest one saved."""
        newest = self._saved[-1] if self._saved else None
        return (newest is None or step > newest) and \
            step % self._options.save_interval_steps == 0

    def save(self, step: int, items=None, save_kwargs=None, metrics=None, force: bool = False,
             args=None) -> bool:
        """Snapshots ``args.item`` (``ocp.args.StandardSave(state)``; ``items`` as
        Orbax's legacy form) as ``step`` when :meth:`should_save` or ``force``
        says so; whether it saved. Daemon trouble never raises here (training
        goes on; the step is not saved, False, and :meth:`check_for_errors`
        raises it)."""
        del save_kwargs, metrics  # Orbax's per-save handler options and metrics: none here
        if not (force or self.should_save(step)):
            return False
        state = _item(args, items, "save", "StandardSave(state)")
        wait = "job" if not self._options.enable_async_checkpointing else False
        if self._failed(self._client.snapshot(step, state, wait=wait)):
            return False
        self._saved.append(step)
        if self._options.max_to_keep is not None:
            self._retire()
        return True

    def wait_until_finished(self) -> None:
        """Waits until the last step saved is committed for the whole job (every rank's
        copy checked and replicated), at most ``ClientOptions.commit_timeout_seconds``;
        a failure is kept for :meth:`check_for_errors`."""
        self._failed(self._client.wait())
        if not self._saved:
            return
        step = self._saved[-1]
        try:
            committed, latest = self._client.session.wait_committed(
                step, self._options.client.commit_timeout_seconds)
        except grpc.RpcError as err:
            self._errors.append(f"step {step}: waiting for its commit failed: "
                                f"{err.code().name}: {err.details()}")
            return
        if not committed:
            self._errors.append(f"step {step} was not committed for the job within "
                                f"{self._options.client.commit_timeout_seconds:.0f} s "
                                f"(latest committed: {latest})")

    def check_for_errors(self) -> None:
        """Raises RuntimeError naming every save that failed since the last call."""
        errors, self._errors = self._errors, []
        if errors:
            raise RuntimeError("bubblesnap: " + "; ".join(errors[:8]) +
                               (f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""))

    def all_steps(self, read: bool = False) -> list[int]:
        """The steps the job can restore, oldest first: committed in the daemons'
        memory or whole in the durable tier. ``read`` is Orbax's (always fresh here)."""
        del read
        try:
            status = self._client.status()
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return []  # the daemon knows no such job: nothing saved yet
            raise
        return sorted({s.step for s in status.steps if s.committed} |
                      set(status.durable_steps))

    def latest_step(self) -> int | None:
        """The newest restorable step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, items=None, restore_kwargs=None,
                directory=None, args=None):
        """The state of ``step`` (default: the latest), restored into the structure and
        shardings of ``args.item`` (``ocp.args.StandardRestore(abstract_state)``:
        jax.ShapeDtypeStruct leaves with shardings, or arrays), from the fastest tier
        that holds it. Resumes the job from that step (later copies are dropped as
        the abandoned run's). Raises RestoreError."""
        del restore_kwargs
        if directory is not None and os.path.abspath(os.fspath(directory)) != self._directory:
            raise RestoreError(f"restore from {directory!r}: this manager restores only "
                               f"its own job's folder {self._directory!r}")
        target = _item(args, items, "restore", "StandardRestore(abstract_state)")
        restored = self._client.restore(target, step)
        self._saved = [s for s in self._saved if s <= restored.step]
        return restored.state

    def delete(self, step: int) -> None:
        """Drops ``step`` from this process's daemon's memory (the durable tier keeps
        what its retention says)."""
        self._client.session.call("DeleteSnapshots", pb.DeleteSnapshotsRequest(
            job=self._client.job, steps=[step]))
        self._saved = [s for s in self._saved if s != step]

    def reached_preemption(self, step: int) -> bool:
        """Whether the job reached JAX's preemption sync point at ``step`` (a host was
        told to stop): save now, as with Orbax. False outside ``jax.distributed``."""
        from jax.experimental import multihost_utils
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # no preemption service: not a distributed job
            return False

    def close(self) -> None:
        """Waits for the last save, then lets go of the daemon connection."""
        self.wait_until_finished()
        self._client.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_directory(self) -> None:
        """Warns when the daemon's durable tier is not where ``directory`` says: the
        steps would be written, and plain Orbax would find them, elsewhere. A
        warning, not an error: a container may mount the same folder elsewhere."""
        try:
            durable = self._client.session.call("Status", pb.StatusRequest()).durable_directory
        except grpc.RpcError:
            return  # no daemon yet: saves say so, each in its SnapshotResult
        parent = os.path.dirname(self._directory)
        if not durable:
            log.warning("the daemon at %s has no durable tier (--durable-dir): steps live "
                        "only in memory, nothing is written to %s", self._options.client.daemon,
                        self._directory)
        elif os.path.realpath(durable) != os.path.realpath(parent):
            log.warning("the daemon writes durable steps to %s/%s, not to %s (its "
                        "--durable-dir is not %s)", durable, self._client.job,
                        self._directory, parent)

    def _failed(self, result) -> bool:
        """Whether ``result`` (None: nothing was pending) is a snapshot not taken; kept for
        :meth:`check_for_errors` if so."""
        failed = result is not None and not result.taken and result.copied_by is None
        if failed:
            self._errors.append(f"step {result.step}: {result.reason}")
        return failed

    def _retire(self) -> None:
        """Deletes this process's saved steps past the newest ``max_to_keep``, once a
        newer step is committed (a step is never dropped before one after it holds)."""
        keep = self._options.max_to_keep
        old = self._saved[:-keep]
        if len(old) < keep:  # a Status call per ``keep`` saves, not one per save
            return
        try:
            latest = self._client.status().latest_committed_step
        except grpc.RpcError:
            return  # retried at the next save
        for step in [s for s in old if s < latest]:
            try:
                self.delete(step)
            except grpc.RpcError:
                return


def _item(args, items, method: str, form: str):
    """The pytree of an Orbax ``args`` (``.item``) or legacy ``items``."""
    if args is not None:
        item = getattr(args, "item", None)
        if item is None:
            raise TypeError(f"CheckpointManager.{method}: args must be ocp.args.{form} "
                            f"with the state, got {type(args).__name__}")
        return item
    if items is None:
        raise TypeError(f"CheckpointManager.{method}: give args=ocp.args.{form}")
    return items
