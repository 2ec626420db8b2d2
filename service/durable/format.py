"""The durable tier's files: one Orbax checkpoint per step, written by several daemons.

A step of one of bubblesnap's own jobs (``SnapshotClient``) is written in
``<directory>/<job>/.bubblesnap/partial/<step>/`` and, once whole and finalized,
renamed to ``step_<step>``: one standard Orbax checkpoint of the job's global state
(orbax_layout.py says where each tensor goes, and
``orbax.checkpoint.StandardCheckpointer().restore(path, target)`` loads it with no
daemon, in any topology). Plain Orbax never sees a step being written. On an object
store (storage/: no rename) a step is written at its final name ``step_<step>`` and
counts only once its marker is there; Orbax's own readers on GCS count only steps with
``commit_success.txt``, written just before the marker. (A
CheckpointManager's items are written where its manager says, and Orbax finalizes
them: persist.py.) Inside a step:

- ``ocdbt.process_<r>/``: the regions written for rank ``r`` by the daemon
  holding its copy (Orbax's per-process database, one per writer, so writers
  never share a file);
- ``.bubblesnap/rank_<r>.json``: that write's sidecar (sidecar.py), written
  atomically once its regions are durable;
- once the sidecars make a whole step, the daemon that sees it finalizes:
  Orbax's merged ``manifest.ocdbt`` and ``d/``, ``_METADATA``,
  ``_CHECKPOINT_METADATA``, ``commit_success.txt``, and last
  ``.bubblesnap/complete.json``; then the rename. Only steps with that
  marker are listed, whatever their folder's name.

Orbax and JAX are imported on first use: a daemon without ``--durable-dir``
does not need them.
"""

import json
import posixpath
import re
import time

import numpy as np

from bubblesnap.service.checks import is_folder_job
from bubblesnap.service.durable import storage
from bubblesnap.service.durable.sidecar import FORMAT, WrittenRank
from bubblesnap.service.durable.storage.objects import StoreError
from bubblesnap.service.errors import DataLoss, NotFound, Unavailable
from bubblesnap.shared import checkpoint_record

#: A step folder's name: Orbax's ``<prefix>_<step>`` (zero padded or not) or the bare number.
_STEP_DIR = re.compile(r"(?:.+_)?(\d+)")
_SIDECAR = re.compile(r"rank_(\d+)\.json")
STATE_DIR = checkpoint_record.STATE_DIR
MARKER = "complete.json"
#: Where a job's steps are written until they are whole.
PARTIAL_DIR = f"{STATE_DIR}/partial"
#: Orbax's prefix of a per-process OCDBT database (ocdbt_process_spec.PROCESS_PREFIX).
CHILD_PREFIX = "ocdbt.process_"
#: The folder name of a finalized step of bubblesnap's own clients: ``step_<k>``.
STEP_PREFIX = "step"


def job_path(directory: str, job: str) -> str:
    """The folder of one of bubblesnap's own jobs (never a job named by a folder: a
    CheckpointManager's, whose steps are its own)."""
    if is_folder_job(job):
        raise ValueError(f"job {job!r} is named by its folder; the durable tier does not "
                         "write it by its own policy")
    return posixpath.join(directory, job)


def final_path(directory: str, job: str, step: int) -> str:
    """The folder ``step`` is published as."""
    return posixpath.join(job_path(directory, job), f"{STEP_PREFIX}_{step}")


def partial_path(directory: str, job: str, step: int) -> str:
    """Where ``step`` is written until it is whole and finalized: a folder of its own
    where the storage renames, else its final folder (listed once marked)."""
    if not storage.at(directory).renames:
        return final_path(directory, job, step)
    return posixpath.join(directory, job, PARTIAL_DIR, str(step))


def finalized_steps(directory: str, job: str) -> dict[int, str]:
    """step -> folder of every finalized step of ``job`` (marked whole; none for a job
    named by a folder). A POSIX folder's listing is read again only when it changed
    (its mtime), an object store's every time; each marker is looked at every time."""
    if is_folder_job(job):
        return {}
    root = job_path(directory, job)
    where = storage.at(root)
    changed = where.stamp(root)
    cached = _LISTINGS.get(root)
    if changed is None or cached is None or cached[0] != changed \
            or cached[0] >= cached[2] - _RACY_NS:
        listed_at = time.time_ns()
        names = {}
        for name in where.names(root):
            match = _STEP_DIR.fullmatch(name)
            if match:
                names.setdefault(int(match[1]), []).append(posixpath.join(root, name))
        cached = (changed, names, listed_at)
        if changed is not None:
            _LISTINGS[root] = cached
        if len(_LISTINGS) > 4096:
            _LISTINGS.clear()
    found = {}
    for step, paths in cached[1].items():
        marked = [p for p in sorted(paths) if is_finalized(p)]
        if marked:
            found[step] = marked[0]
    return found


#: job folder -> (its mtime, step -> folders named for it, when it was listed):
#: finalized_steps' listing.
_LISTINGS: dict[str, tuple[int, dict[int, list[str]], int]] = {}
#: A listing taken this soon after the folder's last change is not trusted (read again
#: next time, as git treats a "racily clean" index): the kernel stamps mtimes from a
#: coarse clock (a tick of milliseconds), so a step renamed in during the same tick as
#: the listing leaves the mtime as it was, and the step would stay unseen for good.
_RACY_NS = 2_000_000_000


