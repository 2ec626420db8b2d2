"""Hashing slots as their bytes arrive in pieces equals hashing each slot whole, and
parallel pulls split a segment at slot boundaries."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesnap.protos.checksum import SlotHasher, checksum
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
