"""Huge pages: which pages segments get in --shm-dir, what the daemon says of it, and that a
trainer's mapping of a segment on a huge-page tmpfs is mapped with huge pages.

The pure decision is tested on crafted mount tables; the rest on real mounts:
a tmpfs mounted with huge=within_size under the test's folder (root only, as
the fault tests; skipped elsewhere, saying why), against the plain /dev/shm.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.store import pages
from bubblesnap.testing import DaemonError, DaemonProcess
from tests.helpers import mapped_bytes

_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683584k
40 25 0:40 / /dev/shm/bubblesnap rw,nosuid - tmpfs tmpfs rw,size=64g,huge=within_size
41 27 0:41 / /mnt/my\\040huge rw - tmpfs tmpfs rw,huge=always
42 27 0:42 / /mnt/advised rw - tmpfs tmpfs rw,huge=advise
43 27 0:43 / /mnt/htlb rw - hugetlbfs none rw,pagesize=1G
27 1 0:2 / / rw - ext4 /dev/vda rw
"""
MIB2 = 2 << 20


@pytest.mark.parametrize("path, filesystem, options", [
    ("/dev/shm/x", "tmpfs", "rw,size=24683584k"),
    ("/dev/shm/bubblesnap", "tmpfs", "rw,size=64g,huge=within_size"),
    ("/dev/shm/bubblesnap/alice/seg-1", "tmpfs", "rw,size=64g,huge=within_size"),
    ("/dev/shm/bubblesnapper", "tmpfs", "rw,size=24683584k"),  # a sibling, not inside
    ("/mnt/my huge/a", "tmpfs", "rw,huge=always"),
    ("/mnt/htlb", "hugetlbfs", "rw,pagesize=1G"),
    ("/home/me", "ext4", "rw"),
])
def test_the_mount_holding_a_path_is_the_longest_mount_point_above_it(path, filesystem,
                                                                       options):
    assert pages.mount_of(path, _MOUNTINFO) == (filesystem, options)


@pytest.mark.parametrize("filesystem, options, shmem_enabled, expected", [
    ("tmpfs", "rw,size=1g", "never", ("never", 4096)),
    ("tmpfs", "rw,huge=within_size", "never", ("within_size", MIB2)),
    ("tmpfs", "rw,huge=always", "always", ("always", MIB2)),
    # advise: only mappings that madvise fault huge pages; fallocate fills segments first
    ("tmpfs", "rw,huge=advise", "never", ("advise", 4096)),
    # the kernel's deny and force override every mount
    ("tmpfs", "rw,huge=within_size", "deny", ("never", 4096)),
    ("tmpfs", "rw,size=1g", "force", ("always", MIB2)),
    ("hugetlbfs", "rw,pagesize=1G", "never", ("", 1 << 30)),
    ("ramfs", "rw", "force", ("", 4096)),
])
def test_which_pages_a_segment_gets(filesystem, options, shmem_enabled, expected):
    found = pages.decide(filesystem, options, shmem_enabled, MIB2, base_page_bytes=4096)
    assert (found.huge, found.page_bytes) == expected
    assert found.huge_pages == (expected[1] > 4096)


def test_a_kernel_without_transparent_huge_pages_gives_base_pages():
    found = pages.decide("tmpfs", "rw,huge=within_size", "", 0, base_page_bytes=4096)
    assert found.page_bytes == 4096 and not found.huge_pages
    assert found.describe() == "4 KiB pages (tmpfs huge=within_size)"


def test_only_a_hugetlbfs_is_refused():
    assert "hugetlbfs" in pages.decide("hugetlbfs", "rw", "", MIB2).unusable()
    assert pages.decide("tmpfs", "rw,huge=within_size", "", MIB2).unusable() is None


def test_a_daemon_on_plain_dev_shm_says_base_pages_in_its_ready_line_and_status():
    with DaemonProcess() as daemon:
        memory = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory
        expected = pages.detect("/dev/shm")
        assert (memory.shm_filesystem, memory.shm_huge, memory.shm_page_bytes) == \
            (expected.filesystem, expected.huge, expected.page_bytes)
        assert daemon.ready["shm_page_bytes"] == memory.shm_page_bytes
        assert daemon.ready["shm_pages"] == expected.describe()
        shown = subprocess.run([sys.executable, "-m", "bubblesnap", "status", "--daemon",
                                daemon.address],
                               capture_output=True, text=True, timeout=60)
        assert expected.describe() in shown.stdout, shown


def _mount(path, options: str) -> None:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True,
                   capture_output=True)


@pytest.fixture
def huge_tmpfs(tmp_path):
    """A tmpfs mounted with huge=within_size for this test; unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if pages.decide("tmpfs", "huge=within_size", pages._sysfs_choice(
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            pages._sysfs_int("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
    ).page_bytes <= 4096:
        pytest.skip("this kernel gives tmpfs no huge pages (shmem_enabled deny, or no THP)")
    where = tmp_path / "huge"
    try:
        _mount(where, "huge=within_size,size=256m")
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot mount a tmpfs here: {err.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _restored_mapping(shm_dir: str | None) -> tuple[int, int, bool]:
    """A daemon on ``shm_dir`` (None: its own folder in /dev/shm) takes a 16 MiB snapshot and
    serves it back; the restored segment's PMD-mapped bytes in this process, the page
    size the daemon reported, and whether the bytes came back equal."""
    flags = ("--shm-dir", shm_dir) if shm_dir else ()
    with DaemonProcess(*flags, own_shm_dir=shm_dir is None) as daemon:
        client = NumpyClient("huge", options=ClientOptions(daemon=daemon.address))
        try:
            arrays = {"w": np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)}
            assert client.snapshot(1, arrays, wait=True).taken
            # the session's restore: the shards are views of the mapping itself (the
            # client's restore returns private copies, and the mapping is gone by then)
            raw = client._session.restore(None, False)
            view = raw.shards[(0, 0)].view(np.float32)
            paths = {line.split()[-1] for line in open("/proc/self/maps")
                     if line.split()[-1].startswith(daemon.shm_dir)}
            mapped = sum(mapped_bytes(p, ("ShmemPmdMapped:", "FilePmdMapped:")) for p in paths)
            same = bool(np.array_equal(view, arrays["w"]))
            page = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.shm_page_bytes
            del view, raw
        finally:
            client.close()
    return mapped, page, same


def test_a_trainer_maps_a_segment_on_a_huge_page_tmpfs_with_huge_pages(huge_tmpfs):
    mapped, page, same = _restored_mapping(str(huge_tmpfs))
    assert same and page == pages.detect(str(huge_tmpfs)).page_bytes > 4096
    # 16 MiB of float32: its whole 2 MiB pages mapped huge (the tail may not be)
    assert mapped >= 14 << 20, mapped
    plain, page, same = _restored_mapping(None)
    assert same and page == 4096 and plain == 0


def test_a_daemon_refuses_a_hugetlbfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a hugetlbfs needs root")
    where = tmp_path / "hugetlb"
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "hugetlbfs", "none", str(where)], check=True,
                       capture_output=True)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot mount a hugetlbfs here: {err.stderr.strip()}")
    try:
        with pytest.raises(DaemonError, match="hugetlbfs, which refuses write"):
            DaemonProcess("--shm-dir", str(where), own_shm_dir=False, stderr=tmp_path / "log")
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
