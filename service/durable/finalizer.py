"""Finalizing a step the durable tier wrote, and giving it its folder.

A step of bubblesnap's own clients is written in ``<job>/.bubblesnap/partial/<step>/``.
Once its sidecars make it whole, one daemon at a time (the one holding the folder's
lock, ``.bubblesnap/finalizing``, created only if absent: ``O_EXCL`` on a filesystem,
a conditional PUT on an object store; a lock older than :data:`STALE_LOCK_SECONDS`, by
its mtime or the store's LastModified, is taken over) finalizes it there (Orbax's
merge and metadata, the completion marker last) and renames it to ``step_<k>`` (on an
object store it was written there: the marker publishes it). A step
finalized whose rename was cut short (the daemon died between the two) is renamed by
any daemon that finds it (:meth:`Finalizer.publish_unpublished`, at start and every
recheck). A finalized step rewritten with another copy of a rank is taken back first
(:func:`reopen`): the other ranks' writes stay. A step after the one a job went back to
(:meth:`Finalizer.fence`, a rollback) is an abandoned run's: never published after. (A
CheckpointManager's steps are Orbax's to finalize: persist.py.)
"""

import json
import logging
import os
import posixpath
import threading
import time
import uuid

from bubblesnap.service.durable import checkpoint, policy, storage
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.errors import DaemonError

log = logging.getLogger("bubblesnap.daemon")

#: A finalizer's lock this old is taken to be a dead daemon's (a finalize takes seconds).
STALE_LOCK_SECONDS = 300.0
_LOCK = "finalizing"
#: What finalizing adds to the step's folder: taken back by reopen.
_FINALIZED_FILES = ("manifest.ocdbt", "d", "_METADATA", "_sharding", "_strings.json",
                    "array_metadatas", "commit_success.txt", "_CHECKPOINT_METADATA")


class Finalizer:
    """Finalizes and publishes the steps of the tier in ``directory``."""

    def __init__(self, directory: str, reader):
        self.directory, self._reader = directory, reader
        # job -> (the step it went back to, when): its later steps written before then
        self._fences: dict[str, tuple[int, float]] = {}
        self._fence_lock = threading.Lock()

    def fence(self, job: str, step: int) -> None:
        """The job went back to ``step`` now (a rollback): a later step written before is
        an abandoned run's, never published from now on (one whose publication is under
        way completes first: the rollback's discard deletes it after)."""
        with self._fence_lock:
            self._fences[job] = (step, time.time())

    def abandoned(self, job: str, step: int, started: float | None = None) -> bool:
        """Whether ``step`` of ``job`` is an abandoned run's: after the step a rollback
        went back to, and written before it (every rank's sidecar older; ``started``: a
        write of this daemon that began then)."""
        fence = self._fences.get(job)
        if fence is None or step <= fence[0]:
            return False
        if started is not None:
            return started < fence[1]
        partial = fmt.partial_path(self.directory, job, step)
        where = storage.at(partial)
        written = [where.modified(fmt.sidecar_path(partial, rank))
                   for rank in fmt.written_ranks(partial)]
        return all(at is not None and at < fence[1] for at in written)

    def finish(self, job: str, step: int, by_rank: int) -> str | None:
        """Finalizes and publishes ``step`` if it is whole: None once it has its folder
        (or was discarded), else why not yet."""
        partial = fmt.partial_path(self.directory, job, step)
        if not storage.at(partial).holds_any(partial):
            return None
        if self.abandoned(job, step):
            fmt.remove(partial)  # an abandoned run's, finished as its rollback came
            return None
        final = fmt.finalized_steps(self.directory, job).get(step)
        if final is not None and final != partial:
            fmt.remove(partial)  # left by a daemon that died as another one published it
            return None
        lock = _Lock(partial)
        if not lock.take():
            return "another daemon is finalizing it"
        try:
            if not fmt.is_finalized(partial):
                written = self._reader.sidecars(job, step)
                why = policy.incomplete(written)
                if why is not None:
                    return why
                checkpoint.finalize(partial, written, by_rank)
            return self._publish(job, step, partial, lock)
        finally:
            lock.release()

    def publish_unpublished(self) -> None:
        """Publishes every step finalized whose rename was cut short, of every job (none on
        an object store: a step is published where it is written)."""
        if not storage.at(self.directory).renames:
            return
        for job in fmt.jobs(self.directory):
            for step in fmt.partial_steps(self.directory, job):
                partial = fmt.partial_path(self.directory, job, step)
                if fmt.is_finalized(partial):
                    try:
                        why = self.finish(job, step, -1)
                    except (DaemonError, OSError, ValueError) as err:
                        why = str(err)
                    if why is not None:
                        log.info("durable: step %d of %s, finalized, is not published yet: "
                                 "%s", step, job, why)

    def _publish(self, job: str, step: int, partial: str, lock) -> str | None:
        target = fmt.final_path(self.directory, job, step)
        with self._fence_lock:  # published before a rollback's fence, or never
            if self.abandoned(job, step):
                fmt.remove(partial)
                return None
            why = fmt.publish(partial, target)
        if why is None:
            lock.moved_to(target)
            log.info("durable: step %d of %s is one Orbax checkpoint, published as %s", step,
                     job, target)
        elif storage.at(target).holds_any(target):
            log.warning("durable: step %d of %s stays unlisted: %s", step, job, why)
            return None
        return why


def reopen(step_dir: str) -> None:
    """Takes back a finalized step (in its partial folder) so a rank can be written again:
    the marker first, then what finalizing added to its folder; the other ranks' writes
    stay."""
    fmt.remove(fmt.marker_path(step_dir))
    for name in _FINALIZED_FILES:
        fmt.remove(posixpath.join(step_dir, name))


class _Lock:
    """The folder's finalizing lock: a file created only if absent, naming its holder."""

    def __init__(self, step_dir: str):
        self._path = posixpath.join(step_dir, fmt.STATE_DIR, _LOCK)
        self._storage = storage.at(step_dir)
        self._owner = f"{os.getpid()}-{uuid.uuid4().hex}"
        self._held = False

    def take(self) -> bool:
        if not self._storage.holds_any(posixpath.dirname(self._path)):
            return False  # the folder is gone: nothing to finalize here
        owner = json.dumps({"owner": self._owner}).encode()
        for _ in range(2):
            if self._storage.create(self._path, owner):
                self._held = True
                return True
            written = self._storage.modified(self._path)
            if written is None:
                continue  # released meanwhile
            if time.time() - written < STALE_LOCK_SECONDS:
                return False
            fmt.remove(self._path)  # its holder died
        return False

    def moved_to(self, step_dir: str) -> None:
        """The folder was renamed: the lock went with it (released there)."""
        self._path = posixpath.join(step_dir, fmt.STATE_DIR, _LOCK)

    def release(self) -> None:
        """Removes the lock if it is still this holder's (one taken over as stale since
        stays its new holder's)."""
        if self._held:
            self._held = False
            try:
                if json.loads(self._storage.read(self._path)).get("owner") != self._owner:
                    return
            except (OSError, ValueError):
                return
            fmt.remove(self._path)

