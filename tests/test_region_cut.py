"""region_cut: regions of a restore cut out of source shards, and hashed as they land."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bubblesnap.protos.checksum import checksum
from bubblesnap.service.restore import region_cut
from bubblesnap.service.restore.region_plan import Piece
from bubblesnap.service.store import regions


def _sources(array: np.ndarray, boxes) -> tuple[dict, list]:
    """Shards of ``array`` as raw bytes keyed (rank, slot 0), and their boxes by rank."""
    shards = {(rank, 0): np.ascontiguousarray(array[regions.relative(box, regions.whole(
        array.shape))]).reshape(-1).view(np.uint8) for rank, box in enumerate(boxes)}
    return shards, list(boxes)


def _regions(array: np.ndarray, source_boxes, target_boxes) -> list[region_cut.Region]:
    """Regions to fill (fresh, poisoned targets) with the pieces every source adds."""
    made = []
    for box in target_boxes:
        pieces = tuple(Piece(rank, 0, common, source)
                       for rank, source in enumerate(source_boxes)
                       if (common := regions.intersect(source, box)) is not None)
        target = np.full(regions.volume(box) * array.itemsize, 0xAB, np.uint8)
        made.append(region_cut.Region(target, box, array.itemsize, pieces))
    return made


def _expected(array: np.ndarray, box) -> np.ndarray:
    return np.ascontiguousarray(array[regions.relative(box, regions.whole(array.shape))])


@pytest.mark.parametrize("block_bytes", [64, 1 << 20])
@pytest.mark.parametrize("threads", [0, 3])
def test_regions_of_another_sharding_come_out_bit_for_bit_with_their_checksums(
        monkeypatch, block_bytes, threads):
    # Rows held unevenly by three ranks, asked by columns and by boxes across them, in
    # blocks small enough that every region is cut in several.
    monkeypatch.setattr(region_cut, "FUSED_BLOCK_BYTES", block_bytes)
    array = np.random.default_rng(1).integers(0, 1 << 16, (37, 13), dtype=np.uint16)
    rows = [((0, 5), (0, 13)), ((5, 30), (0, 13)), ((30, 37), (0, 13))]
    shards, _ = _sources(array, rows)
    asked = [((0, 37), (0, 4)), ((0, 37), (4, 13)), ((3, 33), (2, 11)), ((36, 37), (12, 13))]
    filled = _regions(array, rows, asked)
    workers = ThreadPoolExecutor(threads) if threads else None
    try:
        checksums = region_cut.cut(filled, shards, workers)
    finally:
        if workers:
            workers.shutdown()
    for region, box, got in zip(filled, asked, checksums, strict=True):
        expected = _expected(array, box)
        assert region.target.tobytes() == expected.tobytes(), box
        assert got == checksum(expected.reshape(-1).view(np.uint8)), box


def test_three_dimensions_a_scalar_and_an_empty_region(monkeypatch):
    monkeypatch.setattr(region_cut, "FUSED_BLOCK_BYTES", 32)
    cube = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    halves = [((0, 4), (0, 5), (0, 3)), ((0, 4), (0, 5), (3, 6))]
    shards, _ = _sources(cube, halves)
    asked = [((1, 3), (0, 5), (2, 5)), ((0, 4), (2, 2), (0, 6))]  # the second holds nothing
    filled = _regions(cube, halves, asked)
    scalar = np.array(7.5, np.float64)
    shards[(9, 0)] = scalar.reshape(-1).view(np.uint8)
    filled.append(region_cut.Region(np.zeros(8, np.uint8), (), 8, (Piece(9, 0, (), ()),)))
    checksums = region_cut.cut(filled, shards)
    for region, box, got in zip(filled, asked, checksums, strict=False):
        expected = _expected(cube, box).reshape(-1).view(np.uint8)
        assert region.target.tobytes() == expected.tobytes() and got == checksum(expected)
    assert filled[2].target.view(np.float64)[0] == 7.5 and checksums[2] == checksum(
        scalar.reshape(-1).view(np.uint8))


def test_a_piece_is_one_run_exactly_when_its_elements_are_consecutive_in_its_shard():
    source = ((2, 6), (0, 3), (1, 5))
    shape = tuple(b - a for a, b in source)
    flat = np.arange(regions.volume(source)).reshape(shape)
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        box = []
        for a, b in source:
            lo = int(rng.integers(a, b + 1))
            box.append((lo, int(rng.integers(lo, b + 1))))
        box = tuple(box)
        run = Piece(0, 0, box, source).run(itemsize=4)
        inside = flat[regions.relative(box, source)].reshape(-1)
        consecutive = inside.size > 0 and bool((np.diff(inside) == 1).all())
        assert (run is not None) == consecutive, box
        if run is not None:
            assert run == (int(inside[0]) * 4, inside.size * 4)
        seen[consecutive] += 1
    assert min(seen.values()) > 20  # both kinds were drawn


@pytest.mark.parametrize("threads", [0, 2])
def test_sources_to_verify_are_checked_in_the_pass_that_cuts_them(monkeypatch, threads):
    # Rows -> columns of two tensors: each source is hashed over the same blocks of rows
    # its pieces are copied from; a source whose checksum differs is named, and one no
    # region reads is checked too.
    monkeypatch.setattr(region_cut, "FUSED_BLOCK_BYTES", 96)
    rng = np.random.default_rng(2)
    first = rng.integers(0, 1 << 31, (29, 12), dtype=np.int32)
    second = rng.integers(0, 1 << 16, (8, 5, 3), dtype=np.uint16)
    rows = [((0, 10), (0, 12)), ((10, 29), (0, 12))]
    shards, _ = _sources(first, rows)
    filled = _regions(first, rows, [((0, 29), (0, 5)), ((0, 29), (5, 12)), ((4, 6), (0, 12))])
    blocks = [((0, 3), (0, 5), (0, 3)), ((3, 8), (0, 5), (0, 3))]
    more, _ = _sources(second, blocks)
    shards.update({(rank + 5, 0): data for (rank, _), data in more.items()})
    cube_regions = _regions(second, blocks, [((1, 7), (2, 4), (0, 3))])
    filled += [dataclasses.replace(r, pieces=tuple(dataclasses.replace(p, rank=p.rank + 5)
                                                   for p in r.pieces)) for r in cube_regions]
    shards[(9, 3)] = np.arange(40, dtype=np.uint8)  # read by no region
    truth = {key: checksum(data) for key, data in shards.items()}
    workers = ThreadPoolExecutor(threads) if threads else None
    try:
        checksums = region_cut.cut(filled, shards, workers, unverified=dict(truth))
        expected = [_expected(first, r.box) for r in filled[:3]] + \
            [_expected(second, filled[3].box)]
        for region, want, got in zip(filled, expected, checksums, strict=True):
            assert region.target.tobytes() == want.tobytes()
            assert got == checksum(want.reshape(-1).view(np.uint8))
        # for a caller that checks no checksum: the same bytes, the regions not hashed
        for region in filled:
            region.target[...] = 0
        assert region_cut.cut(filled, shards, workers, dict(truth), hashed=False) == (0,) * 4
        for region, want in zip(filled, expected, strict=True):
            assert region.target.tobytes() == want.tobytes()
        for wrong, hashed in [((1, 0), True), ((6, 0), True), ((9, 3), True), ((1, 0), False)]:
            with pytest.raises(region_cut.SourceCorrupt) as raised:
                region_cut.cut(filled, shards, workers,
                               unverified={**truth, wrong: truth[wrong] ^ 1}, hashed=hashed)
            assert raised.value.sources == [wrong]
    finally:
        if workers:
            workers.shutdown()


def test_a_flipped_byte_in_a_source_is_caught_even_where_no_region_reads_it():
    # The region asks for the first rows only; the flipped byte lies in the last row of
    # the same source, so it is found only because the whole source is hashed.
    array = np.arange(6 * 4, dtype=np.uint32).reshape(6, 4)
    source = [((0, 6), (0, 4))]
    shards, _ = _sources(array, source)
    truth = checksum(shards[(0, 0)])
    shards[(0, 0)] = shards[(0, 0)].copy()
    shards[(0, 0)][-1] ^= 0x10
    filled = _regions(array, source, [((0, 2), (1, 3))])
    with pytest.raises(region_cut.SourceCorrupt):
        region_cut.cut(filled, shards, unverified={(0, 0): truth})
    assert filled[0].target.tobytes() == _expected(array, ((0, 2), (1, 3))).tobytes()


def test_a_tensor_larger_than_one_workers_share_has_its_sources_checked_first(monkeypatch):
    # One tensor is the whole state: cut in one pass it would run on one worker, so its
    # sources are checked first on every worker and its regions cut apart.
    monkeypatch.setattr(region_cut, "FUSED_BLOCK_BYTES", 128)
    array = np.arange(24 * 10, dtype=np.float32).reshape(24, 10)
    rows = [((0, 12), (0, 10)), ((12, 24), (0, 10))]
    shards, _ = _sources(array, rows)
    truth = {key: checksum(data) for key, data in shards.items()}
    filled = _regions(array, rows, [((0, 24), (0, 5)), ((0, 24), (5, 10))])
    hashed_in_the_cut = []
    fill = region_cut._fill
    monkeypatch.setattr(region_cut, "_fill", lambda regions_to_fill, sources, *rest: (
        hashed_in_the_cut.extend(sources), fill(regions_to_fill, sources, *rest))[1])
    with ThreadPoolExecutor(2) as workers:
        checksums = region_cut.cut(filled, shards, workers, dict(truth), threads=2)
        assert hashed_in_the_cut == []
        for region, got in zip(filled, checksums, strict=True):
            expected = _expected(array, region.box)
            assert region.target.tobytes() == expected.tobytes()
            assert got == checksum(expected.reshape(-1).view(np.uint8))
        with pytest.raises(region_cut.SourceCorrupt) as raised:
            region_cut.cut(filled, shards, workers, {**truth, (1, 0): 7}, threads=2)
        assert raised.value.sources == [(1, 0)]
        region_cut.cut(filled, shards, workers, dict(truth), threads=1)  # one pass
        assert sorted(hashed_in_the_cut) == [(0, 0), (1, 0)]
