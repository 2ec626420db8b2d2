"""bubblesnap.shared.page_faults: a mapping's pages faulted in ahead, in pieces on threads."""

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bubblesnap.shared import page_faults
from tests.helpers import mapped_bytes


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
        assert mapped_bytes(path, ("Rss:",)) == 0  # nothing touched yet
        with ThreadPoolExecutor(2) as workers:
            page_faults.populate(view, workers, write=write)
        assert mapped_bytes(path, ("Rss:",)) == size
        assert not view.any()  # the bytes are the file's: zeros
        del view
        mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)
