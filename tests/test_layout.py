"""The layout rules, as pure functions: no daemon needed."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.errors import InvalidArgument
from bubblesnap.service.store.layout import ITEMSIZE, build_layout, check_job_name


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
