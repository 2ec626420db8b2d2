"""A rank's state layout (tensors, job-wide or the rank's own, shards, slots), built from
what arrives over the wire with the rules of service/checks.py: pure functions, no I/O.

A layout becomes the plan for a shared-memory segment, so everything a hostile or
buggy client could get wrong is checked before it is built: names, dtypes, shapes,
shard bounds, byte counts.
"""

import dataclasses
import math

from bubblesnap.service.checks import (
    ITEMSIZE,
    MAX_BYTES,
    MAX_SHARDS,
    MAX_SLOTS,
    MAX_TENSORS,
    check_box,
    check_count,
    check_dtype,
    check_shape,
    check_tensor_name,
)
from bubblesnap.service.errors import FailedPrecondition, InvalidArgument, shown
from bubblesnap.service.store import regions


@dataclasses.dataclass(frozen=True)
class Shard:
    """One stored piece of a tensor: ``index`` is one (start, stop) per dimension."""

    index: tuple[tuple[int, int], ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor of a rank's layout: ``shards`` are the regions this rank copies.

    ``job_wide``: one global array of the job (its regions spread over the
    ranks, which together cover it); otherwise the rank's own tensor, which
    its shards cover alone.
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    shards: tuple[Shard, ...]
    job_wide: bool = False


@dataclasses.dataclass(frozen=True)
class Layout:
    """The validated state layout of one rank."""

    tensors: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for t in self.tensors for s in t.shards)

    def slots(self) -> list[tuple[int, int, int, int]]:
        """(tensor, shard, offset, nbytes) of each shard packed in one segment.

        Offsets are 64-byte aligned so a slot can back an aligned array.
        """
        slots, offset = [], 0
        for ti, tensor in enumerate(self.tensors):
            for si, shard in enumerate(tensor.shards):
                slots.append((ti, si, offset, shard.nbytes))
                offset += _aligned(shard.nbytes)
        return slots

    @property
    def segment_bytes(self) -> int:
        """Size of the segment that holds every slot (at least 64 bytes)."""
        return max(64, sum(_aligned(s.nbytes) for t in self.tensors for s in t.shards))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def check_held_for(job: str, rank: int, copier: int, declared) -> None:
    """A copier's copy serves ``rank`` only if the copier declared ``rank`` its replica:
    a caller's group alone must not hand it another rank's state."""
    if rank not in declared:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} asks to be held through rank {copier}'s copies, but "
            f"rank {copier} declared replica group {list(declared)}, without rank {rank}; "
            "pass the group the trainers register")


def build_layout(tensors) -> Layout:
    """Validates ``TensorSpec`` messages and returns the layout they describe."""
    if not tensors:
        raise InvalidArgument("the layout has no tensors; register the state pytree you snapshot")
    check_count("tensors", len(tensors), MAX_TENSORS)
    check_count("shards", sum(len(spec.shards) for spec in tensors), MAX_SLOTS)
    seen, built = set(), []
    for spec in tensors:
        check_tensor_name(spec.name)
        if spec.name in seen:
            raise InvalidArgument(f"tensor name {shown(spec.name)} appears twice")
        seen.add(spec.name)
        check_dtype(spec.name, spec.dtype)
        shape = check_shape(spec.name, spec.dtype, spec.global_shape)
        if len(spec.shards) > MAX_SHARDS:
            raise InvalidArgument(f"tensor {spec.name!r} has {len(spec.shards)} shards; at "
                                  f"most {MAX_SHARDS}")
        shards = tuple(_build_shard(spec.name, spec.dtype, shape, s) for s in spec.shards)
        if not spec.job_wide:
            gap = regions.missing(shape, [shard.index for shard in shards])
            if gap is not None:
                raise FailedPrecondition(
                    f"tensor {spec.name!r} is this rank's own (not job_wide), but its shards "
                    f"leave {regions.describe(spec.name, gap)} uncovered: list every region "
                    "of it, or mark it job_wide if other ranks copy the rest")
        built.append(Tensor(spec.name, spec.dtype, shape, shards, spec.job_wide))
    layout = Layout(tuple(built))
    if layout.segment_bytes > MAX_BYTES:
        raise InvalidArgument(f"the layout's shards take {layout.segment_bytes} bytes (64-byte "
                              f"aligned); at most {MAX_BYTES} per rank")
    return layout


def _build_shard(name: str, dtype: str, shape: tuple[int, ...], spec) -> Shard:
    index = check_box(name, shape, tuple((s.start, s.stop) for s in spec.index))
    expected = math.prod(stop - start for start, stop in index) * ITEMSIZE[dtype]
    if spec.nbytes != expected:
        raise InvalidArgument(
            f"a shard of {name!r} declares {spec.nbytes} bytes; its index and dtype "
            f"{dtype} make {expected}")
    return Shard(index, expected)


