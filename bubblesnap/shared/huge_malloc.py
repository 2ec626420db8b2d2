"""The daemon's own heap on transparent huge pages: glibc's ``glibc.malloc.hugetlb=1``.

A restore from the durable tier reads through TensorStore, which preads each chunk
into a freshly malloc'd buffer and decompresses it into another. At a restore's sizes
glibc maps those buffers anew each time, and faulting in and zeroing their 4 KiB pages
took about a quarter of the read's CPU (perf, a 1 GB restore). With the tunable, glibc
(2.35 on) madvises its mappings MADV_HUGEPAGE where the kernel's transparent huge pages
are "madvise": a fault per 2 MiB. glibc reads tunables at process start only, so
``bubblesnap daemon`` executes itself again, once, with it set (``reexec``). An
operator's own value of it in ``GLIBC_TUNABLES`` is kept (``glibc.malloc.hugetlb=0``
turns this off).
"""

import logging
import os
import re
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV = "GLIBC_TUNABLES"
TUNABLE = "glibc.malloc.hugetlb"
#: The first glibc with the tunable (older ones ignore it: no reason to execute again).
MIN_GLIBC = (2, 35)
#: Set for the process executed again: it does not execute itself a second time.
_EXECUTED = "BUBBLESNAP_EXECUTED_WITH_HUGE_MALLOC"
#: Where the kernel says whether it gives transparent huge pages to memory madvised so.
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def environment(env: Mapping[str, str], glibc: tuple[int, int] | None,
                thp_mode: str | None) -> dict[str, str] | None:
    """``env`` with the tunable added, or None when a process started with ``env`` needs
    nothing: the tunable is set there already (to any value: the operator's choice),
    the C library is not glibc >= 2.35 (``glibc``: its version, None if not glibc), or
    the kernel's transparent huge pages are not "madvise" (``thp_mode``; None: unknown):
    glibc madvises only then, "always" gives large mappings huge pages anyway."""
    tunables = env.get(ENV, "")
    if any(entry.split("=", 1)[0] == TUNABLE for entry in tunables.split(":")):
        return None
    if glibc is None or glibc < MIN_GLIBC or thp_mode != "madvise":
        return None
    return {**env, ENV: f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def this_environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """``environment`` of ``env`` on this machine's C library and kernel."""
    return environment(env, _glibc_version(), _thp_mode())


def reexec() -> None:
    """Executes this process again, the same command line, with the tunable added to
    its environment, unless it needs nothing (``environment``), it is not the
    ``bubblesnap daemon`` command (``main(["daemon", ...])`` called by another program),
    or it is the process executed so already (once: a loader that drops the tunable
    must not make it loop); returns only then, or when the exec fails (logged: the
    daemon runs on without it). The process keeps its pid, its open inheritable
    descriptors (stdin, stdout, stderr) and its parent."""
    if os.environ.pop(_EXECUTED, None) is not None or sys.argv[1:2] != ["daemon"]:
        return
    env = this_environment(os.environ)
    if env is None:
        return
    env[_EXECUTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as err:
        log.warning("could not execute again with %s=%s=1 (the durable tier's reads fault "
                    "in 4 KiB pages): %s", ENV, TUNABLE, err)


def _glibc_version() -> tuple[int, int] | None:
    try:
        found = re.fullmatch(r"glibc (\d+)\.(\d+).*", os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):  # not a GNU C library
        return None
    return (int(found[1]), int(found[2])) if found else None


def _thp_mode() -> str | None:
    try:
        with open(THP_ENABLED) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found[1] if found else None
