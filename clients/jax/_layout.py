"""Pytrees of jax.Arrays <-> the daemon's tensor specs: names, dtypes, shards, regions.

Snapshot side: which shards this process copies (Orbax's multi-host rule:
each distinct region by the process whose device holds it with replica id
0). Restore side: which regions this process's devices need.
"""

import dataclasses

import jax
import numpy as np

from bubblesnap.clients.jax import fetch_path
from bubblesnap.protos import daemon_pb2 as pb

#: A region of a tensor: (start, stop) per dimension, half-open.
Index = tuple[tuple[int, int], ...]


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flatten(tree) -> tuple[list[str], list, object]:
    """Leaf names ('params/dense/kernel'), leaves and treedef of a state pytree."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names, leaves = [], []
    for path, leaf in with_path:
        name = "/".join(_key_name(k) for k in path) or "root"
        if not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, HostValue)):
            raise TypeError(
                f"state leaf {name!r} is a {type(leaf).__name__}; bubblesnap snapshots arrays "
                "only: keep Python scalars out of the state or wrap them with jnp.asarray")
        names.append(name)
        leaves.append(leaf)
    return names, leaves, treedef


@dataclasses.dataclass(frozen=True)
class HostValue:
    """A host array that is one value of the whole job (Orbax's rule for numpy arrays,
    scalars and the manager's step record: the primary process saves them).

    Every rank declares it job-wide; only the rank where ``copied_here`` copies it,
    so it is copied once and any process count restores it.
    """

    array: np.ndarray
    copied_here: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype


def normalize_index(index, shape) -> Index:
    """A tuple of slices (possibly open-ended) as (start, stop) pairs."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for sl, dim in zip(index, shape, strict=True):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {sl} is not supported")
        out.append((start, stop))
    return tuple(out)


def owned_indices(array) -> list[Index]:
    """The shard indices this process copies for ``array``, one per distinct region.

    Orbax's multi-host rule: the shards this process's devices hold with
    replica id 0. Every distinct region of an array has exactly one such
    shard in the whole job, so each is copied once (a region replicated over
    several devices or processes included), and a process may copy none of
    an array whose replica-0 shards all live elsewhere.
    """
    if isinstance(array, HostValue):
        return [tuple((0, d) for d in array.shape)] if array.copied_here else []
    if isinstance(array, np.ndarray):
        return [tuple((0, d) for d in array.shape)]
    return [normalize_index(s.index, array.shape) for s in fetch_path.replica_shards(array)]


def is_job_wide(leaf, world_size: int) -> bool:
    """Whether ``leaf`` is one global array of the job rather than this rank's own.

    An array whose devices span several processes is; so is every array of
    a job that is this one process (world size 1): its arrays are the job's
    global arrays, and declaring them so lets more processes restore them
    later (1 -> N). An array on this process's devices alone in a job of
    several ranks (a pipeline stage's parameters) is the rank's own.
    """
    return world_size == 1 or isinstance(leaf, HostValue) or (
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable)


def _slices(index: Index) -> list[pb.Slice]:
    return [pb.Slice(start=a, stop=b) for a, b in index]


def _volume(index: Index) -> int:
    return int(np.prod([b - a for a, b in index], dtype=np.int64))


def tensor_specs(names, leaves, world_size: int) -> list[pb.TensorSpec]:
    """What a rank of a job of ``world_size`` registers: per leaf, the regions it
    copies (possibly none) and whether the leaf is job-wide."""
    specs = []
    for name, leaf in zip(names, leaves, strict=True):
        dtype = np.dtype(leaf.dtype)
        specs.append(pb.TensorSpec(
            name=name, dtype=dtype.name, global_shape=leaf.shape,
            job_wide=is_job_wide(leaf, world_size),
            shards=[pb.ShardSpec(index=_slices(index), nbytes=_volume(index) * dtype.itemsize)
                    for index in owned_indices(leaf)]))
    return specs


class SpecCache:
    """Tensor specs of the last state layout seen; recomputed only when the layout changes."""

    def __init__(self, world_size: int):
        self._world_size = world_size
        self._signature = None
        self._specs = None

    def specs(self, names, leaves) -> list[pb.TensorSpec]:
        signature = tuple((n, leaf.shape, str(leaf.dtype), getattr(leaf, "sharding", None))
                          for n, leaf in zip(names, leaves, strict=True))
        if signature != self._signature:
            self._signature = signature
            self._specs = tensor_specs(names, leaves, self._world_size)
        return self._specs


def target_sharding(leaf) -> jax.sharding.Sharding:
    """The sharding a restored leaf gets: its own, else the first local device."""
    return getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0])


def needed_regions(shape, sharding) -> tuple[dict, list[Index]]:
    """What this process's devices hold of an array of ``shape`` with ``sharding``:
    device -> region, and the distinct regions in first-seen order (a region
    several local devices hold is asked for once)."""
    per_device = {device: normalize_index(index, shape)
                  for device, index in sharding.addressable_devices_indices_map(shape).items()}
    return per_device, list(dict.fromkeys(per_device.values()))


def tensor_request(name: str, leaf, regions: list[Index]) -> pb.TensorRequest:
    """The restore request of one target leaf: its dtype, global shape and regions."""
    return pb.TensorRequest(name=name, dtype=np.dtype(leaf.dtype).name,
                            global_shape=leaf.shape,
                            regions=[pb.Region(index=_slices(index)) for index in regions])
