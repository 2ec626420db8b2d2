"""Faulting a mapping's pages in before its bytes are used, in pieces that several threads
fault at once: madvise(2)'s MADV_POPULATE_READ and _WRITE (Linux 5.14), called through
ctypes so that other threads run meanwhile (``mmap.madvise`` keeps the GIL). The daemon
pre-faults the segments it will write; the client, the segments a restore answers with."""

import ctypes
import mmap
from concurrent.futures import Executor

import numpy as np

#: Python's mmap names them from 3.13 on.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: The piece one thread faults in at a time (a multiple of 2 MiB pages).
PIECE_BYTES = 32 << 20

_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


def populate(view: np.ndarray, workers: Executor | None, write: bool) -> None:
    """Faults in every page of ``view`` (a uint8 view of a shared mapping; writable in
    this mapping with ``write``), a piece per task on ``workers`` (None: here, one
    after another). Where the kernel lacks MADV_POPULATE_*, one byte per page is
    written (``write``: the zeros a fresh segment holds) or read instead."""
    starts = range(0, view.nbytes, PIECE_BYTES)
    if workers is None or len(starts) < 2:
        for start in starts:
            _populate_piece(view, start, write)
    else:
        list(workers.map(lambda start: _populate_piece(view, start, write), starts))


def _populate_piece(view: np.ndarray, start: int, write: bool) -> None:
    end = min(start + PIECE_BYTES, view.nbytes)
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    if _madvise(view.ctypes.data + start, end - start, advice) == 0:
        return
    if write:
        view[start:end:mmap.PAGESIZE] = 0
    else:
        int(view[start:end:mmap.PAGESIZE].max())
