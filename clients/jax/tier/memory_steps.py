"""The local tier: steps held in the daemons' memory, as a policy names them
(``tier/local_policy.py``: Orbax's emergency ``LocalCheckpointOptions``, or
``CheckpointManagerOptions.memory_interval_steps``: every N-th step, the newest
:data:`KEPT`), beside the steps the manager's own policy saves to its folder.

A local step the manager's policy does not save is held in memory only: its pytree items
copied into the daemons' memory (no round trip: the training thread's whole cost), its
other items (JSON, a data iterator's) written by their own handlers into
``<directory>/.bubblesnap/memory/<step>/<item>``, beside a record of its items and when it
was saved. A local step the manager's policy saves too gets the record and the other
items as well (its pytree items are in memory already), so that it stays local when its
folder is gone. A local step is listed by ``all_steps``/``latest_step`` while the
daemons hold every pytree item of it committed (their ``--keep`` newest steps of a job,
this host's and its neighbours' memory) and the local preservation policy keeps it;
``restore`` gives it back from memory when its folder is not on disk. It is never
written to the step folders, and Orbax's own listing (``ocp.CheckpointManager``,
``reload``'s disk view, ``metadata``, the manager's preservation policy) does not see it.
"""

import json
import logging
import os
import shutil
import time

import grpc
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_manager as orbax_manager

from bubblesnap.clients.jax.tier import item_restore
from bubblesnap.clients.jax.tier.local_policy import LocalPolicy
from bubblesnap.clients.jax.tier.memory_tier import STOCK_HANDLERS
from bubblesnap.clients.results import RestoreError
from bubblesnap.shared import checkpoint_record

#: Where the other items of steps held in memory only go, in the manager's directory.
FOLDER = os.path.join(checkpoint_record.STATE_DIR, "memory")
_LIST = "items.json"
log = logging.getLogger("bubblesnap.client")
#: ``memory_interval_steps``' local steps kept: the newest this many (more than the
#: daemons keep in memory, --keep, unless it was raised; an older step's folder removed,
#: the step is no longer listed). Counted, not asked: a save never waits for the daemon.
KEPT = 16
#: How long ``wait_until_finished`` waits for the newest local step's job commit (it takes
#: well under a second in a healthy group; a group missing a daemon may not commit it
#: until re-replication, and a training loop must not wait that out).
COMMIT_WAIT_SECONDS = 10.0


