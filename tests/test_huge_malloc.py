"""The daemon's heap on transparent huge pages: the environment decided, and a real
``bubblesnap daemon`` executing itself again with glibc's tunable (or keeping an
operator's value of it)."""

import re

import pytest

from bubblesnap.shared import huge_malloc
from bubblesnap.shared.huge_malloc import environment

ON = "glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("env, expected", [
    ({}, ON),
    ({"GLIBC_TUNABLES": ""}, ON),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, f"glibc.malloc.arena_max=2:{ON}"),
])
def test_the_tunable_is_added_beside_the_operators_others(env, expected):
    got = environment({"PATH": "/bin", **env}, (2, 36), "madvise")
    assert got == {"PATH": "/bin", "GLIBC_TUNABLES": expected}


@pytest.mark.parametrize("env, glibc, thp", [
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise"),  # the operator's no
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"}, (2, 36), "always"),
    ({}, (2, 34), "madvise"),  # a glibc without the tunable
    ({}, None, "madvise"),  # not glibc (musl, say)
    ({}, (2, 36), "never"),  # no transparent huge pages from this kernel
    ({}, (2, 36), "always"),  # huge pages without asking: glibc would not madvise
    ({}, (2, 36), None),  # no word from the kernel
])
def test_nothing_to_do_keeps_the_environment_as_it_is(env, glibc, thp):
    assert environment(env, glibc, thp) is None


def test_a_tunable_that_only_starts_with_the_name_is_another_one():
    got = environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlbx=1"}, (2, 36), "madvise")
    assert got == {"GLIBC_TUNABLES": f"glibc.malloc.hugetlbx=1:{ON}"}


def _tunables_of(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        for entry in f.read().split(b"\0"):
            if entry.startswith(b"GLIBC_TUNABLES="):
                return entry.split(b"=", 1)[1].decode()
    return None


def _hugepage_advised_bytes(pid: int) -> int:
    """Bytes of ``pid``'s mappings madvised MADV_HUGEPAGE (``hg`` in smaps' VmFlags)."""
    total = 0
    with open(f"/proc/{pid}/smaps") as f:
        size = 0
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and " hg" in line:
                total += size
    return total


needs_it = pytest.mark.skipif(
    huge_malloc.this_environment({}) is None,
    reason="glibc < 2.35, not glibc, or transparent huge pages not 'madvise'")


@needs_it
def test_the_daemon_executes_itself_again_with_the_tunable_and_serves(start_daemon):
    daemon = start_daemon(env={"GLIBC_TUNABLES": ""})  # as a shell that starts it sets none
    assert _tunables_of(daemon.proc.pid) == ON  # the same pid: the one its starter waits on
    assert _hugepage_advised_bytes(daemon.proc.pid) > 0  # glibc took it: its heap is advised
    assert daemon.healthy()


@needs_it
def test_an_operators_value_of_the_tunable_is_kept(start_daemon):
    daemon = start_daemon(env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert _tunables_of(daemon.proc.pid) == "glibc.malloc.hugetlb=0"
    assert _hugepage_advised_bytes(daemon.proc.pid) == 0
    assert daemon.healthy()


@needs_it
def test_the_process_executed_again_never_executes_itself_a_second_time(start_daemon):
    # as if a loader had dropped the tunable the first exec set: no loop, it serves on
    daemon = start_daemon(env={"GLIBC_TUNABLES": "",
                               "BUBBLESNAP_EXECUTED_WITH_HUGE_MALLOC": "1"})
    assert _tunables_of(daemon.proc.pid) == ""
    assert _hugepage_advised_bytes(daemon.proc.pid) == 0
    assert daemon.healthy()


@needs_it
def test_daemons_bubblesnap_testing_starts_run_with_it_too(start_daemon):
    daemon = start_daemon()
    assert re.fullmatch(r"(.+:)?glibc\.malloc\.hugetlb=1", _tunables_of(daemon.proc.pid))
