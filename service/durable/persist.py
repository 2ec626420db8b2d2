"""A rank's committed copy written into a folder its trainer names (the Persist call): what
one process of Orbax's PyTree save writes into a CheckpointManager's item.

The folder is an item of a step Orbax's manager is saving in the trainer
(``<step>.orbax-checkpoint-tmp/<item>``): Orbax made it and Orbax finalizes it (merges
the processes' databases, renames the step) once every process's save of it is done,
so the step its policy keeps is on disk when ``wait_until_finished`` returns. The
daemon holding a rank's copy writes what that rank's process would have: its regions
into ``ocdbt.process_<rank>`` and, from the copy holding the item's record, the files
Orbax's primary host writes beside them (item_files.py). Last it writes
``.bubblesnap/rank_<rank>.json`` (the sidecar: the write is durable) or
``.bubblesnap/rank_<rank>.failed`` (why it is not); the trainer waits for one, then
removes it, so the step holds only what Orbax writes.

A target is checked before anything is kept: an absolute, normalized path whose
folder (the step being saved) exists inside the daemon's ``--durable-dir``, symbolic
links resolved, so a trainer cannot make the daemon write elsewhere.
"""

import os
import re

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.errors import FailedPrecondition, InvalidArgument, shown
from bubblesnap.shared import checkpoint_record

#: The longest folder a Persist may name.
MAX_PATH = 4096
#: How much of a path a message repeats: enough to see which folder it was.
_SHOWN = 400
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_path(path: str) -> str:
    """``path`` as a Persist names it: absolute, normalized; InvalidArgument if not."""
    if not path:
        raise InvalidArgument("Persist names no folder to write into")
    if len(path) > MAX_PATH or _CONTROL.search(path) or not path.startswith("/") or \
            os.path.normpath(path) != path or path == "/":
        raise InvalidArgument(f"Persist folder {shown(path, _SHOWN)} is not an absolute, "
                              f"normalized path of at most {MAX_PATH} characters")
    return path


def check_target(durable_dir: str, path: str) -> str:
    """The folder ``path`` resolved, once it is known to lie inside ``durable_dir`` and
    its parent exists; FailedPrecondition saying what to do otherwise."""
    check_path(path)
    if not durable_dir:
        raise FailedPrecondition(
            f"this daemon has no durable tier, so it cannot write {shown(path, _SHOWN)}: start it "
            "with --durable-dir at or above that folder")
    root = os.path.realpath(durable_dir)
    parent = os.path.realpath(os.path.dirname(path))
    if not os.path.isdir(parent):
        raise FailedPrecondition(f"{shown(os.path.dirname(path), _SHOWN)} does not exist: the step "
                                 "a Persist writes into is made by its trainer first")
    if os.path.commonpath([root, parent]) != root:
        raise FailedPrecondition(
            f"{shown(path, _SHOWN)} is outside this daemon's durable tier {shown(root, _SHOWN)} "
            "(--durable-dir): start the daemon with --durable-dir at or above it")
    return os.path.join(parent, os.path.basename(path))


def prepare(folder: str, rank: int) -> None:
    """Removes what an earlier write of ``rank`` into ``folder`` left (its database, its
    markers): a write starts whole."""
    for path in (fmt.sidecar_path(folder, rank), failed_path(folder, rank),
                 fmt.child_path(folder, rank)):
        fmt.remove(path)


def failed_path(folder: str, rank: int) -> str:
    return os.path.join(folder, checkpoint_record.failed_file(rank))


def mark_failed(folder: str, rank: int, why: str) -> None:
    """Says why ``rank``'s write into ``folder`` failed (the trainer raises it), if the
    folder is still there (its step may have been given up)."""
    if os.path.isdir(folder):
        fmt.write_bytes(failed_path(folder, rank), why[:4000].encode())
