"""Cutting the regions a restore asked for out of the source shards: each region's
pieces copied block by block, each block hashed while it is still in cache, regions
spread over worker threads; sources not yet verified are hashed in the same pass.
No I/O: arrays in, checksums out.

An assembled restore (another mesh, another number of processes) moves every
byte of the state once; verifying the sources and then cutting them reads
them twice from memory. Cut here, a tensor's regions are filled
in blocks of rows (about ``FUSED_BLOCK_BYTES`` of its widest shard, along the
first axis): each source still to verify is hashed over those rows, the
pieces are copied out of it while it is in cache, and each region's block is
hashed right after it lands. A shard's bytes in C order are its rows in
order, so every hash sees its bytes in order. Regions that share a source to
verify are cut on one worker, in that order (xxh3 streams, it cannot be split);
other groups run in parallel (numpy's copies and xxhash release the GIL).
On the dev VM's 2 cores, 256 MB resharded rows -> columns over 12 tensors:
verified then cut 62 ms, in one pass 28 ms. A tensor more than one worker's
share of the state (one pass on one worker: 51 ms for all 256 MB) has its
sources checked first, on every worker, and its regions cut apart. Regions a
caller will not check (``hashed`` False) are not hashed: 4-6 ms of such a cut.
"""

import concurrent.futures
import dataclasses
from concurrent.futures import Executor

import numpy as np

from bubblesnap.protos.checksum import FUSED_BLOCK_BYTES, checksum, new_hasher
from bubblesnap.service.restore.region_plan import Piece
from bubblesnap.service.store import regions


@dataclasses.dataclass(frozen=True)
class Region:
    """One region to fill: ``box`` of a tensor of ``itemsize``-byte elements, laid out in
    C order at ``target`` (its bytes), from ``pieces``."""

    target: np.ndarray
    box: regions.Box
    itemsize: int
    pieces: tuple[Piece, ...]


class SourceCorrupt(Exception):
    """Sources hashed while they were cut did not match their checksums: the regions cut
    from them are not to be used. ``sources``: their (rank, slot), sorted."""

    def __init__(self, sources: list[tuple[int, int]]):
        super().__init__(f"sources {sources} failed their checksums while cut")
        self.sources = sources


@dataclasses.dataclass(frozen=True)
class _Group:
    """Regions cut on one worker (indices into the list asked) and the sources to verify
    that they read, (rank, slot) -> the source's box."""

    regions: tuple[int, ...]
    sources: dict


def cut(regions_to_fill: list[Region], shards: dict, workers: Executor | None = None,
        unverified: dict | None = None, threads: int = 1, hashed: bool = True
        ) -> tuple[int, ...]:
    """Fills every region from ``shards`` ((rank, slot) -> the source shard's bytes) and
    returns each region's checksum, in order (0s unless ``hashed``). ``unverified``:
    (rank, slot) -> the checksum that source must have, hashed as it is cut;
    SourceCorrupt (after every region is done) names those that differ. ``workers``
    (``threads`` of them): groups run on them, the largest first; None: here, one
    after the other. A group more than one worker's share of the bytes has its
    sources checked first, on every worker, and its regions cut apart (one worker
    would be the whole cut's bottleneck)."""
    unverified = unverified or {}

    def size(group: _Group) -> int:
        return sum(regions_to_fill[i].target.nbytes for i in group.regions) + \
            sum(np.asarray(shards[key]).nbytes for key in group.sources)

    groups = _groups(regions_to_fill, unverified)
    total = sum(size(g) for g in groups)
    large = [g for g in groups if g.sources and workers is not None and threads > 1
             and size(g) * threads > total]
    if large:
        keys = [key for g in large for key in g.sources]
        bad = _differing(keys, workers.map(lambda key: checksum(shards[key]), keys),
                         unverified)
        if bad:
            raise SourceCorrupt(bad)
        groups = [g for g in groups if g not in large] + \
            [_Group((i,), {}) for g in large for i in g.regions]

    def fill(group: _Group) -> tuple[list[int], list[int]]:
        return _fill([regions_to_fill[i] for i in group.regions], group.sources, shards,
                     hashed)

    if workers is None:
        results = [fill(group) for group in groups]
    else:
        futures: dict = {}
        try:
            for group in sorted(groups, key=lambda g: -size(g)):
                futures[id(group)] = workers.submit(fill, group)
        finally:
            # every group done (or failed) before any error is raised: the caller frees
            # the sources right after, and no worker may still be reading them
            concurrent.futures.wait(futures.values())
        results = [futures[id(group)].result() for group in groups]
    checksums: list = [None] * len(regions_to_fill)
    bad = []
    for group, (region_sums, source_sums) in zip(groups, results, strict=True):
        for i, value in zip(group.regions, region_sums, strict=True):
            checksums[i] = value
        bad.extend(_differing(list(group.sources), source_sums, unverified))
    if bad:
        raise SourceCorrupt(sorted(bad))
    return tuple(checksums)


def _differing(keys: list, sums, unverified: dict) -> list:
    """The ``keys`` whose hashes ``sums`` (in order) differ from ``unverified``'s, sorted."""
    return sorted(key for key, value in zip(keys, sums, strict=True) if value != unverified[key])


