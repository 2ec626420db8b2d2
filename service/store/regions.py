"""Regions of a tensor: boxes of its global shape, and whether some boxes cover it. Pure.

A box is one (start, stop) pair per dimension, half-open. Shards copied by
the ranks of a job are boxes of a global array; a step is whole only when
the boxes of the copies cover every element of every array.
"""

import itertools
import math

Box = tuple[tuple[int, int], ...]


def whole(shape) -> Box:
    return tuple((0, d) for d in shape)


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor; None when they do not meet."""
    common = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    if any(start >= stop for start, stop in common):
        return None
    return common


def relative(box: Box, within: Box) -> tuple[slice, ...]:
    """``box`` as slices into an array that holds ``within`` (``box`` lies inside it)."""
    return tuple(slice(b0 - w0, b1 - w0) for (b0, b1), (w0, _) in zip(box, within, strict=True))


def missing(shape, boxes) -> Box | None:
    """A box of ``shape`` that no box of ``boxes`` covers (the first in C order), or None
    when they cover it all. An empty tensor (a zero dimension) is always covered.

    The boxes' edges cut every dimension into intervals; the grid of those
    intervals is walked cell by cell. Shardings produce few edges per
    dimension, so the grid stays small.
    """
    if any(d == 0 for d in shape):
        return None
    boxes = [b for b in boxes if volume(b) > 0]
    edges = [sorted({0, dim, *(e for b in boxes for e in b[axis])})
             for axis, dim in enumerate(shape)]
    cells = [list(itertools.pairwise(e)) for e in edges]
    return _first_uncovered((), cells, boxes)


def _first_uncovered(prefix: Box, cells, boxes) -> Box | None:
    axis = len(prefix)
    if axis == len(cells):
        return None if any(_contains(b, prefix) for b in boxes) else prefix
    for interval in cells[axis]:
        here = (*prefix, interval)
        # Only boxes that contain this cell's prefix can cover the rest of it.
        inside = [b for b in boxes if _contains(b[:axis + 1], here)]
        if not inside:  # nothing covers this slab: all of it is missing
            return (*here, *((c[0][0], c[-1][1]) for c in cells[axis + 1:]))
        found = _first_uncovered(here, cells, inside)
        if found is not None:
            return found
    return None


def _contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def describe(name: str, box: Box) -> str:
    """How a person reads a region: 'w' [4:8, 0:4]."""
    return f"{name!r} [{', '.join(f'{a}:{b}' for a, b in box)}]"
