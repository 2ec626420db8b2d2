"""Shared-memory segments owned by the daemon, the pool that reuses them, and their directories.

A segment is a file in a tmpfs directory (``/dev/shm`` by default) that the
daemon maps for its whole life; the trainer maps the same file and writes its
shards into it, so a trainer crash loses nothing already written. Freed
segments go back to a pool instead of being unlinked: writing into pages that
are already allocated runs at memcpy speed, first-touch allocation is several
times slower.

A fresh segment is slow to fill (on the dev VM, 256 MB: ~28 ms to reserve,
then ~145 ms of faults one by one under a copy that takes ~25 ms into pages
already mapped), so the pool also keeps warm segments: made and pre-faulted
ahead of need by a background thread (warm_pool.py), taken by whatever
needs a segment no recycled one fits (a peer's copy landing, an assembled
restore, a first snapshot). A fresh segment the daemon itself is about to
fill whole (a copy landing, a restore cut or pulled into it) is pre-faulted
first, in pieces on the store's worker threads: ~38 ms for 256 MB on 2
cores (~68 ms on one).

Each daemon keeps its segments in a directory of its own,
``bubblesnap-<pid>-<random>``, and holds an exclusive ``flock`` on a
``lock`` file in it for its whole life. A directory whose pid no longer runs
(or is this process's: a container restarted under the same pid) and whose
lock nobody holds was left by a killed daemon: the pool claims it (locks it,
then renames it into one of its own names, so a daemon started at the same
moment never claims it too) for adoption.py to take the copies over. A live
daemon's directory is never touched.
"""

import errno
import fcntl
import itertools
import logging
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import Executor

import numpy as np

from bubblesnap.service import phases
from bubblesnap.service.errors import ResourceExhausted
from bubblesnap.service.store import pages
from bubblesnap.shared import page_faults

log = logging.getLogger("bubblesnap.daemon")

_PREFIX = "bubblesnap"
LOCK_NAME = "lock"
#: The last distinct sizes asked of the pool, which warm segments are made in.
_SIZES_KEPT = 4


