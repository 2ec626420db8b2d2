"""Validation of a rank's state layout: pure functions, no I/O.

A layout arrives from the network and becomes the plan for a shared-memory
segment, so everything a hostile or buggy client could get wrong is checked
here: names, dtypes, shapes, shard bounds, byte counts.
"""

import dataclasses
import math
import re

from bubblesnap.service.errors import FailedPrecondition, InvalidArgument, shown
from bubblesnap.service.store import regions

#: Job names are used as labels and map keys, never as paths; still, keep them
#: to a safe alphabet so they can be logged, exported and typed.
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: A CheckpointManager's item is a job named by its whole folder: "<the manager's
#: directory, resolved>/<item>" (two managers of different folders are two jobs even when
#: the folders share their last name). Still never a path: a Persist names where to write.
#: A job named by a bucket's folder: a CheckpointManager's directory on object storage.
_URL_JOB = re.compile(r"(gs|s3)://")
_PATH_PART = re.compile(r"[^\x00-\x1f\x7f/]{1,255}")
MAX_PATH_JOB = 4096
_MAX_TENSOR_NAME = 1024
MAX_TENSORS = 1 << 16
MAX_RANKS = 1 << 20
#: Shards of one tensor one rank copies (a process holds a few per local device).
MAX_SHARDS = 1 << 12
#: Shards of one rank's layout, all tensors together.
MAX_SLOTS = 1 << 18
#: Dimensions of a tensor (numpy allows 64).
MAX_DIMS = 64
#: Bytes of a tensor's global array, and of a rank's segment: every size and offset the
#: daemon answers with fits an int64, with room for the sums made of them.
MAX_BYTES = 1 << 62
#: Steps (and iterations) are 0 <= step < MAX_STEP: a step after a step still fits an int64.
MAX_STEP = 1 << 62

#: Item sizes of the dtypes a shard may have. The daemon never interprets the
#: bytes, it only needs their count, so it keeps no dependency on numpy dtypes.
ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}


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


def check_job_name(job: str) -> None:
    """A job is named by 1-128 characters from A-Z a-z 0-9 . _ - (starting with a letter or
    digit), or, a CheckpointManager's item, by a normalized absolute path or a bucket's
    (``gs://bucket/path``, ``s3://bucket/path``)."""
    if not job:
        raise InvalidArgument("job name is empty; pass the name the trainer registered")
    if is_folder_job(job):
        path = job.split("://", 1)[1] if _URL_JOB.match(job) else job[1:]
        parts = path.split("/")
        if len(job) > MAX_PATH_JOB or not all(
                _PATH_PART.fullmatch(p) and p not in (".", "..") for p in parts):
            raise InvalidArgument(
                f"job name {shown(job)} is not allowed: a job named by a folder is a "
                f"normalized absolute path or bucket URL of at most {MAX_PATH_JOB} characters "
                "(no empty, '.' or '..' parts, no control characters)")
        return
    if not _JOB_NAME.fullmatch(job):
        raise InvalidArgument(
            f"job name {shown(job)} is not allowed: use 1-128 characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit, or a normalized absolute "
            "path (a CheckpointManager's folder and item)")


def is_folder_job(job: str) -> bool:
    """Whether ``job`` is named by a folder or a bucket's (a CheckpointManager's item, never
    written to ``--durable-dir/<job>`` by the daemon's own policy: its manager says what
    persists)."""
    return job.startswith("/") or bool(_URL_JOB.match(job))


def check_rank(rank: int, world_size: int | None = None) -> None:
    if rank < 0:
        raise InvalidArgument(f"rank {rank} is negative")
    if rank >= MAX_RANKS:
        raise InvalidArgument(f"rank {rank} is beyond the {MAX_RANKS} ranks a job may have")
    if world_size is not None and rank >= world_size:
        raise InvalidArgument(f"rank {rank} is outside world_size {world_size}")


def check_replica_group(rank: int, world_size: int, group) -> tuple[int, ...]:
    """The replica group of ``rank`` as the daemon keeps it: sorted, itself included.

    The group lists the ranks whose state is identical to this rank's (its
    data-parallel replicas); its lowest rank is the one that copies it.
    """
    if len(group) > world_size:
        raise InvalidArgument(
            f"replica_group of rank {rank} lists {len(group)} ranks; the job has "
            f"{world_size}: list each replica once")
    for member in group:
        if not 0 <= member < world_size:
            raise InvalidArgument(
                f"replica_group {shown(list(group))} of rank {rank} names rank {member}, outside "
                f"world_size {world_size}; list the ranks 0..{world_size - 1} whose state is "
                "identical to this rank's (its data-parallel replicas)")
    return tuple(sorted({rank, *group}))


