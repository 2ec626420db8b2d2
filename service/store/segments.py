"""Shared-memory segments owned by the daemon, and a pool that reuses them.

A segment is a file in a tmpfs directory (``/dev/shm`` by default) that the
daemon maps for its whole life; the trainer maps the same file and writes its
shards into it, so a trainer crash loses nothing already written. Freed
segments go back to a pool instead of being unlinked: writing into pages that
are already allocated runs at memcpy speed, first-touch allocation is several
times slower.
"""

import errno
import itertools
import logging
import mmap
import os
import shutil
import tempfile
import threading

import numpy as np

from bubblesnap.service.errors import ResourceExhausted

log = logging.getLogger("bubblesnap.daemon")


class Segment:
    """One mapped shared-memory file."""

    def __init__(self, path: str, nbytes: int):
        self.path = path
        self.nbytes = nbytes
        self.handed_out = False  # a client may alias it: never recycle
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
    """Creates, recycles and destroys the segments in one private directory."""

    def __init__(self, shm_dir: str):
        _remove_dead_daemons(shm_dir)
        self.directory = tempfile.mkdtemp(prefix=f"bubblesnap-{os.getpid()}-", dir=shm_dir)
        self._ids = itertools.count()
        self._free: list[Segment] = []
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._free)

    def has(self, nbytes: int) -> bool:
        """Whether a pooled segment of exactly ``nbytes`` can be reused."""
        with self._lock:
            return any(seg.nbytes == nbytes for seg in self._free)

    def acquire(self, nbytes: int) -> Segment:
        """A segment of exactly ``nbytes``, reused from the pool when one fits."""
        with self._lock:
            for i, seg in enumerate(self._free):
                if seg.nbytes == nbytes:
                    return self._free.pop(i)
        # Names are counters, never job or tensor names.
        return Segment(os.path.join(self.directory, f"seg-{next(self._ids)}"), nbytes)

    def release(self, segment: Segment) -> None:
        with self._lock:
            self._free.append(segment)

    def trim(self, nbytes: int) -> int:
        """Destroys pooled segments until ``nbytes`` are freed (or the pool is empty)."""
        freed = 0
        with self._lock:
            while self._free and freed < nbytes:
                seg = self._free.pop(0)
                freed += seg.nbytes
                seg.destroy()
        return freed

    def close(self) -> None:
        self.trim(float("inf"))
        shutil.rmtree(self.directory, ignore_errors=True)


def _remove_dead_daemons(shm_dir: str) -> None:
    """Frees the segments of daemons that were killed (their pid no longer runs)."""
    for name in os.listdir(shm_dir):
        parts = name.split("-")
        if len(parts) < 2 or parts[0] != "bubblesnap" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("removing %s, left by daemon %d which is gone", name, pid)
            shutil.rmtree(os.path.join(shm_dir, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def shm_free_bytes(shm_dir: str) -> int:
    """Bytes still free in the filesystem that holds ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize
