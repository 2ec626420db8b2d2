"""Which held shards serve the regions a restore asks for: a pure plan, no I/O.

A restore by regions names, per tensor, the boxes the caller's devices
need. The step's copies (one layout per rank) say which boxes each rank
copied. A job-wide array's regions may come from any rank; a rank's own
tensor only from that rank (its copier), and only into the world size it
was taken with. In a world of one, rank 0's tensors are the job's whole
state, so they serve any caller. Every region asked must be covered by the
pieces planned, else the plan is refused naming the tensor and the region.
"""

import dataclasses
from collections.abc import Callable

from bubblesnap.service.errors import FailedPrecondition, NotFound
from bubblesnap.service.store import regions
from bubblesnap.service.store.layout import Layout
from bubblesnap.service.store.regions import Box


@dataclasses.dataclass(frozen=True)
class Asked:
    """One tensor of a restore request (validated against nothing yet)."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnswerForm:
    """How the caller reads a restore's answer.

    several_segments: slots may point into several segments (RestoreStream), so a
      region that lies as one run in a copy is answered where it lies. Default False.
    checksums: the caller checks the answer's checksums; without, the regions cut
      anew are not hashed (checksum 0). Their sources are verified either way.
      Default True.
    """

    several_segments: bool = False
    checksums: bool = True


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part ``box`` (global coordinates) of a requested region comes from slot ``slot`` of
    ``rank``'s copy, whose shard covers ``source_box``."""

    rank: int
    slot: int
    box: Box
    source_box: Box

    def run(self, itemsize: int) -> tuple[int, int] | None:
        """(byte offset, nbytes) of ``box`` inside its source shard when its bytes there are
        one run in C order (single indices on the leading axes, then one range, then whole
        axes): a restore may hand that run over as it lies. None when they are not, or
        the box is empty."""
        whole_from = len(self.box)
        while whole_from and self.box[whole_from - 1] == self.source_box[whole_from - 1]:
            whole_from -= 1
        if any(b - a != 1 for a, b in self.box[:max(0, whole_from - 1)]) or \
                regions.volume(self.box) == 0:
            return None
        offset = 0
        for (a, _), (s, t) in zip(self.box, self.source_box, strict=True):
            offset = offset * (t - s) + (a - s)
        return offset * itemsize, regions.volume(self.box) * itemsize


@dataclasses.dataclass(frozen=True)
class RegionPlan:
    """``pieces[t][r]``: what fills region ``r`` of asked tensor ``t``."""

    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]

    def sources(self) -> list[tuple[int, int]]:
        """The (rank, slot) of every copy's shard the plan reads, each once, in order."""
        seen = {}
        for tensor in self.pieces:
            for region in tensor:
                for piece in region:
                    seen.setdefault((piece.rank, piece.slot), None)
        return list(seen)

    def exact_copy(self) -> int | None:
        """A rank whose copy holds every region asked as one of its shards, box for box:
        that copy can be served as it is (no bytes move). None if there is none."""
        ranks = {p.rank for tensor in self.pieces for region in tensor for p in region}
        whole = all(len(region) == 1 and region[0].box == region[0].source_box
                    for tensor in self.pieces for region in tensor)
        return ranks.pop() if whole and len(ranks) == 1 else None


