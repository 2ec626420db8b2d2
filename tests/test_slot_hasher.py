"""Hashing slots as their bytes arrive in pieces equals hashing each slot whole, a slot
hashed with runs in it gives each run's own checksum, and parallel pulls split a segment
at slot boundaries."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesnap.protos import checksum as checksum_module
from bubblesnap.protos.checksum import SlotHasher, checksum, checksum_with_runs
from bubblesnap.service.peers.data_channel import split


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       gaps=st.lists(st.integers(0, 64), min_size=8, max_size=8),
       cuts=st.lists(st.integers(1, 200), min_size=1, max_size=40))
def test_pieces_in_any_size_hash_like_whole_slots(sizes, gaps, cuts):
    slots, offset = [], 0
    for size, gap in zip(sizes, gaps, strict=False):
        offset += gap
        slots.append((offset, size))
        offset += size
    segment = np.random.default_rng(len(cuts)).integers(0, 256, offset + 7, dtype=np.uint8)
    hasher = SlotHasher(slots)
    start = 0
    for cut in cuts * (1 + len(segment) // max(1, sum(cuts))):
        stop = min(len(segment), start + cut)
        hasher.feed(segment, start, stop)
        start = stop
        if start == len(segment):
            break
    assert hasher.digests() == tuple(checksum(segment[o:o + n]) for o, n in slots)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12), streams=st.integers(1, 5))
def test_pull_groups_cover_every_slot_once_in_order(sizes, streams):
    slots, offset = [], 0
    for size in sizes:
        slots.append((offset, size))
        offset += -(-size // 64) * 64
    groups = split(slots, offset, streams)
    assert 1 <= len(groups) <= streams
    assert [s for g in groups for s in g] == slots
    assert all(groups)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3000),
       runs=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), max_size=5),
       whole=st.integers(0, 2))
def test_a_slot_hashed_with_runs_gives_each_runs_own_checksum(size, runs, whole):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    runs = [(min(o, size), min(n, size - min(o, size))) for o, n in runs]
    runs[len(runs) // 2:len(runs) // 2] = [(0, size)] * whole  # the whole slot, as a run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checksum_module, "FUSED_BLOCK_BYTES", 256)  # blocks cut the runs
        value, sums = checksum_with_runs(data, runs)
    assert value == checksum(data)
    assert sums == [checksum(data[o:o + n]) for o, n in runs]
