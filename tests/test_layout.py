"""The layout rules, as pure functions: no daemon needed."""

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.checks import ITEMSIZE, check_job_name
from bubblesnap.service.errors import InvalidArgument
from bubblesnap.service.store.layout import build_layout


@st.composite
def tensors(draw):
    count = draw(st.integers(1, 6))
    specs = []
    for i in range(count):
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
        splits = draw(st.integers(1, 3))
        shards = []
        for part in range(splits):
            index = [pb.Slice(start=0, stop=d) for d in shape]
            if shape:
                lo, hi = shape[0] * part // splits, shape[0] * (part + 1) // splits
                index[0] = pb.Slice(start=lo, stop=hi)
            count_elems = 1
            for sl in index:
                count_elems *= sl.stop - sl.start
            shards.append(pb.ShardSpec(index=index, nbytes=count_elems * ITEMSIZE[dtype]))
        specs.append(pb.TensorSpec(name=f"t{i}", dtype=dtype, global_shape=shape, shards=shards))
    return specs


@given(tensors())
def test_slots_are_aligned_disjoint_and_fit_the_segment(specs):
    layout = build_layout(specs)
    slots = layout.slots()
    assert len(slots) == sum(len(s.shards) for s in specs)
    end = 0
    for _, _, offset, nbytes in slots:
        assert offset % 64 == 0 and offset >= end
        end = offset + nbytes
    assert end <= layout.segment_bytes
    assert layout.nbytes == sum(n for *_, n in slots)


@pytest.mark.parametrize("name", ["a", "job-1", "Job_2.v3", "x" * 128])
def test_good_job_names(name):
    check_job_name(name)


@pytest.mark.parametrize("name", ["", ".hidden", "../up", "a/b", "a b", "x" * 129, "é", "a\x00"])
def test_bad_job_names(name):
    with pytest.raises(InvalidArgument):
        check_job_name(name)


def test_coverage_of_crafted_regions_stays_short_or_is_refused():
    from bubblesnap.service.store import regions
    # one box covers all; the others cut each of 60 dimensions (a grid of 2^60 cells)
    shape = (2,) * 60
    cuts = [tuple((0, 1) if axis == cut else (0, 2) for axis in range(60)) for cut in range(60)]
    assert regions.missing(shape, [regions.whole(shape), *cuts]) is None
    assert regions.missing(shape, cuts) == ((1, 2),) * 60  # only the far corner
    # rows of bricks cut at their own places: some 20,000 cells to check
    rng = random.Random(1)
    bricks = []
    for row in range(1000):
        edges = sorted({0, 1000, *rng.sample(range(1, 1000), 20)})
        bricks += [((row, row + 1), (a, b)) for a, b in itertools.pairwise(edges)]
    with pytest.raises(regions.TooFragmented):
        regions.missing((1000, 1000), bricks)


@pytest.mark.parametrize("shape, words", [
    ((1 << 61,), "passes"), ((-1,), "negative"), ((1,) * 65, "at most 64"),
    (((1 << 63) - 1, 0), "passes")])
def test_shapes_past_their_range(shape, words):
    spec = pb.TensorSpec(name="w", dtype="float32", global_shape=shape)
    with pytest.raises(InvalidArgument, match=words):
        build_layout([spec])
