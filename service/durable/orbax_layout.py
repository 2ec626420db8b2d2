"""Where a job's tensors go in the one Orbax checkpoint of a step: pure functions.

- **Tree keys.** A job-wide tensor is one global array of the job, under its
  name split at "/" (``params/dense/kernel`` -> ``params`` / ``dense`` /
  ``kernel``). A rank's own tensor (a pipeline stage's parameters) goes under
  ``rank_<r>/<name>``, except in a world of one rank, where the rank's state is
  the whole tree: a single-process job's checkpoint is exactly its state.
- **Items.** A CheckpointManager's item (a layout holding the item record,
  bubblesnap/shared/checkpoint_record.py) names each tensor ``<item>/<path>``; the
  folder written is the item's own Orbax checkpoint, each tensor under its path.
- **Parameter names.** Orbax stores each leaf under its keys joined by "."
  (``params.dense.kernel``); two leaves with one name would overwrite each
  other, so :func:`conflict` refuses them as it refuses a key under a leaf.
- **The chunk grid.** Daemons write one array concurrently, each its own
  regions; a zarr chunk written by two of them would be a race. The chunk
  grid (Orbax's ``write_shape``) is the greatest common divisor, per
  dimension, of the dimension and every region edge known: every region is
  then whole chunks. A JAX sharding cuts a dimension into equal parts, so any
  one rank's regions give the same grid as all of them; other layouts need
  every rank's regions (the writer's ``job_layouts``).
"""

import itertools
import math

Box = tuple[tuple[int, int], ...]


def tree_key(name: str, rank: int, world_size: int, job_wide: bool) -> tuple[str, ...]:
    """The keys of tensor ``name`` of ``rank`` in the checkpoint's nested dicts."""
    parts = tuple(name.split("/"))
    if job_wide or world_size == 1:
        return parts
    return (f"rank_{rank}", *parts)


def item_key(name: str, rank: int, world_size: int, job_wide: bool) -> tuple[str, ...]:
    """The key of tensor ``name`` (``<item>/<path>``) of a CheckpointManager's item: the
    item, then the path's keys (each unescaped: the client escapes "/" and "%" in a
    key as "%2F" and "%25"), a rank's own tensor under ``rank_<r>`` inside its item."""
    item, *path = name.split("/")
    keys = tuple(p.replace("%2F", "/").replace("%25", "%") for p in path)
    if not (job_wide or world_size == 1):
        keys = (f"rank_{rank}", *keys)
    return (item, *keys)


def param_name(key: tuple[str, ...]) -> str:
    """Orbax's name of the leaf at ``key`` (``orbax ... tree.utils.param_name_from_keypath``
    of dict keys): the path of its array in the checkpoint."""
    return ".".join(key)


def write_shape(shape: tuple[int, ...], boxes) -> tuple[int, ...]:
    """The chunk grid's cell: per dimension the gcd of its size and every edge of
    ``boxes`` (regions of the array, of any ranks). Empty boxes have no edges."""
    cell = []
    for axis, dim in enumerate(shape):
        size = dim
        for box in boxes:
            if all(stop > start for start, stop in box):
                size = math.gcd(size, *box[axis])
        cell.append(max(1, size))  # zarr has no zero-sized chunks
    return tuple(cell)