class Segment:
    """One mapped shared-memory file."""

    def __init__(self, path: str, nbytes: int):
        """Creates the file ``path`` of ``nbytes``, its pages reserved, and maps it."""
        self.path = path
        self.nbytes = nbytes
        self.handed_out = False  # a client may alias it: never recycle
        self.faulted = False  # every page mapped in this process: writes need no fault
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: on a full tmpfs this fails with ENOSPC
            # here, instead of SIGBUS in the trainer halfway through a copy.
            os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except OSError as err:
            os.unlink(path)
            if err.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ResourceExhausted(
                    f"shared-memory directory {os.path.dirname(path)} is full: could not "
                    f"reserve {nbytes} bytes. Free snapshots, lower the retention, or give "
                    "the container a larger /dev/shm (docker --shm-size)") from err
            raise
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._map, dtype=np.uint8)

    def prefault(self, workers: Executor | None = None) -> None:
        """Faults every page in now (writable, in this mapping), so that bytes written
        later land at memcpy speed; nothing once done (bubblesnap.shared.page_faults: other
        threads run meanwhile). ``workers``: the pieces on its threads (faults scale
        with the cores); timed as the ``prefault`` phase."""
        if self.faulted:
            return
        # The view held throughout keeps the mapping alive should the segment be freed
        # meanwhile (destroy() leaves a mapping a view still uses to that view's end).
        view = self.view
        with phases.timed("prefault"):
            page_faults.populate(view, workers, write=True)
        self.faulted = True

    def shrink(self, nbytes: int) -> None:
        """Cuts the file and its mapping to its first ``nbytes``, whose pages stay faulted
        in (the tail's go back to the shm dir)."""
        del self.view
        self._map.resize(nbytes)
        self.nbytes = nbytes
        self.view = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def existing(cls, path: str) -> "Segment":
        """Maps a segment file a dead daemon made. A trainer may still map it (a copy
        it restored), so it is marked handed out: never recycled, unlinked when freed."""
        segment = cls.__new__(cls)
        segment.path, segment.handed_out, segment.faulted = path, True, True
        fd = os.open(path, os.O_RDWR)
        try:
            segment.nbytes = os.fstat(fd).st_size
            # Every page is read at once (verified): mapping them all in one call
            # costs a fraction of one page fault each.
            segment._map = mmap.mmap(fd, segment.nbytes,
                                     flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        segment.view = np.frombuffer(segment._map, dtype=np.uint8)
        return segment

    def destroy(self) -> None:
        del self.view
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive (an exception's traceback): unmapped when it dies
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SegmentPool:
    """Creates, recycles and destroys the segments in this daemon's directories."""

    def __init__(self, shm_dir: str):
        self.shm_dir = shm_dir
        #: The pages its segments get (huge pages on a tmpfs mounted huge=within_size).
        self.pages = pages.detect(shm_dir)
        self.directory = tempfile.mkdtemp(prefix=f"{_PREFIX}-{os.getpid()}-", dir=shm_dir)
        self._own_lock = _lock(self.directory)
        #: This daemon's lock file, which also carries its heartbeat (service/heartbeat.py).
        self.lock_path = os.path.join(self.directory, LOCK_NAME)
        self._claimed: dict[str, int] = {}  # dead daemons' directories taken over -> lock
        self._kept: set[str] = set()   # files in them left for a daemon that reads them
        self._ids = itertools.count()
        self._free: list[Segment] = []  # recycled: a freed copy's, exactly its size
        self._warm: list[Segment] = []  # made ahead of need, pre-faulted, never used
        self._sizes: list[int] = []     # the last distinct sizes asked, newest first
        self._doomed: list[Segment] = []  # freed, to be destroyed off the request path
        self.warm_taken = 0             # segments taken from the warm ones so far
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        """Recycled, warm and doomed segments' bytes: held, counted in the budget, unused."""
        with self._lock:
            return sum(s.nbytes for s in self._free + self._warm + self._doomed)

    @property
    def warm_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._warm)

    def warm_sizes(self) -> tuple[list[int], list[int]]:
        """The sizes of the warm segments held, and the last distinct sizes asked."""
        with self._lock:
            return [s.nbytes for s in self._warm], list(self._sizes)

    def has(self, nbytes: int) -> bool:
        """Whether a pooled segment serves ``nbytes`` without making one: a recycled one
        of exactly that size, or a warm one at least that large."""
        with self._lock:
            return any(seg.nbytes == nbytes for seg in self._free) or \
                any(seg.nbytes >= nbytes for seg in self._warm)

    def acquire(self, nbytes: int) -> Segment:
        """A segment of exactly ``nbytes``: a recycled one of that size, else the smallest
        warm one that holds it (cut to size), else a new one. Its size is remembered as
        one asked lately (the warm pool makes those)."""
        with self._lock:
            self._sizes = [nbytes, *[n for n in self._sizes if n != nbytes][:_SIZES_KEPT - 1]]
            for i, seg in enumerate(self._free):
                if seg.nbytes == nbytes:
                    return self._free.pop(i)
            fits = [seg for seg in self._warm if seg.nbytes >= nbytes]
            warm = min(fits, key=lambda seg: seg.nbytes) if fits else None
            if warm is not None:
                self._warm.remove(warm)
                self.warm_taken += 1
        if warm is None:
            return self.new_segment(nbytes)
        if warm.nbytes > nbytes:
            warm.shrink(nbytes)
        return warm

    def new_segment(self, nbytes: int) -> Segment:
        """A new segment in this daemon's directory, in no list of the pool."""
        # Names are counters, never job or tensor names.
        return Segment(os.path.join(self.directory, f"seg-{next(self._ids)}"), nbytes)

    def release(self, segment: Segment) -> None:
        # Its pages were mapped here as its copy was verified or written: recycled
        # segments are not pre-faulted again (that walk alone takes ~16 ms per 256 MB).
        segment.faulted = True
        with self._lock:
            self._free.append(segment)

    def doom(self, segment: Segment) -> None:
        """Leaves a freed segment to :meth:`reap` (unmapping and unlinking a large one
        takes tens of ms: not on a request's path, nor under the store's lock)."""
        with self._lock:
            self._doomed.append(segment)

    def reap(self) -> int:
        """Destroys the doomed segments; how many."""
        with self._lock:
            doomed, self._doomed = self._doomed, []
        for segment in doomed:
            segment.destroy()
        return len(doomed)

    def add_warm(self, segment: Segment) -> None:
        """Keeps a pre-faulted segment (warm_pool.py) for the next acquire it fits."""
        with self._lock:
            self._warm.append(segment)

    def trim(self, nbytes: int, doomed_only: bool = False) -> int:
        """Destroys pooled segments, doomed and recycled ones first, until ``nbytes`` are
        freed (or the pool is empty); ``doomed_only``: none that could be used again."""
        freed = 0
        with self._lock:
            for pooled in (self._doomed,) if doomed_only else (self._doomed, self._free,
                                                               self._warm):
                while pooled and freed < nbytes:
                    seg = pooled.pop(0)
                    freed += seg.nbytes
                    seg.destroy()
        return freed

    def claim_dead(self) -> list[str]:
        """Takes over the directories dead daemons left in the shm dir; their new paths."""
        for name in sorted(os.listdir(self.shm_dir)):
            path = os.path.join(self.shm_dir, name)
            if path == self.directory or not _left_by_dead_daemon(name):
                continue
            fd = _lock(path)
            if fd is None:  # a live daemon's (another pid namespace), or being claimed
                continue
            # Renamed onto an empty directory of this daemon's: atomic, and from now
            # on the name says who holds it (a pid that runs).
            target = tempfile.mkdtemp(prefix=f"{_PREFIX}-{os.getpid()}-", dir=self.shm_dir)
            try:
                os.rename(path, target)
            except OSError as err:
                log.warning("could not take over %s: %s", path, err)
                os.rmdir(target)
                os.close(fd)
                continue
            log.info("took over %s, left by a daemon that is gone, as %s", name, target)
            self._claimed[target] = fd
        return list(self._claimed)

    def prune(self) -> None:
        """Gives up the claimed directories that hold nothing but their lock."""
        for directory, fd in list(self._claimed.items()):
            if os.listdir(directory) == [LOCK_NAME]:
                unlink(os.path.join(directory, LOCK_NAME))
                os.rmdir(directory)
                os.close(fd)
                del self._claimed[directory]

    def keep(self, path: str) -> None:
        """Leaves the file ``path`` of a claimed directory on disk, even at close."""
        self._kept.add(path)

    def close(self) -> None:
        """Frees every segment; claimed directories keep only the files kept."""
        self.trim(float("inf"))
        shutil.rmtree(self.directory, ignore_errors=True)
        for directory, fd in self._claimed.items():
            for name in os.listdir(directory):
                path = os.path.join(directory, name)
                if path not in self._kept:
                    unlink(path)
            try:
                os.rmdir(directory)
            except OSError:
                pass  # it holds kept files: a later daemon claims it again
            os.close(fd)
        os.close(self._own_lock)


def _lock(directory: str) -> int | None:
    """The descriptor of ``directory``'s lock file, locked exclusively; None when another
    process holds the lock or the directory is gone."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _left_by_dead_daemon(name: str) -> bool:
    """Whether ``name`` is a daemon's directory whose process no longer runs (its lock,
    checked by the caller, is what proves it)."""
    parts = name.split("-")
    if len(parts) < 3 or parts[0] != _PREFIX or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return True  # this process made only its own directory, which is skipped
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def leftover_bytes(shm_dir: str) -> int:
    """Bytes held by files in the directories dead daemons left in ``shm_dir``: space a
    new daemon gets back (adopted or dropped) once it started."""
    total = 0
    for name in os.listdir(shm_dir):
        if not _left_by_dead_daemon(name):
            continue
        try:
            with os.scandir(os.path.join(shm_dir, name)) as entries:
                total += sum(entry.stat().st_blocks * 512 for entry in entries)
        except OSError:
            pass  # claimed or removed meanwhile
    return total


def unlink(path: str) -> None:
    """Removes ``path`` if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def shm_free_bytes(shm_dir: str) -> int:
    """Bytes still free in the filesystem that holds ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize
