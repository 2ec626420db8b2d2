"""A rank's committed copy written into a folder its trainer names (the Persist call): what
one process of Orbax's PyTree save writes into a CheckpointManager's item.

The folder is an item of a step Orbax's manager is saving in the trainer
(``<step>.orbax-checkpoint-tmp/<item>``): Orbax made it and Orbax finalizes it (merges
the processes' databases, renames the step) once every process's save of it is done,
so the step its policy keeps is on disk when ``wait_until_finished`` returns. The rank's
database is written aside and moved in by one rename: a trainer that stopped waiting for
this daemon (it did not answer in time) writes its part itself the same way, and
whichever rename comes first is the part; the other writer drops its own. The
daemon holding a rank's copy writes what that rank's process would have: its regions
into ``ocdbt.process_<rank>`` and, from the copy holding the item's record, the files
Orbax's primary host writes beside them (item_files.py). Last it writes
``.bubblesnap/rank_<rank>.json`` (the sidecar: the write is durable) or
``.bubblesnap/rank_<rank>.failed`` (why it is not); the trainer waits for one, then
removes it, so the step holds only what Orbax writes.

The trainer asks in the blocking part of its save, before Orbax may have made the
folder (it makes step folders in the background): the call is checked against the
nearest folder that exists (:func:`check_inside`), and the write waits for the folder
(:func:`wait_for`) and checks it whole (:func:`check_target`): an absolute, normalized
path whose folder exists inside the daemon's ``--durable-dir``, symbolic links
resolved, so a trainer cannot make the daemon write elsewhere. The write says it began
(``.bubblesnap/rank_<rank>.writing``) before any of it is there, and touches that marker
while it runs, so a daemon finishing a step whose trainer died knows a part is still
coming, and that it is not once the marker went stale (its daemon died or froze).
"""

import contextlib
import os
import re
import threading
import time

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.errors import FailedPrecondition, InvalidArgument, shown
from bubblesnap.shared import checkpoint_record

#: The longest folder a Persist may name.
MAX_PATH = 4096
#: How much of a path a message repeats: enough to see which folder it was.
_SHOWN = 400
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Where a daemon writes a part aside, in the manager's directory.
_STAGING = os.path.join(checkpoint_record.STATE_DIR, "staging")
#: Tries to create a staging folder whose parents other ranks' writes remove when empty
#: (each removal needs a write's end between two of our mkdirs: a few at most).
_MAKE_TRIES = 1000
#: Orbax's temporary folders' names end so (atomicity.TMP_DIR_SUFFIX).
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


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
    if parent == root:  # an item's folder lies in a step's, in the manager's directory
        raise FailedPrecondition(f"{shown(path, _SHOWN)} is no item folder of a step (the "
                                 "durable tier itself holds no step): Persist names "
                                 "<directory>/<step>/<item>")
    return os.path.join(parent, os.path.basename(path))


def check_inside(durable_dir: str, path: str) -> str:
    """``path`` (checked), which may not exist yet, once the nearest folder of it that
    exists is known to lie inside ``durable_dir``; FailedPrecondition saying what to do
    otherwise."""
    check_path(path)
    if not durable_dir:
        check_target(durable_dir, path)  # (raises: no durable tier)
    root = os.path.realpath(durable_dir)
    existing = path
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if os.path.commonpath([root, os.path.realpath(existing)]) != root:
        raise FailedPrecondition(
            f"{shown(path, _SHOWN)} is outside this daemon's durable tier {shown(root, _SHOWN)} "
            "(--durable-dir): start the daemon with --durable-dir at or above it")
    return path


def wait_for(folder: str, timeout: float, stopping=None) -> bool:
    """Waits, at most ``timeout`` seconds, for ``folder`` to exist (its trainer makes it,
    maybe in the background); whether it does (False also once ``stopping`` is set, or
    once the folder's step was finalized without it)."""
    deadline, pause = time.monotonic() + timeout, 0.0005
    while not os.path.isdir(folder):
        if time.monotonic() > deadline or (stopping is not None and stopping.is_set()) or \
                finalized_without(folder):
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


#: How often a write in progress touches its ``.writing`` marker, and how old the marker
#: may grow before its write counts as dead (several refreshes missed; clocks of hosts
#: sharing the folder may differ by a little of it).
WRITING_REFRESH_SECONDS, WRITING_STALE_SECONDS = 2.0, 15.0


@contextlib.contextmanager
def writing(folder: str, rank: int):
    """Says, before any of it is written, that ``rank``'s copy is being written into
    ``folder``, and goes on saying so (the marker touched) until the block ends."""
    answer(folder, checkpoint_record.writing_file(rank), b"")
    marker = os.path.join(folder, checkpoint_record.writing_file(rank))
    ended = threading.Event()

    def refresh() -> None:
        while not ended.wait(WRITING_REFRESH_SECONDS):
            try:
                os.utime(marker)
            except OSError:
                return  # the step was finalized or given up meanwhile
    alive = threading.Thread(target=refresh, name="durable-writing", daemon=True)
    alive.start()
    try:
        yield
    finally:
        ended.set()
        alive.join()