class MemorySteps:
    """The local steps of ``manager`` (its ``tier``), saved and kept as ``policy`` says."""

    def __init__(self, manager, tier, policy: LocalPolicy):
        self._manager, self._tier, self._policy = manager, tier, policy
        self._folder = os.path.join(tier.root, FOLDER)
        # the local steps this process saved and the policy keeps: (items, when)
        self._saved: dict[int, tuple[dict, float]] = {}
        self._memory_only: set[int] = set()  # those of them not saved to the folder
        self._warned = False
        # the local steps recorded before this manager (an earlier run's): read once, as
        # the primary's records of this run's steps may be ahead of this process's saves
        self._earlier: dict[int, float] = {}
        for step in _numbers(self._folder):
            record = self._record(step)
            if record is not None:
                self._earlier[step] = record[1]

    def due(self, step: int) -> bool:
        """Whether the local policy saves ``step`` (after the local steps saved so far)."""
        return self._policy.due(step, self._local(),
                                reached_preemption=self._manager.reached_preemption(step))

    def held(self) -> list[int]:
        """The local steps the policy keeps whose pytree items the daemons hold whole,
        oldest first."""
        steps, committed = [], {}
        for step in self._policy.kept(self._local()):
            items = self._items(step)
            if items is None:
                continue
            pytrees = [name for name, kind in items.items() if kind == "pytree"]
            for name in pytrees:
                if name not in committed:
                    committed[name] = self._tier.committed(self._tier.job(name))
            if all(step in committed[name] for name in pytrees):
                steps.append(step)
        self._warn_freed(steps)
        return steps

    def _warn_freed(self, held: list[int]) -> None:
        """Once: a step held in memory only that the policy keeps is gone from the daemons
        while a newer one is held: they keep fewer steps of a job (``--keep``) than the
        local tier's policy does."""
        freed = [s for s in self._memory_only if s in self._saved and held and s < held[-1]
                 and s not in held]
        if freed and not self._warned:
            self._warned = True
            log.warning("bubblesnap: the daemons no longer hold local step(s) %s of %s that "
                        "the local policy keeps: they keep fewer steps of a job than it does "
                        "(raise the daemons' --keep); those steps are not listed", freed,
                        self._tier.root)

    def save(self, step: int, args, persisted: bool = False) -> bool:
        """Saves ``step`` as a local step (pytree items into memory, unless ``persisted``:
        the manager's save of the step put them there; the others by their handlers
        beside); whether it was taken (not when the daemon could not take it)."""
        pairs = list(args.items()) if isinstance(args, ocp.args.Composite) else \
            [(orbax_manager.DEFAULT_ITEM_NAME, args)]
        folder = os.path.join(self._folder, str(step))
        if self._tier.primary:  # the folder is the primary's: another process's save of
            shutil.rmtree(folder, ignore_errors=True)  # the step may come after its record
        kinds = {}
        for name, arg in pairs:
            checkpoint_record.check_item_name(name)
            handler = self._manager._checkpointer.handler._get_or_set_handler(name, arg)
            inner = getattr(handler, "_inner", handler)
            if type(inner) in STOCK_HANDLERS and isinstance(arg, _PYTREE_SAVES):
                if not persisted and not self._tier.snapshot_in_memory(name, inner, step, arg):
                    if self._tier.primary:
                        shutil.rmtree(folder, ignore_errors=True)
                    return False
                kinds[name] = "pytree"
            else:
                if self._tier.primary:
                    with ocp.Checkpointer(inner) as checkpointer:
                        checkpointer.save(os.path.join(folder, name), args=arg, force=True)
                kinds[name] = "handler"
        when = time.time()
        self._saved[step] = (kinds, when)
        kept = set(self._policy.kept(self._local()))
        self._saved = {s: saved for s, saved in self._saved.items() if s in kept}
        self._earlier = {s: when for s, when in self._earlier.items() if s in kept}
        if not persisted:
            self._memory_only.add(step)
        self._memory_only &= kept
        if self._tier.primary:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, _LIST), "w") as f:
                json.dump({"items": kinds, "time": when}, f)
            for older in _numbers(self._folder):
                if older not in kept:
                    shutil.rmtree(os.path.join(self._folder, str(older)), ignore_errors=True)
        return True

    def wait(self) -> None:
        """Waits until the daemons hold the newest local step this process saved committed
        for the whole job (every process lists it then), at most
        :data:`COMMIT_WAIT_SECONDS`; a sick daemon is not waited for."""
        if not self._saved:
            return
        step = max(self._saved)
        for name, kind in self._saved[step][0].items():
            if kind != "pytree":
                continue
            session = self._tier.client(self._tier.job(name)).session
            if session.sick_for():  # a sick daemon is not waited for
                return
            try:
                session.wait_committed(step, min(COMMIT_WAIT_SECONDS,
                                                 session.options.commit_timeout_seconds))
            except grpc.RpcError:
                return

    def forget(self, steps) -> None:
        """``steps`` are no longer local steps (deleted, or abandoned by a rollback)."""
        for step in steps:
            self._saved.pop(step, None)
            self._earlier.pop(step, None)
            if self._tier.primary:
                shutil.rmtree(os.path.join(self._folder, str(step)), ignore_errors=True)

    def _local(self) -> list[tuple[int, float]]:
        """The local steps saved, (step, unix time) oldest first: those recorded before
        this manager and those this process saved since (every process decides on its
        own saves alike, never on the primary's records of steps it has not reached)."""
        found = dict(self._earlier)
        found.update((step, when) for step, (_, when) in self._saved.items())
        return sorted(found.items())

    def restore(self, step: int, args):
        """``step``'s items, the pytree items from the daemons' memory."""
        items = self._items(step) or {}
        if isinstance(args, ocp.args.Composite):
            pairs = list(args.items())
        elif args is not None:
            pairs = [(orbax_manager.DEFAULT_ITEM_NAME, args)]
        else:
            pairs = [(name, None) for name in items]
        out = {}
        for name, arg in pairs:
            if name not in items:
                raise KeyError(f"Item {name!r} was not found in step {step}, held in memory "
                               f"only. Available items: {sorted(items)}")
            out[name] = self._restore_item(step, name, arg, items[name])
        if not isinstance(args, ocp.args.Composite) and list(out) == [
                orbax_manager.DEFAULT_ITEM_NAME]:
            return out[orbax_manager.DEFAULT_ITEM_NAME]
        return ocp.args.Composite(**out)

    def _restore_item(self, step: int, name: str, arg, kind: str):
        if kind == "pytree":
            job = self._tier.job(name)
            record = self._tier.record(job, step)
            item_plan = item_restore.plan(name, record, arg) if record else None
            if item_plan is None:
                raise RestoreError(f"step {step} (held in memory only): item {name!r} cannot be "
                                   "restored from memory into these arguments")
            return item_restore.restore(self._tier.client(job), item_plan, step)
        handler = self._manager._checkpointer.handler._get_or_set_handler(name, arg)
        with ocp.Checkpointer(getattr(handler, "_inner", handler)) as checkpointer:
            return checkpointer.restore(os.path.join(self._folder, str(step), name), args=arg)

    def _items(self, step: int) -> dict | None:
        record = self._record(step)
        return record[0] if record is not None else None

    def _record(self, step: int) -> tuple[dict, float] | None:
        """``step``'s record: its items (name: "pytree" or "handler") and when it was
        saved (this process's own save, else the primary's record); None when there is
        none."""
        if step in self._saved:
            return self._saved[step]
        path = os.path.join(self._folder, str(step), _LIST)
        try:
            with open(path) as f:
                found = json.load(f)
            when = os.path.getmtime(path)
        except (OSError, ValueError):
            return None
        if isinstance(found, dict) and isinstance(found.get("items"), dict):
            return found["items"], float(found.get("time", when))
        return (found, when) if isinstance(found, dict) else None  # an earlier release's


_PYTREE_SAVES = (ocp.args.StandardSave, ocp.args.PyTreeSave)


def _numbers(folder: str) -> list[int]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit())
