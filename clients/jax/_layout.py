"""Pytrees of jax.Arrays <-> the daemon's tensor specs: names, dtypes, shards."""

import jax
import numpy as np
from orbax.checkpoint._src.serialization import replica_slices

from bubblesnap.protos import daemon_pb2 as pb


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
        if not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            raise TypeError(
                f"state leaf {name!r} is a {type(leaf).__name__}; bubblesnap snapshots arrays "
                "only: keep Python scalars out of the state or wrap them with jnp.asarray")
        names.append(name)
        leaves.append(leaf)
    return names, leaves, treedef


def normalize_index(index, shape) -> tuple[tuple[int, int], ...]:
    """A tuple of slices (possibly open-ended) as (start, stop) pairs."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for sl, dim in zip(index, shape, strict=True):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {sl} is not supported")
        out.append((start, stop))
    return tuple(out)


def owned_indices(array) -> list[tuple[tuple[int, int], ...]]:
    """The shard indices this process stages for ``array``, one per distinct shard.

    Uses Orbax's choice of replica slices, so a shard replicated over several
    local devices is copied once.
    """
    if isinstance(array, np.ndarray):
        return [tuple((0, d) for d in array.shape)]
    slices = replica_slices.get_replica_slices(array, replica_id=None, use_replica_parallel=False)
    return [normalize_index(rs.index, array.shape) for rs in slices.replica_slices]


def tensor_specs(names, leaves) -> list[pb.TensorSpec]:
    specs = []
    for name, leaf in zip(names, leaves, strict=True):
        dtype = np.dtype(leaf.dtype)
        specs.append(pb.TensorSpec(
            name=name, dtype=dtype.name, global_shape=leaf.shape, shards=[
                pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in index],
                             nbytes=int(np.prod([b - a for a, b in index], dtype=np.int64))
                             * dtype.itemsize)
                for index in owned_indices(leaf)]))
    return specs


class SpecCache:
    """Tensor specs of the last state layout seen; recomputed only when the layout changes."""

    def __init__(self):
        self._signature = None
        self._specs = None

    def specs(self, names, leaves) -> list[pb.TensorSpec]:
        signature = tuple((n, leaf.shape, str(leaf.dtype), getattr(leaf, "sharding", None))
                          for n, leaf in zip(names, leaves, strict=True))
        if signature != self._signature:
            self._signature, self._specs = signature, tensor_specs(names, leaves)
        return self._specs
