"""Which pages segments get in the shared-memory directory: huge pages where it has them.

A segment of a few GB mapped with 4 KiB pages costs a page-table entry per
4 KiB: mapping 256 MB that way takes 15-25 ms on the dev VM (MAP_POPULATE),
with 2 MiB pages 0.1 ms, and every copy through it misses the TLB less. A
tmpfs gives its files transparent huge pages when it is mounted with
``huge=within_size`` (or ``huge=always``): the daemon reserves a segment's
pages with ``posix_fallocate``, which then allocates them 2 MiB at a time,
and the kernel places every mapping of such a file on a 2 MiB boundary, so
the trainer's ordinary ``mmap`` of it (``clients/_shared_memory.py``) is
mapped with huge page-table entries (``ShmemPmdMapped`` in its smaps).
``huge=advise`` gives huge pages only to mappings that ask (madvise) when
they fault, but segments are filled by ``fallocate`` before any mapping:
base pages. The kernel's ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
overrides every mount when it says ``deny`` (none) or ``force`` (all); its
other values only concern the kernel's internal mount (SysV shm, memfd).

A hugetlbfs cannot hold the daemon's directory: it refuses ``write(2)``,
which the copy records beside segments (persistence.py) and the heartbeat in
the lock file use, and it needs pages reserved ahead (``nr_hugepages``).
The daemon refuses it at start (``unusable``).

``decide`` is pure; ``detect`` reads /proc/self/mountinfo and sysfs.
"""

import dataclasses
import mmap
import os

_THP = "/sys/kernel/mm/transparent_hugepage"
#: tmpfs huge= values that give a segment filled by fallocate huge pages.
_HUGE_FOR_SEGMENTS = ("always", "within_size")


@dataclasses.dataclass(frozen=True)
class SharedPages:
    """The pages of ``--shm-dir``: its filesystem (``tmpfs``, ``ramfs``, ...), a tmpfs
    mount's ``huge=`` option as the kernel applies it (``never``, ``always``,
    ``within_size``, ``advise``; ``""`` for other filesystems) and the size of the
    pages segments get: the huge page size where they get huge pages, else the base
    page size."""

    filesystem: str
    huge: str
    page_bytes: int

    @property
    def huge_pages(self) -> bool:
        return self.page_bytes > mmap.PAGESIZE

    def describe(self) -> str:
        """One line for logs and ``bubblesnap status``: e.g. "2 MiB pages (tmpfs
        huge=within_size)"."""
        size = f"{self.page_bytes >> 20} MiB" if self.page_bytes >= 1 << 20 else \
            f"{self.page_bytes >> 10} KiB"
        option = f" huge={self.huge}" if self.huge else ""
        return f"{size} pages ({self.filesystem}{option})"

    def unusable(self) -> str | None:
        """Why the daemon cannot keep its segments here, or None."""
        if self.filesystem == "hugetlbfs":
            return ("--shm-dir is on a hugetlbfs, which refuses write(2): the records beside "
                    "segments and the heartbeat could not be written. For huge pages use a "
                    "tmpfs mounted with huge=within_size (deploy/systemd/"
                    "dev-shm-bubblesnap.mount)")
        return None


def mount_of(path: str, mountinfo: str) -> tuple[str, str]:
    """The filesystem type and super-block options of the mount that holds ``path`` (a
    real path), from the text of /proc/self/mountinfo: the longest mount point that is
    ``path`` or one of its parents; the last one listed wins (a mount over a mount)."""
    best, found = "", ("unknown", "")
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, found = point, (fields[dash + 1], fields[dash + 3])
    return found


def decide(filesystem: str, options: str, shmem_enabled: str, huge_page_bytes: int,
           base_page_bytes: int = mmap.PAGESIZE) -> SharedPages:
    """The pages a segment gets on a mount of ``filesystem`` with super-block
    ``options`` (comma-separated), given the kernel's shmem_enabled choice and its
    huge page size (0: no transparent huge pages)."""
    values = dict(o.split("=", 1) if "=" in o else (o, "") for o in options.split(","))
    if filesystem == "hugetlbfs":
        size = _parse_size(values.get("pagesize", "")) or huge_page_bytes or base_page_bytes
        return SharedPages(filesystem, "", size)
    if filesystem != "tmpfs":
        return SharedPages(filesystem, "", base_page_bytes)
    huge = values.get("huge", "never")
    if shmem_enabled in ("deny", "force"):
        huge = "never" if shmem_enabled == "deny" else "always"
    gets_huge = huge in _HUGE_FOR_SEGMENTS and huge_page_bytes > base_page_bytes
    return SharedPages(filesystem, huge, huge_page_bytes if gets_huge else base_page_bytes)


def detect(path: str) -> SharedPages:
    """The pages segments get in directory ``path`` on this machine."""
    try:
        with open("/proc/self/mountinfo") as f:
            filesystem, options = mount_of(os.path.realpath(path), f.read())
    except OSError:
        filesystem, options = "unknown", ""
    return decide(filesystem, options, _sysfs_choice(f"{_THP}/shmem_enabled"),
                  _sysfs_int(f"{_THP}/hpage_pmd_size"))


def _sysfs_choice(path: str) -> str:
    """The bracketed choice of a sysfs file like "always [never] deny" ("" if none)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, stop = text.find("["), text.find("]")
    return text[start + 1:stop] if 0 <= start < stop else ""


def _sysfs_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def _parse_size(text: str) -> int:
    """A hugetlbfs pagesize= option ("2M", "1G", "2097152") in bytes; 0 if unreadable."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text[-1:].upper() in units:
            return int(text[:-1]) * units[text[-1].upper()]
        return int(text)
    except ValueError:
        return 0


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
