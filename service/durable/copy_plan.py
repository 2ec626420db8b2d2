"""What a durable write puts where, for one pinned copy: its regions as Orbax array parts,
the sidecar fields of every tensor, and a CheckpointManager's item record. Pure but for the
views of the copy's segment it hands out (no copy of the bytes).

Two kinds of copy are written:

- a copy of one of bubblesnap's own jobs (``SnapshotClient``, ``NumpyClient``): the
  tensors of every rank make one Orbax checkpoint per step, each tensor under its tree key
  (``orbax_layout.tree_key``);
- a CheckpointManager's item (a job named by its folder, whose layout holds the record
  tensor, bubblesnap/shared/checkpoint_record.py): the item's tensors are named
  ``<item>/<path>`` and go under their path (the folder written is the item's); the record
  is not an array of the checkpoint but says what Orbax writes beside them, and its
  Python scalars become 0-d arrays as Orbax's ScalarHandler writes them.
"""

import dataclasses
import math

from bubblesnap.service.durable import checkpoint, item_files, orbax_layout
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable.sidecar import WrittenTensor
from bubblesnap.service.errors import FailedPrecondition
from bubblesnap.shared import checkpoint_record


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """``parts``: the arrays to write (views of the segment); ``tensors``: every tensor of
    the copy as its sidecar lists it (chunks filled in once written); ``record``: the item
    record the copy holds (a manager item's rank that copies it), else None; ``grids``:
    parameter name -> the chunk grid of each array the job's layouts know."""

    parts: list
    tensors: list
    record: dict | None
    grids: dict


def plan(pinned, known_layouts: dict, item: bool) -> CopyPlan:
    """The plan of writing ``pinned``. ``known_layouts``: rank -> layout of the job's other
    ranks this daemon knows (their regions pick the chunk grid of a job-wide array);
    ``item``: the copy is a CheckpointManager's item (else a step of bubblesnap's own
    clients). FailedPrecondition for a state the checkpoint cannot hold."""
    layout, rank, world = pinned.layout, pinned.rank, pinned.world_size

    def key_of(t, r):
        if item:
            return orbax_layout.item_key(t.name, r, world, t.job_wide)[1:]
        return orbax_layout.tree_key(t.name, r, world, t.job_wide)
    arrays = [(r, t) for r, lay in [(rank, layout), *known_layouts.items()]
              for t in lay.tensors if t.name != checkpoint_record.TENSOR]
    why = orbax_layout.conflict(orbax_layout.leaf(key_of(t, r), r, t.job_wide)
                                for r, t in arrays)
    if why is not None:
        raise FailedPrecondition(f"the state's names cannot be one checkpoint: {why}; "
                                 "not written")
    views = {}
    for t_index, s_index, offset, nbytes in pinned.slots:
        views.setdefault(t_index, []).append((s_index, offset, nbytes))
    parts, tensors, record, grids = [], [], None, {}
    for t_index, tensor in enumerate(layout.tensors):
        regions = tuple(
            (tensor.shards[s].index, pinned.segment.view[offset:offset + nbytes].view(
                fmt.numpy_dtype(tensor.dtype)).reshape(
                    tuple(b - a for a, b in tensor.shards[s].index)))
            for s, offset, nbytes in views.get(t_index, ()))
        if item and tensor.name == checkpoint_record.TENSOR:
            if regions:
                record = item_files.decode(regions[0][1])
            continue
        if math.prod(tensor.global_shape) == 0:
            raise FailedPrecondition(f"tensor {tensor.name!r} has no elements (shape "
                                     f"{tensor.global_shape}): Orbax cannot save it")
        key = key_of(tensor, rank)
        boxes = [s.index for s in tensor.shards]
        if tensor.job_wide:
            boxes += [s.index for lay in known_layouts.values() for t in lay.tensors
                      if t.job_wide and t.name == tensor.name for s in t.shards]
        param = orbax_layout.param_name(key)
        grid = orbax_layout.write_shape(tensor.global_shape, boxes)
        grids[param] = checkpoint.chunk_grid(grid, tensor.dtype)
        if regions:
            parts.append(checkpoint.ArrayPart(param, tensor.dtype, tensor.global_shape, grid,
                                              regions))
        tensors.append(WrittenTensor(
            tensor.name, tensor.dtype, tensor.global_shape, tensor.job_wide, key, (),
            tuple(s.index for s in tensor.shards),
            tuple(c for slot, c in zip(pinned.slots, pinned.checksums, strict=True)
                  if slot[0] == t_index)))
    if record is not None:
        parts += [checkpoint.ArrayPart(param, array.dtype.name, (), (), (((), array),))
                  for param, array in item_files.scalars(record)]
    return CopyPlan(parts, tensors, record, grids)


def with_chunks(tensors, chunks: dict) -> tuple:
    """The sidecar's tensors with the chunk grid each array was written with."""
    return tuple(dataclasses.replace(t, chunks=chunks.get(orbax_layout.param_name(t.key), ()))
                 for t in tensors)
