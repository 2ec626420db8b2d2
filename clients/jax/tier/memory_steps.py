"""Steps held in the daemons' memory only, between the steps a manager's policy keeps
(``CheckpointManagerOptions.memory_interval_steps``): the local tier of Orbax's
emergency manager, asked for.

Every N-th step the policy does not save is snapshotted all the same: its pytree items
into the daemons' memory (a copy, no round trip: the training thread's whole cost),
its other items (JSON, a data iterator's) by their own handlers into
``<directory>/.bubblesnap/memory/<step>/<item>``, beside a list of its items. Such a
step is listed by ``all_steps``/``latest_step`` (and ``should_save`` says it is due)
while the daemons hold every pytree item of it (their ``--keep`` newest steps of a
job, this host's and its neighbours' memory) and it is among the newest
:data:`KEPT`, and ``restore`` gives it back from there; it is never written to the
step folders, and Orbax's own listing (``ocp.CheckpointManager``, ``reload``'s disk
view, ``metadata``, the preservation policies) does not see it.
"""

import json
import os
import shutil

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_manager as orbax_manager

from bubblesnap.clients.jax.tier import item_restore
from bubblesnap.clients.jax.tier.memory_tier import STOCK_HANDLERS
from bubblesnap.clients.results import RestoreError
from bubblesnap.shared import checkpoint_record

#: Where the other items of steps held in memory only go, in the manager's directory.
FOLDER = os.path.join(checkpoint_record.STATE_DIR, "memory")
_LIST = "items.json"
#: The folders of steps held in memory only that are kept: the newest this many (more
#: than the daemons keep in memory, --keep, unless it was raised; an older step's folder
#: removed, the step is no longer listed). Counted, not asked: a save never waits for
#: the daemon.
KEPT = 16


class MemorySteps:
    """The steps held in memory only of ``manager`` (its ``tier``), every ``interval``."""

    def __init__(self, manager, tier, interval: int):
        self._manager, self._tier, self._interval = manager, tier, interval
        self._folder = os.path.join(tier.root, FOLDER)

    def due(self, step: int) -> bool:
        return step % self._interval == 0

    def held(self) -> list[int]:
        """The steps held in memory only that the daemons hold whole, oldest first."""
        steps, committed = [], {}
        for step in _numbers(self._folder):
            items = self._items(step)
            if items is None:
                continue
            pytrees = [name for name, kind in items.items() if kind == "pytree"]
            for name in pytrees:
                if name not in committed:
                    committed[name] = self._tier.committed(self._tier.job(name))
            if all(step in committed[name] for name in pytrees):
                steps.append(step)
        return steps

    def save(self, step: int, args) -> bool:
        """Snapshots ``step``'s items (pytree items into memory, the others by their
        handlers beside); whether it was taken (not when the daemon could not take it)."""
        pairs = list(args.items()) if isinstance(args, ocp.args.Composite) else \
            [(orbax_manager.DEFAULT_ITEM_NAME, args)]
        folder = os.path.join(self._folder, str(step))
        shutil.rmtree(folder, ignore_errors=True)
        kinds = {}
        for name, arg in pairs:
            checkpoint_record.check_item_name(name)
            handler = self._manager._checkpointer.handler._get_or_set_handler(name, arg)
            inner = getattr(handler, "_inner", handler)
            if type(inner) in STOCK_HANDLERS and isinstance(arg, _PYTREE_SAVES):
                if not self._tier.snapshot_in_memory(name, inner, step, arg):
                    shutil.rmtree(folder, ignore_errors=True)
                    return False
                kinds[name] = "pytree"
            else:
                if self._tier.primary:
                    with ocp.Checkpointer(inner) as checkpointer:
                        checkpointer.save(os.path.join(folder, name), args=arg, force=True)
                kinds[name] = "handler"
        if self._tier.primary:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, _LIST), "w") as f:
                json.dump(kinds, f)
            for older in _numbers(self._folder)[:-KEPT]:
                shutil.rmtree(os.path.join(self._folder, str(older)), ignore_errors=True)
        return True

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
        try:
            with open(os.path.join(self._folder, str(step), _LIST)) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None


_PYTREE_SAVES = (ocp.args.StandardSave, ocp.args.PyTreeSave)


def _numbers(folder: str) -> list[int]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit())
