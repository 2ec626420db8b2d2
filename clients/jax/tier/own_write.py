"""A process's part of an item written here, by Orbax, when its daemon does not answer in
time (persist_future.py): what plain Orbax would have written, moved in so that the part
is written once whoever comes first.

Orbax's handler writes the part into a folder aside (``.bubblesnap/trainer_<rank>`` in
the item's folder); its database is moved into the item's folder with one rename, the
same the daemon's own write ends with (service/durable/persist.py: ``move_in``): the
first rename is the part, and the other writer drops its own. Having won, the rest of
what Orbax wrote (its metadata files) is moved in after it and the part is answered as
a daemon answers one (the rank's sidecar), so the step is finalized once, by Orbax here
or by the daemons after a crash (saves_in_flight.py).

Only a process that writes a whole item alone does this (a job of one process): the
parts of several processes must be cut into the same chunks, which the daemons' writes
and Orbax's are not.

:class:`WriteTimes` says how long to wait first: a few times what the daemon's recent
writes of the item took, at least a floor (ClientOptions.persist_wait_*).
"""

import json
import os
import shutil

import jax
from etils import epath
from orbax.checkpoint._src import asyncio_utils

from bubblesnap.shared import checkpoint_record

#: What a daemon's write of a byte is assumed to take before one was seen (100 MB/s: a
#: slow disk), for the first wait of an item.
_FIRST_SECONDS_PER_BYTE = 1 / 100e6
#: The weight of the newest write in the running estimate.
_NEWEST = 0.5
_DATABASE = "ocdbt.process_{}"


class WriteTimes:
    """What the daemon's writes of each item took lately, and how long to wait for one."""

    def __init__(self, floor: float, factor: float):
        self._floor, self._factor = floor, factor
        self._seconds: dict[str, float] = {}

    def wrote(self, item: str, seconds: float) -> None:
        known = self._seconds.get(item)
        self._seconds[item] = seconds if known is None else \
            _NEWEST * seconds + (1 - _NEWEST) * known

    def wait(self, item: str, nbytes: int) -> float:
        """How long a save of ``item`` (``nbytes``) waits for its daemon's write."""
        expected = self._seconds.get(item, nbytes * _FIRST_SECONDS_PER_BYTE)
        return max(self._floor, self._factor * expected)


def write_part(handler, folder: str, args, rank: int, why: str) -> bool | None:
    """Orbax's ``handler`` writes ``rank``'s part of the item saved with ``args`` into
    ``folder`` (the daemon ``why``): True once it is there and answered, False when the
    daemon's write got there first, None when it cannot (the arrays were donated since
    the save: nothing to write from)."""
    if any(isinstance(leaf, jax.Array) and leaf.is_deleted()
           for leaf in jax.tree.leaves(args.item)):
        return None
    aside = os.path.join(folder, checkpoint_record.STATE_DIR, f"trainer_{rank}")
    shutil.rmtree(aside, ignore_errors=True)
    os.makedirs(aside)
    try:
        for future in asyncio_utils.run_sync(handler.async_save(epath.Path(aside),
                                                                args=args)) or ():
            future.result()
        database = _DATABASE.format(rank)
        try:
            os.rename(os.path.join(aside, database), os.path.join(folder, database))
        except OSError:
            if os.listdir(os.path.join(folder, database)):
                return False  # the daemon's write is there: it answers for the part
            raise
        _move_files(aside, folder)
        _answer(folder, rank, why)
        return True
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _move_files(aside: str, folder: str) -> None:
    """Everything else Orbax wrote aside, file by file, into the same places in
    ``folder`` (its metadata; ``array_metadatas/process_<rank>``)."""
    for path, _, names in os.walk(aside):
        target = os.path.join(folder, os.path.relpath(path, aside))
        os.makedirs(target, exist_ok=True)
        for name in names:
            os.replace(os.path.join(path, name), os.path.join(target, name))


def _answer(folder: str, rank: int, why: str) -> None:
    path = os.path.join(folder, checkpoint_record.persisted_file(rank))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump({"written_by": "trainer", "why": f"its daemon {why}"}, f)
    os.replace(f"{path}.tmp", path)
