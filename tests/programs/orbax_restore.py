"""Plain Orbax restores a durable step of ``regions_state``'s job, checked bit for bit.

A target for ``bubblesnap.testing.multihost.JaxJob``: every process of the job (one
with 4 CPU devices, or two with 2 each under ``jax.distributed``) builds one
global (2, 2) mesh of all the job's devices, asks
``StandardCheckpointer().restore(path, abstract_state)`` for the state in
``TARGET_SPECS``'s shardings, and compares each addressable shard with the
expected slice of the global state; it returns the shards it checked.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from regions_state import TARGET_SPECS, global_state
from trees import nested


def check(args: dict) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    expected = global_state(args["step"])
    shardings = {name: NamedSharding(mesh, P(*spec)) for name, spec in TARGET_SPECS.items()}
    target = nested({name: jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=shardings[name])
                     for name, value in expected.items()})
    restored = ocp.StandardCheckpointer().restore(args["checkpoint"], target)
    checked = 0
    for name, value in expected.items():
        array = restored
        for part in name.split("/"):
            array = array[part]
        assert array.sharding == shardings[name], (name, array.sharding)
        assert array.dtype == value.dtype, (name, array.dtype)
        for shard in array.addressable_shards:
            got = np.asarray(shard.data)
            assert got.tobytes() == value[shard.index].tobytes(), (name, shard.index)
            checked += 1
    return {"index": jax.process_index(), "processes": jax.process_count(),
            "shards_checked": checked}
