"""Regions of a tensor: boxes of its global shape, and whether some boxes cover it. Pure.

A box is one (start, stop) pair per dimension, half-open. Shards copied by
the ranks of a job are boxes of a global array; a step is whole only when
the boxes of the copies cover every element of every array.
"""

import itertools
import math

from bubblesnap.service.errors import InvalidArgument

Box = tuple[tuple[int, int], ...]

#: Work :func:`missing` does at most (cells visited plus boxes looked at in them):
#: shardings cut a tensor into few pieces, and a set of boxes that needs more
#: (crafted to) is refused, not walked for ever under the store's lock.
MAX_WORK = 1 << 20


class TooFragmented(InvalidArgument):
    """The boxes cut the tensor into more pieces than MAX_WORK allows to check."""


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
    intervals is walked cell by cell, skipping a slab one box covers whole.
    Shardings produce few edges per dimension, so the walk stays short;
    TooFragmented past MAX_WORK.
    """
    if any(d == 0 for d in shape):
        return None
    boxes = [b for b in boxes if volume(b) > 0]
    edges = [sorted({0, dim, *(e for b in boxes for e in b[axis])})
             for axis, dim in enumerate(shape)]
    cells = [list(itertools.pairwise(e)) for e in edges]
    return _first_uncovered((), cells, boxes, [MAX_WORK])


def _first_uncovered(prefix: Box, cells, boxes, left: list[int]) -> Box | None:
    """The first uncovered box of the slab ``prefix`` x (every later dimension whole);
    every box of ``boxes`` contains ``prefix``."""
    axis = len(prefix)
    rest = tuple((c[0][0], c[-1][1]) for c in cells[axis:])
    if any(_contains(b, (*prefix, *rest)) for b in boxes):
        return None
    if axis == len(cells):
        return prefix
    # A sweep along this axis: the boxes that span each interval (an interval lies
    # between two neighbouring edges, so a box spanning its start spans it all).
    pending = sorted(boxes, key=lambda b: b[axis][0], reverse=True)
    spanning: list = []
    for start, stop in cells[axis]:
        while pending and pending[-1][axis][0] <= start:
            spanning.append(pending.pop())
        spanning = [b for b in spanning if b[axis][1] >= stop]
        left[0] -= 1 + len(spanning)
        if left[0] < 0:
            raise TooFragmented(f"the regions given cut a tensor of shape "
                                f"{tuple(c[-1][1] for c in cells)} into too many pieces to "
                                "check; shard it on a regular grid")
        here = (*prefix, (start, stop))
        if not spanning:  # nothing covers this slab: all of it is missing
            return (*here, *rest[1:])
        found = _first_uncovered(here, cells, spanning, left)
        if found is not None:
            return found
    return None


def _contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def describe(name: str, box: Box) -> str:
    """How a person reads a region: 'w' [4:8, 0:4]."""
    return f"{name!r} [{', '.join(f'{a}:{b}' for a, b in box)}]"
