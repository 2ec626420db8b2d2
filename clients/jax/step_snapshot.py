"""What one CheckpointManager ``save`` hands the daemon: the tensors and the step record.

Each pytree item's arrays become tensors (checkpoint_tree.py; numpy values of a
multi-process job one copy, the primary process's), JSON items and every
other leaf go into the record (bubblesnap/checkpoint_record.py), which is
the last tensor. Items no daemon can hold are saved by Orbax's own handlers
into the manager's folder now: those of other args types, and any item too
big for the record (largest first), each named in one warning.
"""

import time

import jax
import numpy as np

from bubblesnap import checkpoint_record
from bubblesnap.clients.jax import checkpoint_items, checkpoint_tree
from bubblesnap.clients.jax._layout import HostValue


class RecordTooBig(ValueError):
    """A step's record does not fit its tensor and no item of it can go elsewhere."""


class StepSnapshots:
    """Builds the saves of one manager: its options, process, folders and warnings."""

    def __init__(self, options, world_size: int, primary: bool, folders, warn_once):
        self._options, self._world, self._primary = options, world_size, primary
        self._folders, self._warn_once = folders, warn_once
        self._saver = checkpoint_tree.ItemSaver()
        self._record = np.zeros(0, np.uint8)
        self._used = 0  # bytes of the record's buffer not zero

    def build(self, step: int, to_save, metrics, custom_metadata):
        """(tensor names, leaves, record) of a save of ``to_save`` (SaveItems) as ``step``."""
        entries, tensors, texts = {}, {}, {}
        for item in to_save:
            if item.kind == "pytree":
                saved = self._saver.save(item.name, _cast(item.value, item.save_args),
                                         item.handler, item.custom_metadata)
                tensors[item.name] = (saved.names, [self._held(a) for a in saved.arrays])
                entries[item.name], texts[item.name] = saved.entry, saved.text
            elif item.kind == "json":
                entries[item.name] = {"kind": "json", "handler": item.handler,
                                      "value": item.value}
            else:
                entries[item.name] = self._save_with_orbax(step, item.name, item.value,
                                                           item.handler)
        prefix, fixed_length = self._folders.prefix, self._folders.fixed_length
        record = {"format": checkpoint_record.FORMAT, "step": step, "time": time.time(),
                  "naming": {"prefix": prefix, "fixed_length": fixed_length},
                  "items": entries, "metrics": metrics, "custom_metadata": custom_metadata or {},
                  "retention": "manager"}
        buffer = self._buffer()
        if self._primary:  # the record's bytes into the kept buffer, zeros behind them
            head = self._encode(step, record, to_save, texts)
            buffer[:len(head)] = np.frombuffer(head, np.uint8)
            buffer[len(head):self._used] = 0
            self._used = len(head)
        names, leaves = [], []
        for item in to_save:
            if record["items"][item.name]["kind"] == "pytree":  # still held in memory
                names += tensors[item.name][0]
                leaves += tensors[item.name][1]
        names.append(checkpoint_record.TENSOR)
        leaves.append(HostValue(buffer, self._primary))
        return names, leaves, record

    def _held(self, array):
        """A numpy value of a multi-process job is the job's, copied by the primary."""
        if self._world > 1 and isinstance(array, np.ndarray):
            return HostValue(array, self._primary)
        return array

    def _buffer(self) -> np.ndarray:
        """The record tensor's bytes, kept from save to save (each save copies them into
        the daemon's memory before it returns). A process that is not the primary
        declares it and copies none: the primary's record is the job's, as Orbax's
        primary host alone saves JSON."""
        if len(self._record) != self._options.record_bytes:
            self._record = np.zeros(self._options.record_bytes, np.uint8)
            self._used = 0
        return self._record

    def _encode(self, step: int, record: dict, to_save, texts: dict) -> bytes:
        capacity = self._options.record_bytes
        while True:
            try:
                return checkpoint_record.encode_head(record, capacity, {
                    name: text for name, text in texts.items()
                    if record["items"][name]["kind"] == "pytree"})
            except ValueError:
                held = [i for i in to_save if record["items"][i.name]["kind"] != "orbax"]
                if not held or self._world > 1:
                    # Processes must agree on which items Orbax's handler saves (its saves
                    # are collective): in a job of several the primary alone cannot decide.
                    raise RecordTooBig(f"step {step} not saved: its record does not fit "
                                       f"CheckpointManagerOptions.record_bytes={capacity}; "
                                       "raise it (the same in every process)") from None
                biggest = max(held, key=lambda i: len(texts.get(i.name) or
                                                      repr(record["items"][i.name])))
                self._warn_once("too-big", "item %r does not fit the %d bytes of the step "
                                "record (CheckpointManagerOptions.record_bytes): it is saved by "
                                "Orbax's own handler into the step's folder instead",
                                biggest.name, capacity)
                record["items"][biggest.name] = self._save_with_orbax(
                    step, biggest.name, checkpoint_items.as_args(biggest), biggest.handler,
                    warn=False)

    def _save_with_orbax(self, step: int, item: str, args, handler: str,
                         warn: bool = True) -> dict:
        if warn:
            self._warn_once(type(args).__name__, "%s items are saved by Orbax's own handler "
                            "into the step's folder in %s, not held in memory",
                            type(args).__name__, self._folders.directory)
        self._folders.save_item(step, item, args)
        return {"kind": "orbax", "handler": handler, "args": type(args).__name__}


def _cast(tree, save_args):
    """``tree`` with each array cast to its ``SaveArgs.dtype`` (Orbax's PyTreeSave)."""
    if save_args is None:
        return tree

    def cast(leaf, args):
        dtype = getattr(args, "dtype", None)
        return leaf.astype(dtype) if dtype is not None and hasattr(leaf, "astype") else leaf
    try:
        return jax.tree.map(cast, tree, save_args)
    except (ValueError, TypeError) as err:
        raise ValueError(f"save_args do not match the item's structure: {err}") from None