def is_aligned(box: Box, shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    """Whether ``box`` is whole chunks of the grid ``chunks`` (the last one in a
    dimension may be cut by the array's end)."""
    return all(start % c == 0 and (stop % c == 0 or stop == dim)
               for (start, stop), dim, c in zip(box, shape, chunks, strict=True))


def chunk_shape(grid: tuple[int, ...], itemsize: int, most_bytes: int,
                least_bytes: int) -> tuple[int, ...]:
    """The chunks a cell of ``grid`` is written in: the leading axes cut first, each to
    the largest divisor of its length that brings a chunk to ``most_bytes`` (an axis
    that cannot is cut to 1 and the next one tried), so that a chunk is one run of the
    cell's C-order bytes. A cut that would leave chunks under ``least_bytes`` (a prime
    length, say: millions of tiny chunks cost more than a few large ones) is not made:
    the chunks are then those of the last cut made, the whole cell if none."""
    chunk, best = list(grid), tuple(grid)
    for axis, length in enumerate(grid):
        rest = itemsize * math.prod(chunk[axis + 1:])
        if rest * chunk[axis] <= most_bytes:
            break
        cut = max((d for d in _divisors(length) if rest * d <= most_bytes), default=1)
        if rest * cut < least_bytes:
            break
        chunk[axis] = cut
        best = tuple(chunk)
        if rest * cut <= most_bytes:
            break
    return best


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def row_pieces(box: Box, chunks: tuple[int, ...], itemsize: int,
               most_bytes: int) -> list[Box]:
    """``box`` (whole chunks of the grid ``chunks``) cut at chunk edges into pieces of at
    most ``most_bytes`` each, in order, each one run of the box's C-order bytes. The cut
    is along the first axis; but where one index of a leading axis is more than
    ``most_bytes`` and its chunks are one index thick (a stack of layers, chunked a
    layer's rows at a time), the pieces take one index of it at a time and the next axis
    is cut so. A piece is at least one chunk row thick along the axis cut (so it may
    pass ``most_bytes``). A box with no elements is its one piece."""
    extents = [b - a for a, b in box]
    if math.prod(extents) == 0 or not box:
        return [box]
    axis = 0
    while (axis + 1 < len(box) and chunks[axis] == 1
           and itemsize * math.prod(extents[axis + 1:]) > most_bytes):
        axis += 1
    row_bytes = itemsize * math.prod(extents[axis + 1:])
    step = chunks[axis] * max(1, most_bytes // max(1, row_bytes * chunks[axis]))
    start, stop = box[axis]
    cuts = [(a, min(a + step, stop)) for a in range(start, stop, step)]
    return [(*((i, i + 1) for i in index), cut, *box[axis + 1:])
            for index in itertools.product(*(range(a, b) for a, b in box[:axis]))
            for cut in cuts]


def rows_of(box: Box, piece: Box):
    """The index that takes ``piece`` (of :func:`row_pieces`) out of an array of
    ``box``'s elements (all of a 0-d box): a view of one run of its bytes."""
    if not box:
        return ...
    return tuple(slice(a - start, b - start) for (a, b), (start, _) in zip(piece, box,
                                                                          strict=True))


def conflict(leaves) -> str | None:
    """Why ``leaves`` cannot share one checkpoint (None: they can).

    ``leaves`` are (key, owner) pairs: owner None for a job-wide array (the
    ranks writing parts of it name one leaf), else the rank owning the tensor.
    Refused: an empty part, two owners at one key, a leaf with keys under it,
    two leaves with one Orbax parameter name.
    """
    owners, names = {}, {}
    for key, owner in set(leaves):
        if any(not part for part in key):
            return f"{'/'.join(key)!r} has an empty part"
        if owners.setdefault(key, owner) != owner:
            return f"{'/'.join(key)!r} is written twice (by {_owner(owner)} and " \
                   f"{_owner(owners[key])})"
        other = names.setdefault(param_name(key), key)
        if other != key:
            return (f"{'/'.join(key)!r} and {'/'.join(other)!r} are both Orbax parameter "
                    f"{param_name(key)!r}")
    for key in owners:
        for cut in range(1, len(key)):
            if key[:cut] in owners:
                return f"{'/'.join(key)!r} nests under the tensor {'/'.join(key[:cut])!r}"
    return None


def _owner(owner) -> str:
    return "the job" if owner is None else f"rank {owner}"


def leaf(key: tuple[str, ...], rank: int, job_wide: bool) -> tuple[tuple[str, ...], int | None]:
    """The (key, owner) pair :func:`conflict` takes."""
    return key, None if job_wide else rank