def jobs(directory: str) -> list[str]:
    """The jobs with a folder in the tier."""
    return sorted(storage.at(directory).names(directory, folders=True))


def partial_steps(directory: str, job: str) -> list[int]:
    """Steps being written (or finalized, not yet renamed), oldest first: on an object
    store, the step folders not marked whole."""
    if is_folder_job(job):
        return []
    root = job_path(directory, job)
    where = storage.at(root)
    if not where.renames:
        return sorted(int(m[1]) for m in map(_STEP_DIR.fullmatch,
                                             where.names(root, folders=True))
                      if m and not is_finalized(posixpath.join(root, m[0])))
    partial = posixpath.join(root, PARTIAL_DIR)
    return sorted(int(n) for n in where.names(partial, folders=True) if n.isdigit())


def step_path(directory: str, job: str, step: int) -> str:
    """The folder of ``step``: its finalized one, else where it is being written."""
    return finalized_steps(directory, job).get(step) or partial_path(directory, job, step)


def step_numbers(directory: str, job: str) -> list[int]:
    """Steps with a folder, finalized or being written, oldest first."""
    return sorted(set(partial_steps(directory, job)) | set(finalized_steps(directory, job)))


def publish(partial: str, target: str) -> str | None:
    """Renames a finalized step from where it was written to its folder ``target``;
    None once it is there (also when another daemon put it there first, or it was
    written there: an object store), else why not."""
    if partial == target:
        return None
    where = storage.at(target)
    try:
        where.rename(partial, target)
    except OSError as err:
        if is_finalized(target):  # another daemon finalized it first: ours is the same
            remove(partial)
            return None
        if where.holds_any(target):
            return f"{target} exists and is not a step bubblesnap wrote"
        return f"renaming it to {target} failed: {err}"
    return None


def child_path(step_dir: str, rank: int) -> str:
    """Where the regions written for ``rank`` go: Orbax's process database named by rank."""
    return posixpath.join(step_dir, f"{CHILD_PREFIX}{rank}")


def sidecar_path(step_dir: str, rank: int) -> str:
    return posixpath.join(step_dir, STATE_DIR, f"rank_{rank}.json")


def marker_path(step_dir: str) -> str:
    return posixpath.join(step_dir, STATE_DIR, MARKER)


def written_ranks(step_dir: str) -> list[int]:
    """Ranks of a step whose sidecar is written (finished writes)."""
    return sorted(int(m[1]) for m in map(_SIDECAR.fullmatch,
                                         _listdir(posixpath.join(step_dir, STATE_DIR))) if m)


def child_ranks(step_dir: str) -> list[int]:
    """Ranks with a process database in the step (finished writes or not)."""
    return sorted(int(name[len(CHILD_PREFIX):]) for name in _listdir(step_dir)
                  if name.startswith(CHILD_PREFIX) and name[len(CHILD_PREFIX):].isdigit())


def read_json(path: str) -> dict:
    """A JSON file of the tier; NotFound when absent, DataLoss when unreadable."""
    try:
        return json.loads(storage.at(path).read(path))
    except FileNotFoundError as err:
        raise NotFound(f"the durable tier has no {path}") from err
    except StoreError as err:
        raise Unavailable(f"the durable tier did not answer for {path}: {err}") from err
    except (OSError, ValueError) as err:
        raise DataLoss(f"{path} is unreadable: {err}") from err


def write_json(path: str, data: dict) -> None:
    """Writes ``path`` whole or not at all (storage.Storage.write), so a reader (or a
    second daemon writing the same file) never sees half of it."""
    write_bytes(path, json.dumps(data).encode())


def write_bytes(path: str, data: bytes) -> None:
    storage.at(path).write(path, data)


def read_sidecar(step_dir: str, rank: int) -> WrittenRank:
    """The sidecar of ``rank``'s write; NotFound, or DataLoss when it is not one."""
    path = sidecar_path(step_dir, rank)
    try:
        return WrittenRank.from_json(read_json(path))
    except (KeyError, TypeError, ValueError) as err:
        raise DataLoss(f"{path} is not a {FORMAT} sidecar: {err}") from err


def is_finalized(step_dir: str) -> bool:
    return storage.at(step_dir).exists(marker_path(step_dir))


def remove_rank(step_dir: str, rank: int) -> None:
    """Removes what was written for ``rank``: the sidecar first (the write no longer
    counts), then its regions."""
    remove(sidecar_path(step_dir, rank))
    remove(child_path(step_dir, rank))


def remove(path: str) -> None:
    """Removes a file, or a folder and all it holds."""
    storage.at(path).remove(path)


def numpy_dtype(name: str) -> np.dtype:
    import ml_dtypes  # bfloat16 and float8, which numpy lacks (a dependency of JAX)

    return np.dtype(getattr(ml_dtypes, name, name))


def orbax():
    """orbax.checkpoint, imported on first use; ImportError saying what to install."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError("the durable tier writes through Orbax: pip install "
                          "'bubblesnap[jax]' (orbax-checkpoint) on this host") from err
    return ocp


def _listdir(path: str) -> list[str]:
    return storage.at(path).names(path)
