"""Device-to-host transfer through Orbax's own path, and host-to-device placement."""

import jax
import numpy as np
from bubblesnap.clients._shared_memory import as_bytes
from orbax.checkpoint._src.serialization import replica_slices


def fetch_to_host(leaves) -> list[np.ndarray]:
    """Host bytes of every staged shard of ``leaves``, in layout order.

    Orbax starts every device-to-host copy (into pinned host memory on
    accelerators) before waiting on any, then hands back numpy arrays. On the
    CPU backend they are views of the device buffers, so the only copy is the
    one into the daemon's shared memory; pinned transfer is left off there,
    since CPU devices report a pinned_host memory and Orbax would copy into it.
    """
    arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
    off_cpu = any(d.platform != "cpu" for a in arrays for d in a.sharding.device_set)
    transferred = iter(replica_slices.transfer_arrays_to_host(
        arrays, replica_id=None, use_replica_parallel=False, enable_pinned_host_transfer=off_cpu))
    host = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            host.extend(as_bytes(rs.unsliced_data) for rs in next(transferred).replica_slices)
        else:
            host.append(as_bytes(leaf))
    return host


def place(global_shape, dtype, sharding, stored: dict, index_of) -> jax.Array:
    """Builds a jax.Array with ``sharding`` from stored host shards.

    ``stored`` maps a shard index ((start, stop) per dimension) to a read-only
    host array holding it (a view of the daemon's segment, which the daemon
    never reuses once restored from). A device whose index was stored as-is
    gets that array: the CPU backend aliases it, an accelerator copies it in
    one transfer. Otherwise the global array is assembled once and sliced,
    which handles a change of sharding.
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
