"""What each process of the multi-host tests runs, under ``bubblesnap.testing.multihost.JaxJob``.

``layouts``: which regions each process copies, without a daemon. ``train``:
snapshot a few steps of some jobs (waiting for the job to commit each),
then wait to be SIGKILLed. ``restore``: restore jobs into target meshes and
partition specs, compare every local shard with the values the step had,
and snapshot on. ``crash_one_after_another``: crash. Each returns (or, before
being killed, prints as an event) plain JSON for the test to check.
"""

import time

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.serialization import replica_slices
from trees import nested

from bubblesnap.clients import ClientOptions, RestoreError
from bubblesnap.clients.jax import SnapshotClient, _layout, _transfer
from bubblesnap.testing.multihost import crash, event

#: The job-wide state: name -> (shape, dtype, partition spec on the ("x", "y") mesh).
GLOBAL = {"f32": ((8, 6), np.float32, P("x", "y")),
          "bf16": ((8, 6), ml_dtypes.bfloat16, P("x")),   # sharded on x, replicated on y
          "i32": ((8, 4), np.int32, P(None, "y")),
          "scalar": ((), np.int32, P()),                  # replicated on every device
          "partly/a": ((4,), np.float32, P()),
          "partly/b": ((8,), np.float32, P("y"))}
#: A rank's own state: on this process's devices only (a different value per rank).
OWN = {"w": ((8, 4), np.float32, P("x"))}


def values(name: str, shape, dtype, step: int, rank: int = 0) -> np.ndarray:
    """Every element depends on the tensor, the step and (own state) the rank."""
    seed = sum(map(ord, name))
    size = int(np.prod(shape, dtype=np.int64))
    flat = (np.arange(size) * (seed % 7 + 1) + step * 3 + rank * 101) % 251
    return flat.reshape(shape).astype(dtype)


def mesh(kind: str) -> Mesh:
    """The global mesh: ``default`` (processes' devices in rows), ``diagonal`` (each of
    two processes' two devices on a diagonal), ``1d`` (all devices in a line), or
    ``local`` (this process's devices only)."""
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                  for p in range(jax.process_count())]
    if kind == "diagonal":
        (a0, a1), (b0, b1) = by_process
        return Mesh(np.array([[a0, b0], [b1, a1]]), ("x", "y"))
    if kind == "1d":
        return Mesh(np.array([d for ds in by_process for d in ds]), ("x",))
    if kind == "local":
        return Mesh(np.array(jax.local_devices()).reshape(-1, 1), ("x", "y"))
    return Mesh(np.array([d for ds in by_process for d in ds]).reshape(2, -1), ("x", "y"))


def spec_of(spec: P, shape, variant: str) -> P:
    """The partition spec of a leaf in ``variant``: ``same``, ``transposed`` (x and y
    swapped) or ``1d`` (the first dimension over the 1-D mesh)."""
    if variant == "transposed":
        return P(*({"x": "y", "y": "x"}.get(axis, axis) for axis in spec))
    if variant == "1d":
        return P("x") if shape else P()
    return spec


def _table(kind: str) -> dict:
    return GLOBAL if kind == "global" else OWN


def state_at(kind: str, mesh_kind: str, step: int, variant: str = "same"):
    """The state of a job at ``step``, placed on ``mesh_kind`` with ``variant`` specs."""
    on = mesh(mesh_kind)
    return nested({name: jax.device_put(values(name, shape, dtype, step, _rank_of(kind)),
                                       NamedSharding(on, spec_of(spec, shape, variant)))
                  for name, (shape, dtype, spec) in _table(kind).items()})


def abstract(kind: str, mesh_kind: str, variant: str):
    on = mesh(mesh_kind)
    return nested({name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
        on, spec_of(spec, shape, variant))) for name, (shape, dtype, spec) in _table(kind).items()})


def _rank_of(kind: str) -> int:
    return jax.process_index() if kind == "own" else 0


def copied_regions(state) -> dict:
    """name -> {"job_wide", "regions"}: what this process registers and copies."""
    names, leaves, _ = _layout.flatten(state)
    return {spec.name: {"job_wide": spec.job_wide,
                        "regions": [[[s.start, s.stop] for s in shard.index]
                                    for shard in spec.shards]}
            for spec in _layout.tensor_specs(names, leaves, jax.process_count())}


def _client(args, job: str) -> SnapshotClient:
    daemons = args["daemons"]
    rank, world = jax.process_index(), jax.process_count()
    return SnapshotClient(job, rank, world, options=ClientOptions(
        daemon=daemons[rank % len(daemons)], commit_timeout_seconds=60))


