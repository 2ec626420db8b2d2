"""What may enter the daemon: the rules for job and tensor names, ranks, steps, replica
groups, counts of repeated fields, dtypes, shapes and boxes, with their ranges. Pure.

The RPC edge (rpc/messages.py) checks every request with them in one pass, before
any part of the daemon sees it; the store checks what it reads back from disk
(store/persistence.py) and builds layouts (store/layout.py) with the same rules.
"""

import math
import re

from bubblesnap.service.errors import InvalidArgument, shown

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


def check_world(rank: int, world_size: int) -> None:
    if not 1 <= world_size <= MAX_RANKS:
        raise InvalidArgument(f"world_size {world_size} must be between 1 and {MAX_RANKS}")
    check_rank(rank, world_size)
