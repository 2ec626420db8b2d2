"""Device-to-host transfer through Orbax's own path, and host-to-device placement."""

import jax
import numpy as np
from bubblesnap.clients._shared_memory import as_bytes
from orbax.checkpoint._src.serialization import replica_slices


def fetch_to_host(leaves) -> list[np.ndarray]:
    """Host bytes of every staged shard of ``leaves``, in layout order.

    Orbax starts every device-to-host copy (into pinned host memory where the
    device has it) before waiting on any, then hands back numpy arrays; on the
    CPU backend they are views of the device buffers, so the only copy is the
    one into the daemon's shared memory.
    """
    arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
    transferred = iter(replica_slices.transfer_arrays_to_host(
        arrays, replica_id=None, use_replica_parallel=False, enable_pinned_host_transfer=True))
    host = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            host.extend(as_bytes(rs.unsliced_data) for rs in next(transferred).replica_slices)
        else:
            host.append(as_bytes(leaf))
    return host


def place(global_shape, dtype, sharding, stored: dict, index_of) -> jax.Array:
    """Builds a jax.Array with ``sharding`` from stored host shards.

    ``stored`` maps a shard index ((start, stop) per dimension) to a private
    host array holding it. A device whose index was stored as-is gets that
    array (aliased on the CPU backend, no copy); otherwise the global array is
    assembled once and sliced, which handles a change of sharding.
    """
    device_map = sharding.addressable_devices_indices_map(global_shape)
    assembled = None
    per_device = []
    for device, index in device_map.items():
        key = index_of(index)
        host = stored.get(key)
        if host is None:
            if assembled is None:
                held = sum(int(np.prod([b - a for a, b in idx])) for idx in stored)
                if held != int(np.prod(global_shape)):
                    raise ValueError(
                        f"this rank holds {held} of the {int(np.prod(global_shape))} elements; "
                        "the requested sharding needs shards held by other ranks")
                assembled = np.empty(global_shape, dtype)
                for (idx, data) in stored.items():
                    assembled[tuple(slice(a, b) for a, b in idx)] = data
            host = np.ascontiguousarray(assembled[tuple(slice(a, b) for a, b in key)])
        per_device.append(jax.device_put(host, device, may_alias=True))
    return jax.make_array_from_single_device_arrays(global_shape, sharding, per_device)