def check_held_for(job: str, rank: int, copier: int, declared) -> None:
    """A copier's copy serves ``rank`` only if the copier declared ``rank`` its replica:
    a caller's group alone must not hand it another rank's state."""
    if rank not in declared:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} asks to be held through rank {copier}'s copies, but "
            f"rank {copier} declared replica group {list(declared)}, without rank {rank}; "
            "pass the group the trainers register")


def check_step(step: int) -> None:
    if step < 0:
        raise InvalidArgument(f"step {step} is negative; steps count from 0")
    if step >= MAX_STEP:
        raise InvalidArgument(f"step {step} is beyond the last step, {MAX_STEP - 1}")


def check_count(what: str, count: int, most: int) -> None:
    """A repeated field of a request holds at most ``most`` entries."""
    if count > most:
        raise InvalidArgument(f"{count} {what}; at most {most} in one request")


def check_tensor_name(name: str) -> None:
    if not name:
        raise InvalidArgument("a tensor has an empty name")
    if len(name) > _MAX_TENSOR_NAME:
        raise InvalidArgument(f"tensor name {shown(name)} has {len(name)} characters; at "
                              f"most {_MAX_TENSOR_NAME}")
    if "\x00" in name or any(ord(c) < 32 for c in name):
        raise InvalidArgument(f"tensor name {shown(name)} contains a NUL or control character")
    if any(part in ("..", ".") for part in name.split("/")) or name.startswith("/"):
        raise InvalidArgument(
            f"tensor name {shown(name)} contains a '.' or '..' component or a leading '/'; "
            "names are pytree paths like 'params/dense/kernel'")


def check_dtype(name: str, dtype: str) -> int:
    """The item size of ``dtype``, a dtype the daemon knows, of tensor ``name``."""
    if dtype not in ITEMSIZE:
        raise InvalidArgument(f"tensor {name!r} has unknown dtype {shown(dtype)}; "
                              f"known: {', '.join(sorted(ITEMSIZE))}")
    return ITEMSIZE[dtype]


def check_shape(name: str, dtype: str, shape) -> tuple[int, ...]:
    """A global shape from the wire: at most MAX_DIMS dimensions, none negative, and an
    array of at most MAX_BYTES."""
    shape = tuple(shape)
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"tensor {name!r} has {len(shape)} dimensions; at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor {name!r} has a negative dimension in {shape}")
    if max(shape, default=0) > MAX_BYTES or \
            math.prod(shape) * ITEMSIZE[dtype] > MAX_BYTES:
        raise InvalidArgument(f"tensor {name!r} of shape {shape} and dtype {dtype} passes "
                              f"{MAX_BYTES} bytes")
    return shape


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


def check_box(name: str, shape: tuple[int, ...], box) -> tuple[tuple[int, int], ...]:
    """A region of tensor ``name``: one (start, stop) per dimension, inside its shape."""
    if len(box) != len(shape):
        raise InvalidArgument(
            f"a region of {name!r} has {len(box)} index dimensions; "
            f"the global shape {shape} has {len(shape)}")
    for (start, stop), dim in zip(box, shape, strict=True):
        if not 0 <= start <= stop <= dim:
            raise InvalidArgument(
                f"a region of {name!r} covers [{start}, {stop}) on a dimension of size {dim}")
    return tuple(box)


def _build_shard(name: str, dtype: str, shape: tuple[int, ...], spec) -> Shard:
    index = check_box(name, shape, tuple((s.start, s.stop) for s in spec.index))
    expected = math.prod(stop - start for start, stop in index) * ITEMSIZE[dtype]
    if spec.nbytes != expected:
        raise InvalidArgument(
            f"a shard of {name!r} declares {spec.nbytes} bytes; its index and dtype "
            f"{dtype} make {expected}")
    return Shard(index, expected)


def check_world(rank: int, world_size: int) -> None:
    if not 1 <= world_size <= MAX_RANKS:
        raise InvalidArgument(f"world_size {world_size} must be between 1 and {MAX_RANKS}")
    check_rank(rank, world_size)
