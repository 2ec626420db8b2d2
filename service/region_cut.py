"""Cutting the regions a restore asked for out of the source shards: each region's
pieces copied block by block, each block hashed while it is still in cache, regions
spread over worker threads. No I/O: arrays in, checksums out.

An assembled restore (another mesh, another number of processes) moves every
byte of the state once; copying it all and then hashing it all reads it twice
from memory, on one core. Cut here, a region is filled in blocks of about
``FUSED_BLOCK_BYTES`` along its first axis and each block is hashed right
after its pieces land; regions run in parallel (numpy's copies and xxhash
release the GIL).
"""

import concurrent.futures
import dataclasses
from concurrent.futures import Executor

import numpy as np

from bubblesnap.protos.checksum import FUSED_BLOCK_BYTES, new_hasher
from bubblesnap.service.region_plan import Piece
from bubblesnap.service.store import regions


@dataclasses.dataclass(frozen=True)
class Region:
    """One region to fill: ``box`` of a tensor of ``itemsize``-byte elements, laid out in
    C order at ``target`` (its bytes), from ``pieces``."""

    target: np.ndarray
    box: regions.Box
    itemsize: int
    pieces: tuple[Piece, ...]


def cut(regions_to_fill: list[Region], shards: dict, workers: Executor | None = None
        ) -> tuple[int, ...]:
    """Fills every region from ``shards`` ((rank, slot) -> the source shard's bytes) and
    returns each region's checksum, in order. ``workers``: regions run on them, the
    largest first; None: here, one after the other."""
    if workers is None:
        return tuple(_fill(region, shards) for region in regions_to_fill)
    order = sorted(range(len(regions_to_fill)), key=lambda i: -regions_to_fill[i].target.nbytes)
    futures = {i: workers.submit(_fill, regions_to_fill[i], shards) for i in order}
    # every region done (or failed) before any error is raised: the caller frees the
    # sources right after, and no worker may still be reading them
    concurrent.futures.wait(futures.values())
    return tuple(futures[i].result() for i in range(len(regions_to_fill)))


def _fill(region: Region, shards: dict) -> int:
    hasher = new_hasher()
    flat = region.target
    target = as_elements(flat, region.box, region.itemsize)
    for block, start, stop in _blocks(region.box, flat.nbytes):
        for piece in region.pieces:
            common = regions.intersect(piece.box, block)
            if common is None:
                continue
            source = as_elements(shards[(piece.rank, piece.slot)], piece.source_box,
                                 region.itemsize)
            target[regions.relative(common, region.box)] = \
                source[regions.relative(common, piece.source_box)]
        hasher.update(flat[start:stop])
    return hasher.intdigest()


def _blocks(box: regions.Box, nbytes: int):
    """(block box, first byte, end byte): ``box`` cut along its first axis into blocks of
    about FUSED_BLOCK_BYTES (one block for a scalar or an empty box)."""
    if not box or nbytes == 0:
        yield box, 0, nbytes
        return
    (first, last), rest = box[0], box[1:]
    row_bytes = nbytes // (last - first)
    rows = max(1, FUSED_BLOCK_BYTES // row_bytes)
    for row in range(first, last, rows):
        end = min(row + rows, last)
        yield ((row, end), *rest), (row - first) * row_bytes, (end - first) * row_bytes


def as_elements(data: np.ndarray, box: regions.Box, itemsize: int) -> np.ndarray:
    """Raw bytes of a C-order box as an array of its shape with one trailing axis of
    ``itemsize`` bytes: boxes of it slice whole elements whatever the dtype."""
    shape = tuple(stop - start for start, stop in box)
    return np.asarray(data).reshape(*shape, itemsize)
