"""The record beside each held copy, and which directories a starting daemon may take over."""

import fcntl
import json
import os
import subprocess

import pytest

from bubblesnap.service.store import persistence
from bubblesnap.service.store.layout import Layout, Shard, Tensor
from bubblesnap.service.store.persistence import CopyRecord
from bubblesnap.service.store.segments import SegmentPool

LAYOUT = Layout((Tensor("params/w", "bfloat16", (4, 6), (Shard(((0, 2), (0, 6)), 24),
                                                         Shard(((2, 4), (0, 6)), 24)), True),
                 Tensor("count", "int64", (), (Shard((), 8),))))
RECORD = CopyRecord("job", 4, 2, 17, 4, (2, 3), False, True, LAYOUT, (1, 2, (1 << 64) - 1))


def _write(tmp_path, header_changes=None, layout_line=None) -> str:
    segment = str(tmp_path / "seg-0")
    persistence.write(segment, RECORD)
    path = persistence.path_of(segment)
    header, layout = open(path).read().splitlines()
    with open(path, "w") as f:
        f.write(json.dumps({**json.loads(header), **(header_changes or {})}) + "\n" +
                (layout if layout_line is None else layout_line) + "\n")
    return path


def test_a_record_reads_back_as_written_and_goes_when_removed(tmp_path):
    segment = str(tmp_path / "seg-3")
    persistence.write(segment, RECORD)
    assert os.listdir(tmp_path) == ["seg-3.meta"]  # no temp file left
    assert persistence.read(persistence.path_of(segment)) == RECORD
    persistence.remove(segment)
    persistence.remove(segment)  # a copy never recorded, or freed twice: nothing to do
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("header, layout", [
    ({"rank": -1}, None), ({"rank": 4}, None), ({"job": "../etc"}, None),
    ({"job": 7}, None), ({"step": "17"}, None), ({"group": [9]}, None),
    ({"checksums": [1, 2]}, None), ({"checksums": [1, 2, 1 << 64]}, None),
    ({"segment_bytes": 1 << 40}, None), ({"version": 0}, None), ({"version": "1"}, None),
    ({}, "[]"), ({}, "not json"),
    ({}, '[{"name": ["w"], "dtype": "int64", "shape": [], "job_wide": true, '
         '"shards": [{"index": [], "nbytes": 8}]}]'),
    ({}, '[{"name": "w", "dtype": "float32", "shape": [2], "job_wide": false, '
         '"shards": [{"index": [[0, 1]], "nbytes": 4}]}]'),  # its own tensor, half covered
])
def test_a_record_that_does_not_describe_a_possible_copy_is_unreadable(tmp_path, header,
                                                                       layout):
    with pytest.raises(persistence.Unreadable):
        persistence.read(_write(tmp_path, header, layout))


def test_a_newer_version_is_reported_and_not_read(tmp_path):
    path = _write(tmp_path, {"version": 2}, "whatever version 2 writes here")
    with pytest.raises(persistence.NewerVersion) as newer:
        persistence.read(path)
    assert newer.value.version == 2


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_directories_of_dead_daemons_nobody_holds_are_claimed(tmp_path):
    made = {name: tmp_path / name for name in (
        f"bubblesnap-{_gone_pid()}-dead", f"bubblesnap-{os.getpid()}-earlier",
        f"bubblesnap-{_gone_pid()}-held", "bubblesnap-1-alive", "bubblesnap-testing-x",
        "unrelated")}
    for directory in made.values():
        directory.mkdir()
        (directory / "seg-0").write_bytes(b"x")
    # A live daemon whose pid this process cannot see (another pid namespace) holds its lock.
    held = os.open(made[next(n for n in made if n.endswith("-held"))] / "lock",
                   os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    pool = SegmentPool(str(tmp_path))
    try:
        claimed = pool.claim_dead()
        # The dead one and this pid's earlier one (a container restarted under the same
        # pid) are now this daemon's, under new names; the others are as they were.
        assert len(claimed) == 2
        for path in claimed:
            assert os.path.basename(path).startswith(f"bubblesnap-{os.getpid()}-")
            assert sorted(os.listdir(path)) == ["lock", "seg-0"]
        left = {n for n in made if (tmp_path / n).exists()}
        assert left == {n for n in made if not n.endswith(("-dead", "-earlier"))}
        second = SegmentPool(str(tmp_path))  # another daemon starting: every one is held
        assert second.claim_dead() == []
        second.close()
    finally:
        os.close(held)
        pool.close()
    assert sorted(os.listdir(tmp_path)) == sorted(left)
