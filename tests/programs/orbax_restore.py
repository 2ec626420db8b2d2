"""Plain Orbax restores a durable step of ``regions_state``'s job, checked bit for bit.

One process of ``--count`` (with ``--count`` above 1, one process of a
``jax.distributed`` job on CPU with gloo collectives, ``--coordinator``):
every process builds one global (2, 2) mesh of all the job's devices, asks
``StandardCheckpointer().restore(path, abstract_state)`` for the state in
``TARGET_SPECS``'s shardings, and compares each addressable shard with the
expected slice of the global state. Its last line is JSON: the shards checked.
"""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--step", type=int, required=True)
parser.add_argument("--index", type=int, default=0)
parser.add_argument("--count", type=int, default=1)
parser.add_argument("--coordinator", default="")
args = parser.parse_args()
# Gloo prints to stdout from its own threads: only the result goes to the real stdout.
RESULT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
# Four devices in all: 4 in one process, or 2 per process in two.
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // args.count}"

import jax  # noqa: E402

if args.count > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.count, args.index)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.programs.regions_state import TARGET_SPECS, global_state  # noqa: E402


def nested(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def main() -> int:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    expected = global_state(args.step)
    shardings = {name: NamedSharding(mesh, P(*spec)) for name, spec in TARGET_SPECS.items()}
    target = nested({name: jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=shardings[name])
                     for name, value in expected.items()})
    restored = ocp.StandardCheckpointer().restore(args.checkpoint, target)
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
    print(json.dumps({"index": args.index, "processes": jax.process_count(),
                      "shards_checked": checked}), file=RESULT, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