def writing_alive(marker: str, now: float | None = None) -> bool:
    """Whether the write whose ``.writing`` marker is at ``marker`` still runs: touched
    within WRITING_STALE_SECONDS."""
    try:
        age = (time.time() if now is None else now) - os.stat(marker).st_mtime
    except OSError:
        return False
    return age < WRITING_STALE_SECONDS


def answer(folder: str, name: str, data: bytes) -> None:
    """Writes ``name`` (one of the answers: ``.bubblesnap/rank_<r>.*``) into ``folder``
    whole, never making the folder again: FileNotFoundError once it is gone (its step was
    finalized without this write, or given up)."""
    path = os.path.join(folder, name)
    try:
        os.mkdir(os.path.dirname(path))
    except FileExistsError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def gone(folder: str) -> bool:
    """Whether the item ``folder`` is gone: its step finalized (or given up) meanwhile."""
    return not os.path.isdir(folder) or finalized_without(folder)


def prepare(folder: str, rank: int) -> None:
    """Removes what an earlier write of ``rank`` into ``folder`` left (its answers, its
    staging folder): a write starts whole. Never the rank's database in the folder: that
    is a finished write (its trainer's own, maybe)."""
    for path in (fmt.sidecar_path(folder, rank), failed_path(folder, rank),
                 staging_path(folder, rank)):
        fmt.remove(path)


def staging_path(folder: str, rank: int) -> str:
    """Where the daemon writes ``rank``'s database before it moves it into ``folder``: in
    the manager's directory (``<directory>/<step tmp>/<item tmp>``), outside the step, so
    that a write that outlives the step's folder (finalized meanwhile by a trainer that
    stopped waiting) never makes it again."""
    step_tmp = os.path.dirname(folder)
    return os.path.join(os.path.dirname(step_tmp), _STAGING, f"{os.path.basename(step_tmp)}."
                        f"{os.path.basename(folder)}.rank_{rank}")


def make_staging(folder: str, rank: int) -> str:
    """Creates ``rank``'s staging folder (:func:`staging_path`) and returns it. Another
    rank's :func:`move_in` removes the shared parents once they are empty, so they may
    vanish between their creation and this folder's: made again then. Once it exists
    they are not empty, and stay until it is moved in."""
    staging = staging_path(folder, rank)
    for _ in range(_MAKE_TRIES):
        try:
            os.makedirs(staging, exist_ok=True)
            return staging
        except FileNotFoundError:  # a parent removed under it: again
            continue
    raise OSError(f"could not create {staging}: its parent folders kept vanishing")


def move_in(staging: str, folder: str, rank: int) -> bool:
    """Moves ``rank``'s database written in ``staging`` into ``folder`` (one rename), and
    the staging folder goes; False when the folder holds the rank's database already
    (its trainer wrote it itself, not waiting for this daemon: the first rename wins, so
    a part is never written twice) or is gone (the step was finalized so). A rank that
    wrote no database (each of its shards a replica another process writes, as Orbax
    writes only replica 0) has nothing to move: True, as plain Orbax leaves no folder."""
    target = fmt.child_path(folder, rank)
    source = fmt.child_path(staging, rank)
    try:
        if not os.path.exists(source) and os.path.isdir(staging) and os.path.isdir(folder):
            return True
        os.rename(source, target)
        return True
    except OSError as err:
        if not os.path.isdir(folder) or (os.path.isdir(target) and os.listdir(target)):
            return False
        raise err from None
    finally:
        fmt.remove(staging)
        for empty in (os.path.dirname(staging), os.path.dirname(os.path.dirname(staging))):
            try:  # the manager's directory keeps nothing of bubblesnap's once done
                os.rmdir(empty)
            except OSError:
                break


def finalized_without(folder: str) -> bool:
    """Whether the step of the item ``folder`` was finalized (renamed) without this write."""
    step_tmp = os.path.basename(os.path.dirname(folder))
    at = step_tmp.find(_TMP_SUFFIX)
    return at > 0 and os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(folder)),
                                                 step_tmp[:at]))


def failed_path(folder: str, rank: int) -> str:
    return os.path.join(folder, checkpoint_record.failed_file(rank))


def mark_failed(folder: str, rank: int, why: str) -> None:
    """Says why ``rank``'s write into ``folder`` failed (the trainer raises it), if the
    folder is still there (its step may have been given up)."""
    try:
        answer(folder, checkpoint_record.failed_file(rank), why[:4000].encode())
    except FileNotFoundError:
        pass  # nobody waits for it