def plan(asked: list[Asked], layouts: dict[int, Layout], world_size: int, caller: int,
         caller_world: int) -> RegionPlan:
    """The pieces that fill every region ``asked`` from the step's copies ``layouts``
    (rank -> layout, ranks of a replica group by their copier), taken with
    ``world_size`` ranks; ``caller`` is the rank whose own tensors it may read (its
    copier), ``caller_world`` its world size (0: not said)."""
    job_wide, own = _shards_by_tensor(layouts, world_size)
    tiled: dict[str, bool] = {}
    planned = []
    for request in asked:
        found = job_wide.get(request.name)
        if found is None:
            found = own.get((caller, request.name))
            if found is not None and caller_world and caller_world != world_size:
                raise FailedPrecondition(
                    f"{request.name!r} is rank {caller}'s own tensor of a step taken by "
                    f"{world_size} ranks; it restores only into {world_size} ranks, not "
                    f"{caller_world} (job-wide arrays restore into any number)")
        if found is None:
            held = sorted({*job_wide, *(n for r, n in own if r == caller)})
            raise NotFound(f"the step holds no tensor {request.name!r} for rank {caller} "
                           f"(it holds {held[:5]}{'...' if len(held) > 5 else ''}): restore "
                           "into the state structure it was saved from")
        dtype, shape, candidates = found
        if (dtype, shape) != (request.dtype, request.global_shape):
            raise FailedPrecondition(
                f"{request.name!r} was saved as {dtype}{list(shape)}; the target asks for "
                f"{request.dtype}{list(request.global_shape)}")

        def covered(box: Box, name=request.name, shape=shape, candidates=candidates) -> bool:
            if name not in tiled:  # asked only of a box no one shard holds
                tiled[name] = _tiles(shape, candidates)
            return tiled[name] and _inside(box, shape)

        planned.append(tuple(_fill(request.name, box, candidates, covered)
                             for box in request.boxes))
    return RegionPlan(tuple(planned))


def _tiles(shape, candidates: list[Piece]) -> bool:
    """Whether the shards (told apart by box) cover the tensor, none overlapping another:
    then the shards that meet a box inside it cover that box, with no gap to look for
    box by box (the walk that looks is most of a reshard's plan)."""
    boxes = {c.source_box for c in candidates}
    if sum(regions.volume(b) for b in boxes) != regions.volume(regions.whole(shape)):
        return False
    try:
        return regions.missing(shape, list(boxes)) is None
    except regions.TooFragmented:  # then each box is walked on its own, as before
        return False


def _inside(box: Box, shape) -> bool:
    return all(0 <= a <= b <= d for (a, b), d in zip(box, shape, strict=True))


def _shards_by_tensor(layouts: dict[int, Layout], world_size: int) -> tuple[dict, dict]:
    """The copies' shards: job-wide arrays by name, a rank's own tensors by (rank, name),
    each as (dtype, shape, [Piece per shard covering it whole])."""
    job_wide: dict = {}
    own: dict = {}
    for rank, layout in sorted(layouts.items()):
        pieces = {t: [] for t in range(len(layout.tensors))}
        for slot, (t, s, _, _) in enumerate(layout.slots()):
            box = layout.tensors[t].shards[s].index
            pieces[t].append(Piece(rank, slot, box, box))
        for t, tensor in enumerate(layout.tensors):
            if tensor.job_wide or world_size == 1:
                entry = job_wide.setdefault(tensor.name, (tensor.dtype, tensor.global_shape, []))
                entry[2].extend(pieces[t])
            else:
                own[(rank, tensor.name)] = (tensor.dtype, tensor.global_shape, pieces[t])
    return job_wide, own


def _fill(name: str, box: Box, candidates: list[Piece],
          covered: Callable[[Box], bool]) -> tuple[Piece, ...]:
    """Pieces covering ``box``: one shard that holds it all if there is one, else every
    shard that meets it (a box met twice by identical shards is read once); ``covered``:
    whether the shards are known to cover it (else a gap is looked for, and refused)."""
    met = [(c, regions.intersect(c.source_box, box)) for c in candidates]
    for c, common in met:
        if common == box:
            return (Piece(c.rank, c.slot, box, c.source_box),)
    pieces, boxes = [], set()
    for c, common in met:
        if common is not None and common not in boxes:
            boxes.add(common)
            pieces.append(Piece(c.rank, c.slot, common, c.source_box))
    if covered(box):
        return tuple(pieces)
    gap = regions.missing(tuple(b - a for a, b in box),
                          [tuple((p0 - b0, p1 - b0) for (p0, p1), (b0, _) in
                                 zip(p.box, box, strict=True)) for p in pieces])
    if gap is not None:
        absolute = tuple((g0 + b0, g1 + b0) for (g0, g1), (b0, _) in zip(gap, box, strict=True))
        raise FailedPrecondition(f"no copy of the step holds {regions.describe(name, absolute)}"
                                 "; the ranks' copies do not cover it")
    return tuple(pieces)
