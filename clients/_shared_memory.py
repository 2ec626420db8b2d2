"""The client's side of the daemon's shared-memory segments.

Mappings are cached by path: the daemon recycles segments, so a trainer that
snapshots every step keeps writing into the same few, already-mapped pages.
Only a handful are kept; an evicted mapping of a segment the daemon has freed
gives its memory back.

Huge pages need nothing here: on a tmpfs mounted with huge=within_size (the
daemon's Status says so: shm_page_bytes) the segment's pages are 2 MiB, the
kernel places a mapping of the file on a 2 MiB boundary, and populating it
(MAP_POPULATE, or MADV_POPULATE_READ for a restore's) maps them with huge
page-table entries (tests/test_pages.py reads ShmemPmdMapped of a restore's
mapping in /proc/self/smaps).
"""

import collections
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bubblesnap.shared import heartbeat_file, page_faults

_MAX_MAPPINGS = 6


class SegmentMaps:
    """An LRU cache of writable mappings of daemon segments.

    Thread-safe: the training thread maps segments while gRPC callback threads
    map the next step's segment as a commit returns.
    """

    def __init__(self, max_mappings: int = _MAX_MAPPINGS):
        self._maps: collections.OrderedDict[str, tuple[mmap.mmap, np.ndarray, int]] = (
            collections.OrderedDict())
        self._max = max_mappings
        self._lock = threading.Lock()

    def view(self, path: str, nbytes: int) -> np.ndarray:
        """A uint8 view of the first ``nbytes`` of the segment at ``path``."""
        with self._lock:
            return self._view(path, nbytes)

    def _view(self, path: str, nbytes: int) -> np.ndarray:
        entry = self._maps.get(path)
        if entry is not None and entry[1].nbytes >= nbytes and entry[2] == os.stat(path).st_ino:
            self._maps.move_to_end(path)
            return entry[1]
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            if size < nbytes:
                raise ValueError(f"segment {path} holds {size} bytes; the daemon said {nbytes}")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self._evict(path)
        # The inode tells a recreated file (a restarted daemon) from the one mapped before.
        self._maps[path] = (mapping, np.frombuffer(mapping, dtype=np.uint8), stat.st_ino)
        while len(self._maps) > self._max:
            self._evict(next(iter(self._maps)))
        return self._maps[path][1]

    def _evict(self, path: str) -> None:
        entry = self._maps.pop(path, None)
        if entry is not None:
            mapping, view, _ = entry
            del view, entry
            try:
                mapping.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping closes when it is dropped

    def close(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self._evict(path)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The raw bytes of an array in C order, as a flat uint8 view (a copy if not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def map_restored(path: str) -> np.ndarray:
    """A read-only view of a whole segment the daemon handed over for a restore.

    The mapping is populated up front (in the kernel, instead of a page fault
    per 4 KiB on first access), in pieces on up to half the machine's cores
    (at most 4): with 4 KiB pages, filling the page tables is what a large
    restore waits for (~75 ms a GB on one core of the dev VM, ~45 on two), and
    the daemon verifies or cuts the same bytes with its own threads meanwhile.
    It lives as long as any array viewing it, so restored arrays may alias it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = np.frombuffer(mapping, dtype=np.uint8)
    page_faults.populate(view, _mapping_workers(), write=False)
    return view


#: Threads that fault a restore's mapping in: half the cores, the daemon's work beside
#: it has the rest (on the 2-core dev VM two threads made a 4096 MB restore 16% faster
#: but a 1024 MB reshard, cut meanwhile, 7% slower).
_MAPPING_THREADS = min(4, (os.cpu_count() or 1) // 2)
_WORKERS: ThreadPoolExecutor | None = None
_WORKERS_LOCK = threading.Lock()


def _mapping_workers() -> ThreadPoolExecutor | None:
    """The threads that fault a restore's mappings in (made at the first restore); None
    where one thread is all there is: the caller's."""
    global _WORKERS
    if _MAPPING_THREADS < 2:
        return None
    with _WORKERS_LOCK:
        if _WORKERS is None:
            _WORKERS = ThreadPoolExecutor(_MAPPING_THREADS, thread_name_prefix="bubblesnap-map")
        return _WORKERS


class Heartbeat:
    """The heartbeat a daemon writes into shared memory (``bubblesnap.shared.heartbeat_file``),
    read without a call."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDONLY) if path else -1

    def read(self) -> heartbeat_file.Beat | None:
        """How the daemon is doing; None when it cannot be read (no heartbeat offered)."""
        return heartbeat_file.read(self._fd) if self._fd >= 0 else None

    def sick_for(self, silent_after: float) -> float:
        """How long the daemon has been sick: stopped or dead (the kernel says, where this
        process sees the daemon's), or, where only its clock tells, silent for longer than
        ``silent_after``; 0.0 while it runs (or with no heartbeat to read: the calls'
        deadlines tell then)."""
        beat = self.read()
        if beat is None or not (beat.stopped or (beat.stopped is None and
                                                 beat.silence > silent_after)):
            return 0.0
        return max(beat.silence, 1e-3)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close