def _result(r) -> dict:
    return {"taken": r.taken, "committed": r.committed, "waited_for": r.waited_for,
            "reason": r.reason}


def layouts(args) -> dict:
    """Which regions this process copies of the global state on each mesh, and whether
    the CPU fast path fetches the very buffers Orbax's transfer path picks."""
    found = {}
    for kind in args["meshes"]:
        state = state_at("global", kind, 0)
        _, leaves, _ = _layout.flatten(state)
        ours = _transfer.fetch_to_host(leaves)
        theirs = [rs.unsliced_data for r in replica_slices.transfer_arrays_to_host(
            leaves, 0, False, enable_pinned_host_transfer=False) for rs in r.replica_slices]
        found[kind] = {"copied": copied_regions(state), "fast_path_matches": [
            a.tobytes() for a in ours] == [np.asarray(b).tobytes() for b in theirs]}
    return found


def train(args) -> dict:
    """Snapshots steps 0..steps-1 of every job, waiting for the job to commit each."""
    jobs = args["jobs"]
    clients = {job["name"]: _client(args, job["name"]) for job in jobs}
    snapshots = {}
    for step in range(args["steps"]):
        for job in jobs:
            state = state_at(job["kind"], job["mesh"], step)
            snapshots.setdefault(job["name"], []).append(
                _result(clients[job["name"]].snapshot(step, state, wait="job")))
    report = {"process": jax.process_index(), "snapshots": snapshots,
              "copied": {job["name"]: copied_regions(state_at(job["kind"], job["mesh"], 0))
                         for job in jobs},
              "held": {name: _held_bytes(client) for name, client in clients.items()}}
    if not args.get("then_wait_for_kill"):
        return report
    event(event="trained", **report)
    while True:  # the test SIGKILLs every process now
        time.sleep(60)


def crash_one_after_another(args) -> None:
    """Every process crashes (``bubblesnap.testing.multihost.crash``), process 0 first and each
    next one ``args["lag"]`` seconds later, as processes of a loaded host fall behind."""
    time.sleep(jax.process_index() * args["lag"])
    crash()


def _held_bytes(client) -> dict:
    """tensor -> bytes the daemon holds of it for the newest step, all ranks together."""
    steps = client.status().steps
    held: dict = {}
    for rank in steps[-1].ranks if steps else ():
        if not rank.replica:
            for shard in rank.shards:
                held[shard.tensor] = held.get(shard.tensor, 0) + shard.nbytes
    return held


def restore(args) -> dict:
    """Restores every target and compares each local shard with the step's values."""
    outcomes = []
    for target in args["targets"]:
        client = _client(args, target["job"])
        kind, variant = target["kind"], target["variant"]
        mesh_kind = "1d" if variant == "1d" else target["mesh"]
        try:
            restored = client.restore(abstract(kind, mesh_kind, variant))
        except RestoreError as err:
            outcomes.append({"label": target["label"], "error": str(err)})
            continue
        outcome = {"label": target["label"], "step": restored.step,
                   "source": restored.source, "world_size": restored.world_size,
                   "mismatches": _mismatches(kind, restored.step, restored.state,
                                             abstract(kind, mesh_kind, variant))}
        if target.get("snapshot_on"):  # a new epoch under this world size
            step = restored.step + 1
            outcome["snapshot_on"] = _result(client.snapshot(
                step, state_at(kind, mesh_kind, step, variant), wait="job"))
        outcomes.append(outcome)
    return {"process": jax.process_index(), "outcomes": outcomes}


def _mismatches(kind: str, step: int, state, target) -> list[str]:
    """What differs from the step's values or from the target sharding (empty: none)."""
    found = []
    table = _table(kind)
    names, leaves, _ = _layout.flatten(state)
    _, wanted, _ = _layout.flatten(target)
    for name, leaf, want in zip(names, leaves, wanted, strict=True):
        shape, dtype, _ = table[name]
        expected = values(name, shape, dtype, step, _rank_of(kind))
        if leaf.sharding != want.sharding or leaf.dtype != np.dtype(dtype):
            found.append(f"{name}: sharding or dtype {leaf.sharding} {leaf.dtype}")
        for shard in leaf.addressable_shards:
            if np.asarray(shard.data).tobytes() != expected[shard.index].tobytes():
                found.append(f"{name} {shard.index} on {shard.device}")
    return found
