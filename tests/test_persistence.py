"""The record beside each held copy."""

import json
import os

import pytest

from bubblesnap.service.store import persistence
from bubblesnap.service.store.layout import Layout, Shard, Tensor
from bubblesnap.service.store.persistence import CopyRecord

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
