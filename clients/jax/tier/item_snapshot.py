"""What one pytree item of a CheckpointManager's save hands its daemon: the tensors and
the item's record.

The item's arrays become tensors ``<item>/<path>`` (checkpoint_tree.py; numpy values of
a multi-process job one copy, the primary process's); everything else of the tree (its
structure, Python scalars, strings, empty nodes, shardings) goes into the item's
record (bubblesnap/shared/checkpoint_record.py), which is the last tensor: the daemon writes
Orbax's files of the item from it, and a restore from memory rebuilds the tree with it.
"""

import time

import jax
import numpy as np

from bubblesnap.clients.jax._layout import HostValue
from bubblesnap.clients.jax.tier import checkpoint_tree
from bubblesnap.shared import checkpoint_record


class RecordTooBig(ValueError):
    """An item's record does not fit its tensor (CheckpointManagerOptions.record_bytes)."""


class ItemSnapshots:
    """Builds the snapshots of one item of one manager, save after save: the record's
    buffer and the tree's leaves are kept from one save to the next."""

    def __init__(self, item: str, record_bytes: int, world_size: int, primary: bool):
        self.item = item
        self._record_bytes, self._world, self._primary = record_bytes, world_size, primary
        self._saver = checkpoint_tree.ItemSaver()
        self._buffer = np.zeros(0, np.uint8)
        self._used = 0  # bytes of the buffer not zero
        #: the bytes of the last snapshot's arrays (the global arrays' whole size)
        self.nbytes = 0

    def build(self, step: int, tree, handler: str, save_args=None, custom_metadata=None):
        """(tensor names, leaves, record) of a save of ``tree`` as ``step``; TypeError for a
        leaf Orbax's PyTree handlers cannot save, RecordTooBig."""
        saved = self._saver.save(self.item, _cast(tree, save_args), handler, custom_metadata)
        record = {"format": checkpoint_record.FORMAT, "step": step, "time": time.time(),
                  "items": {self.item: saved.entry}}
        buffer = self._record_buffer()
        if self._primary:  # the record's bytes into the kept buffer, zeros behind them
            try:
                head = checkpoint_record.encode_head(record, self._record_bytes,
                                                     {self.item: saved.text})
            except ValueError as err:
                raise RecordTooBig(
                    f"item {self.item!r}: {err}; raise CheckpointManagerOptions.record_bytes "
                    "(the same in every process)") from None
            buffer[:len(head)] = np.frombuffer(head, np.uint8)
            buffer[len(head):self._used] = 0
            self._used = len(head)
        names = [*saved.names, checkpoint_record.TENSOR]
        leaves = [*(self._held(a) for a in saved.arrays), HostValue(buffer, self._primary)]
        self.nbytes = sum(getattr(a, "nbytes", 0) for a in saved.arrays)
        return names, leaves, record

    def _held(self, array):
        """A numpy value of a multi-process job is the job's, copied by the primary."""
        if self._world > 1 and isinstance(array, np.ndarray):
            return HostValue(array, self._primary)
        return array

    def _record_buffer(self) -> np.ndarray:
        """The record tensor's bytes, kept from save to save (each save copies them into
        the daemon's memory before it returns). A process that is not the primary
        declares it and copies none: the primary's record is the job's, as Orbax's
        primary host alone writes the tree's metadata."""
        if len(self._buffer) != self._record_bytes:
            self._buffer = np.zeros(self._record_bytes, np.uint8)
            self._used = 0
        return self._buffer


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
