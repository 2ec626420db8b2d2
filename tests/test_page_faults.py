"""bubblesnap.page_faults: a mapping's pages faulted in ahead, in pieces on threads."""

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bubblesnap import page_faults


def resident_bytes(path: str) -> int:
    """Rss of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = fields[-1] == path  # a mapping's header line
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) << 10
    return total


@pytest.mark.parametrize("write", [False, True])
def test_every_page_of_a_mapping_is_faulted_in_by_pieces_on_threads(write):
    path = os.path.join("/dev/shm", f"bubblesnap-test-page-faults-{os.getpid()}-{write}")
    size = 2 * page_faults.PIECE_BYTES + (1 << 20)  # three pieces, the last one short
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
        view = np.frombuffer(mapping, dtype=np.uint8)
        assert resident_bytes(path) == 0  # nothing touched yet
        with ThreadPoolExecutor(2) as workers:
            page_faults.populate(view, workers, write=write)
        assert resident_bytes(path) == size
        assert not view.any()  # the bytes are the file's: zeros
        del view
        mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)
