"""Where tensors go in a step's one Orbax checkpoint, and when its sidecars make it
whole: pure functions, tested on crafted layouts, no daemon."""

import os

import numpy as np
import pytest

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import orbax_layout
from bubblesnap.service.durable.policy import incomplete, step_to_write
from bubblesnap.service.durable.sidecar import WrittenRank, WrittenTensor


def test_tree_keys_put_a_ranks_own_tensors_under_it_except_alone():
    assert orbax_layout.tree_key("params/w", 1, 4, job_wide=True) == ("params", "w")
    assert orbax_layout.tree_key("params/w", 1, 4, job_wide=False) == ("rank_1", "params", "w")
    assert orbax_layout.tree_key("params/w", 0, 1, job_wide=False) == ("params", "w")
    assert orbax_layout.param_name(("rank_1", "params", "w")) == "rank_1.params.w"


def test_the_chunk_grid_makes_every_region_whole_chunks():
    # A JAX sharding's equal parts: any one rank's regions give the same grid.
    assert orbax_layout.write_shape((16, 8), [((8, 16), (0, 4))]) == (8, 4)
    assert orbax_layout.write_shape((16, 8), [((0, 8), (4, 8))]) == (8, 4)
    assert orbax_layout.write_shape((12,), [((8, 12),)]) == (4,)  # the last part alone
    # Uneven cuts need every rank's edges.
    assert orbax_layout.write_shape((12,), [((0, 4),)]) == (4,)
    assert orbax_layout.write_shape((12,), [((0, 4),), ((4, 6),), ((6, 12),)]) == (2,)
    assert orbax_layout.write_shape((), [()]) == ()
    assert orbax_layout.write_shape((7, 3), [((0, 7), (0, 3)), ((2, 2), (0, 3))]) == (7, 3)
    assert orbax_layout.is_aligned(((4, 7),), (7,), (2,))  # the array's end cuts the chunk
    assert not orbax_layout.is_aligned(((3, 7),), (7,), (2,))


@pytest.mark.parametrize("leaves, words", [
    ([(("a", "b"), None), (("a", "b"), 0)], "written twice"),
    ([(("rank_1", "x"), None), (("rank_1", "x"), 1)], "written twice"),
    ([(("a",), 0), (("a", "b"), 0)], "nests under the tensor 'a'"),
    ([(("a.b",), 0), (("a", "b"), 0)], "Orbax parameter 'a.b'"),
    ([(("a", ""), 0)], "empty part"),
])
def test_names_that_cannot_share_a_checkpoint_are_refused(leaves, words):
    assert words in orbax_layout.conflict(leaves)


def test_one_job_wide_array_written_by_several_ranks_is_one_leaf():
    assert orbax_layout.conflict([(("w",), None), (("w",), None), (("rank_0", "w"), 0)]) is None


def _rank(rank, regions, world=2, group=(), chunks=(2,), own=()):
    tensors = [WrittenTensor("w", "float32", (4,), True, ("w",), chunks, tuple(regions),
                             tuple(range(len(regions))))]
    tensors += [WrittenTensor(name, "int32", (3,), False, (f"rank_{rank}", name), (3,),
                              (((0, 3),),), (7,)) for name in own]
    return WrittenRank("job", 5, rank, world, tuple(group) or (rank,), tuple(tensors))


def test_a_step_is_whole_when_its_sidecars_cover_every_rank_and_every_array():
    assert incomplete({0: _rank(0, [((0, 2),)], own=["m"]), 1: _rank(1, [((2, 4),)])}) is None
    assert "ranks [1] are not written" in incomplete({0: _rank(0, [((0, 2),)])})
    # a replica group is written once, by its copier
    assert incomplete({0: _rank(0, [((0, 4),)], group=(0, 1), chunks=(4,))}) is None
    assert "'w' [2:4] is not written" in incomplete(
        {0: _rank(0, [((0, 2),)]), 1: _rank(1, [], chunks=(4,))})
    assert "overlap" in incomplete({0: _rank(0, [((0, 2),)]), 1: _rank(1, [((0, 4),)])})
    assert "different chunk grids" in incomplete(
        {0: _rank(0, [((0, 2),)]), 1: _rank(1, [((2, 4),)], chunks=(1,))})
    assert "different world sizes" in incomplete(
        {0: _rank(0, [((0, 2),)]), 1: _rank(1, [((2, 4),)], world=3)})
    assert incomplete({}) == "no rank is written"