def _groups(regions_to_fill: list[Region], unverified: dict) -> list[_Group]:
    """Regions joined by the sources to verify they share (one tensor's, as a rule); a
    region that reads none is a group of its own, and so is a source no region reads."""
    parent = list(range(len(regions_to_fill)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_reader: dict = {}
    boxes: dict = {}
    for i, region in enumerate(regions_to_fill):
        for piece in region.pieces:
            key = (piece.rank, piece.slot)
            if key in unverified:
                boxes[key] = piece.source_box
                parent[root(i)] = root(first_reader.setdefault(key, i))
    members: dict = {}
    for i in range(len(regions_to_fill)):
        members.setdefault(root(i), []).append(i)
    sources: dict = {}
    for key, i in first_reader.items():
        sources.setdefault(root(i), {})[key] = boxes[key]
    groups = [_Group(tuple(m), sources.get(r, {})) for r, m in members.items()]
    # A source no region reads is still checked (its box: its bytes as one row).
    unread = [key for key in unverified if key not in first_reader]
    return groups + [_Group((), {key: ((0, 1),)}) for key in unread]


def _fill(regions_to_fill: list[Region], sources: dict, shards: dict, hashed: bool
          ) -> tuple[list[int], list[int]]:
    """Fills ``regions_to_fill`` (of one tensor) block of rows by block of rows, hashing
    ``sources`` ((rank, slot) -> box) over each block first: (regions' checksums, 0s
    unless ``hashed``; sources' checksums), each in order."""
    streams = [(np.asarray(shards[key]), box) for key, box in sources.items()]
    source_hashers = [new_hasher() for _ in streams]
    region_hashers = [new_hasher() for _ in regions_to_fill] if hashed else []
    copies = [_Copy.of(piece, region, shards) for region in regions_to_fill
              for piece in region.pieces]
    for rows in _row_blocks([*streams, *((r.target, r.box) for r in regions_to_fill)]):
        for (data, box), hasher in zip(streams, source_hashers, strict=True):
            hasher.update(_rows_of(data, box, rows))
        for copy in copies:
            copy.rows(rows)
        if hashed:
            for region, hasher in zip(regions_to_fill, region_hashers, strict=True):
                hasher.update(_rows_of(region.target, region.box, rows))
    region_sums = [h.intdigest() for h in region_hashers] if hashed else \
        [0] * len(regions_to_fill)
    return region_sums, [h.intdigest() for h in source_hashers]


@dataclasses.dataclass(frozen=True)
class _Copy:
    """One piece of a region, as element views: ``target`` holds the region, ``source``
    the piece's shard; ``first`` the piece's rows, ``target_first`` and ``source_first``
    the first rows of the two boxes, ``within`` the piece on the other axes (slices of
    the target, then of the source). Precomputed once: a block of rows is then a few
    integer compares and one numpy copy, not box arithmetic per block."""

    target: np.ndarray
    source: np.ndarray
    first: tuple[int, int]
    target_first: int
    source_first: int
    within: tuple[tuple[slice, ...], tuple[slice, ...]]

    @classmethod
    def of(cls, piece: Piece, region: Region, shards: dict) -> "_Copy":
        source = as_elements(shards[(piece.rank, piece.slot)], piece.source_box, region.itemsize)
        target = as_elements(region.target, region.box, region.itemsize)
        if not piece.box:  # a scalar: one row of one element, copied in its one block
            return cls(target.reshape(1, -1), source.reshape(1, -1), (0, 1), 0, 0, ((), ()))
        return cls(target, source, piece.box[0], region.box[0][0], piece.source_box[0][0],
                   (regions.relative(piece.box[1:], region.box[1:]),
                    regions.relative(piece.box[1:], piece.source_box[1:])))

    def rows(self, rows: tuple[int, int] | None) -> None:
        """Copies the piece's part of ``rows`` (None: all of it)."""
        lo, hi = self.first if rows is None else (max(rows[0], self.first[0]),
                                                  min(rows[1], self.first[1]))
        if lo >= hi:
            return
        self.target[(slice(lo - self.target_first, hi - self.target_first), *self.within[0])] = \
            self.source[(slice(lo - self.source_first, hi - self.source_first), *self.within[1])]


def _row_blocks(streams):
    """(first, end) row ranges covering every (bytes, box) of ``streams`` along the first
    axis, each about FUSED_BLOCK_BYTES of the widest one; None once (the whole) for a
    scalar or when no stream has a row."""
    spans = [(box[0], data.nbytes // (box[0][1] - box[0][0])) for data, box in streams
             if box and box[0][1] > box[0][0]]
    if not spans or any(not box for _, box in streams):
        yield None
        return
    first, end = min(s[0][0] for s in spans), max(s[0][1] for s in spans)
    rows = max(1, FUSED_BLOCK_BYTES // max(1, max(width for _, width in spans)))
    for row in range(first, end, rows):
        yield row, min(row + rows, end)


def _rows_of(data: np.ndarray, box: regions.Box, rows) -> np.ndarray:
    """The bytes of ``rows`` (None: all) of a C-order ``box`` held as ``data``."""
    if rows is None:
        return data
    (first, end) = box[0]
    lo, hi = max(rows[0], first), min(rows[1], end)
    if lo >= hi:
        return data[:0]
    width = data.nbytes // (end - first)
    return data[(lo - first) * width:(hi - first) * width]


def as_elements(data: np.ndarray, box: regions.Box, itemsize: int) -> np.ndarray:
    """Raw bytes of a C-order box as an array of its shape with one trailing axis of
    ``itemsize`` bytes: boxes of it slice whole elements whatever the dtype."""
    shape = tuple(stop - start for start, stop in box)
    return np.asarray(data).reshape(*shape, itemsize)
