"""Which device-to-host path the JAX client fetches shards through, chosen once a process.

Orbax's own transfer path (``orbax.checkpoint._src.serialization.replica_slices``: every
copy into pinned host memory started before any is waited on) is a private module: it
may move, change its signature or its choice of shards in any Orbax release. It is used
where it imports and, on a probe array of this process's devices, picks exactly the
shards JAX's public API names as replica 0 (Orbax's multi-host rule, which the daemon's
layouts assume). Anywhere else the client takes the same shards through JAX's public API
(``Shard.replica_id``, ``copy_to_host_async``). The choice is logged once, with why;
``BUBBLESNAP_FETCH_PATH=jax`` takes the public path without asking Orbax.
"""

import dataclasses
import functools
import logging
import os

import jax
import numpy as np

log = logging.getLogger("bubblesnap.client")

#: Orbax's multi-host rule: a process copies the shards its devices hold with this id.
REPLICA_ID = 0
#: Set to "jax": the public path, whatever Orbax's module would do.
ENV = "BUBBLESNAP_FETCH_PATH"


@dataclasses.dataclass(frozen=True)
class FetchPath:
    """The path chosen: ``orbax`` (its transfer module) or ``jax`` (the public API)."""

    name: str
    why: str
    module: object = None  # Orbax's replica_slices, when ``name`` is "orbax"


@functools.cache
def fetch_path() -> FetchPath:
    """The path of this process, chosen at its first call and logged."""
    chosen = _choose()
    log.info("bubblesnap: device-to-host fetch through %s (%s)",
             "Orbax's replica_slices" if chosen.name == "orbax" else "JAX's public API",
             chosen.why)
    return chosen


def replica_shards(array: jax.Array, path: FetchPath | None = None) -> list:
    """The shards of ``array`` this process copies, in the order it copies them: those
    its devices hold with replica id 0 (none when every such shard lives elsewhere).
    ``path``: this process's (default) or another."""
    path = path or fetch_path()
    if path.name == "orbax":
        return _orbax_shards(path.module, array)
    return [s for s in array.addressable_shards if s.replica_id == REPLICA_ID]


def transfer(arrays: list, path: FetchPath | None = None) -> list[list[np.ndarray]]:
    """Host copies of each array's replica shards (off the CPU backend: every copy
    started before any is waited on). ``path``: as for ``replica_shards``."""
    path = path or fetch_path()
    if path.name == "orbax":
        return [[rs.unsliced_data for rs in r.replica_slices]
                for r in path.module.transfer_arrays_to_host(
                    arrays, replica_id=REPLICA_ID, use_replica_parallel=False,
                    enable_pinned_host_transfer=True)]
    shards = [replica_shards(a, path) for a in arrays]
    for per_array in shards:
        for shard in per_array:
            shard.data.copy_to_host_async()
    return [[np.asarray(shard.data) for shard in per_array] for per_array in shards]


def _orbax_shards(module, array) -> list:
    """Orbax's replica slices as (index, data) pairs, like JAX's shards."""
    slices = module.get_replica_slices(array, replica_id=REPLICA_ID,
                                       use_replica_parallel=False).replica_slices
    return [_Slice(rs.index, rs.unsliced_data) for rs in slices]


@dataclasses.dataclass(frozen=True)
class _Slice:
    index: tuple
    data: object

    @property
    def device(self):
        return self.data.device


def _choose() -> FetchPath:
    if os.environ.get(ENV) == "jax":
        return FetchPath("jax", f"{ENV}=jax")
    try:
        from orbax.checkpoint._src.serialization import replica_slices
    except ImportError as err:
        return FetchPath("jax", f"Orbax's transfer module is not there: {err}")
    try:
        agrees = _agrees_with_jax(replica_slices)
    except Exception as err:  # any failure of a private API: it is not used
        return FetchPath("jax", f"Orbax's transfer module failed a probe: "
                                f"{type(err).__name__}: {err}"[:300])
    if not agrees:
        return FetchPath("jax", "Orbax's transfer module picks other shards than replica 0")
    import orbax.checkpoint
    return FetchPath("orbax", f"orbax-checkpoint {orbax.checkpoint.__version__}",
                     replica_slices)


def _agrees_with_jax(module) -> bool:
    """Whether Orbax picks, and transfers, exactly the replica-0 shards of a probe array
    replicated over this process's devices (sharded where there are several)."""
    devices = np.array(jax.local_devices())
    mesh = jax.sharding.Mesh(devices.reshape(len(devices), 1), ("a", "b"))
    spec = jax.sharding.PartitionSpec("a") if len(devices) > 1 else jax.sharding.PartitionSpec()
    probe = jax.device_put(np.arange(4 * len(devices), dtype=np.float32).reshape(-1, 2),
                           jax.sharding.NamedSharding(mesh, spec))
    wanted = [s for s in probe.addressable_shards if s.replica_id == REPLICA_ID]
    got = [(s.device, _key(s.index)) for s in _orbax_shards(module, probe)]
    if got != [(s.device, _key(s.index)) for s in wanted]:
        return False
    [host] = module.transfer_arrays_to_host([probe], replica_id=REPLICA_ID,
                                            use_replica_parallel=False,
                                            enable_pinned_host_transfer=True)
    copies = [np.asarray(rs.unsliced_data) for rs in host.replica_slices]
    return all(np.array_equal(c, np.asarray(probe)[s.index])
               for c, s in zip(copies, wanted, strict=True))


def _key(index) -> tuple:
    return tuple((i.start, i.stop, i.step) for i in index)