def test_a_step_published_within_the_listing_s_clock_tick_is_seen(tmp_path):
    """The job folder's listing is cached by its mtime, which the kernel stamps from a
    coarse clock: a step renamed in during the tick the folder was listed in leaves the
    mtime as it was. Here the rename's new mtime is set back to the listed one."""
    job = tmp_path / "job"
    job.mkdir()
    assert fmt.finalized_steps(str(tmp_path), "job") == {}
    listed = os.stat(job).st_mtime_ns
    step = job / "step_3"
    os.makedirs(fmt.marker_path(str(step)).rsplit("/", 1)[0])
    open(fmt.marker_path(str(step)), "w").close()
    os.utime(job, ns=(listed, listed))  # the same tick
    assert fmt.finalized_steps(str(tmp_path), "job") == {3: str(step)}


def test_a_write_behind_takes_the_newest_step_when_no_other_host_writes_the_job():
    """Behind a burst of commits, a daemon holding every rank writes the newest waiting
    step (a manager keeping the newest may have deleted step 0 already); a daemon that
    shares the job with others writes the roundest, the step they also pick."""
    assert step_to_write([0, 1, 2, 3], every_rank_here=True) == 3
    assert step_to_write([0, 1, 2, 3], every_rank_here=False) == 0
    assert step_to_write([5, 6, 7], every_rank_here=False) == 6


def test_row_pieces_cut_whole_chunks_along_the_first_axis_at_most_the_bytes_asked():
    box = ((4, 14), (0, 6))  # 10 rows of 6 four-byte elements, chunks of 2 rows
    assert orbax_layout.row_pieces(box, (2, 3), 4, 100) == [((4, 8), (0, 6)), ((8, 12), (0, 6)),
                                                            ((12, 14), (0, 6))]
    # a piece is one chunk row at least, however few bytes are asked
    assert orbax_layout.row_pieces(box, (2, 3), 4, 1) == [((a, a + 2), (0, 6))
                                                          for a in range(4, 14, 2)]
    assert orbax_layout.row_pieces(box, (2, 3), 4, 1 << 20) == [box]
    assert orbax_layout.row_pieces((), (), 4, 1) == [()]  # a scalar is its one piece
    assert orbax_layout.row_pieces(((0, 0), (0, 6)), (1, 6), 4, 1) == [((0, 0), (0, 6))]


def test_row_pieces_of_a_stack_of_layers_take_one_layer_at_a_time_and_cut_its_rows():
    box = ((0, 4), (0, 8), (0, 6))  # 4 layers of 8 rows of 6 four-byte elements: 192 bytes
    chunks = (1, 2, 6)  # a chunk: 2 rows of one layer, 48 bytes
    assert orbax_layout.row_pieces(box, chunks, 4, 60) == [
        ((i, i + 1), (a, a + 2), (0, 6)) for i in range(4) for a in range(0, 8, 2)]
    assert orbax_layout.row_pieces(box, chunks, 4, 100) == [
        ((i, i + 1), (a, a + 4), (0, 6)) for i in range(4) for a in (0, 4)]
    # a layer fits: the pieces are whole layers, as many as fit
    assert orbax_layout.row_pieces(box, chunks, 4, 400) == [((0, 2), (0, 8), (0, 6)),
                                                           ((2, 4), (0, 8), (0, 6))]
    # every piece is one run of the box's bytes, in order, and they cover it
    values = np.arange(4 * 8 * 6).reshape(4, 8, 6)
    for most in (1, 60, 100, 200, 400, 1 << 20):
        pieces = orbax_layout.row_pieces(box, chunks, 4, most)
        runs = [values[orbax_layout.rows_of(box, piece)] for piece in pieces]
        assert all(run.flags.c_contiguous for run in runs)
        assert np.concatenate([run.reshape(-1) for run in runs]).tolist() == \
            values.reshape(-1).tolist()


@pytest.mark.parametrize("grid, itemsize, chunks", [
    ((3276, 1024), 4, (3276, 1024)),  # 13 MB: whole
    ((100_000_000,), 4, (4_000_000,)),  # the largest divisor within 16 MiB
    ((32, 4096, 14336), 2, (1, 512, 14336)),  # stacked layers: the leading axis first
    ((1024, 5_000_011), 4, (1, 5_000_011)),  # a prime row: a row per chunk, 20 MB
    ((8_388_617,), 4, (8_388_617,)),  # a prime length: whole, not 8 M chunks of 4 bytes
    ((32_001, 4096), 2, (32_001, 4096)),  # 3 x 10667 rows: 24 KB or 87 MB chunks, whole
    ((8,), 4, (8,)), ((), 4, ()),
])
def test_chunks_cut_the_leading_axes_and_never_into_tiny_chunks(grid, itemsize, chunks):
    assert orbax_layout.chunk_shape(grid, itemsize, 16 << 20, 1 << 20) == chunks
