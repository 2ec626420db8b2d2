"""Multi-host JAX with bubblesnap: two processes train, all die, one process carries on.

What it does:
  1. starts a bubblesnap daemon (one "host"; both processes talk to it),
  2. runs a job of --processes processes under jax.distributed (2 CPU devices
     each) on one (2, 2) mesh ("data", "model"): a Flax MLP whose hidden layer
     is split over "model" (model parallelism, across the processes) and whose
     batch is split over "data" (data parallelism), optax AdamW, a snapshot
     every step
     (SnapshotClient with rank = jax.process_index(), world size =
     jax.process_count(); every region of the global state is copied once,
     by the process holding its replica 0),
  3. SIGKILLs every process once all have finished step --kill-at,
  4. resumes the job in ONE process with 4 devices on another mesh
     (--resume-mesh, default 4x1: all data parallel; 1x4: all model
     parallel): the restore asks the daemon for exactly the regions the new
     shardings put on each device, checks the state against the digest the
     killed job logged for that step, and trains on to --steps, snapshotting
     under the new world size.

The last line on stdout is JSON: restored_step, processes_before,
processes_after, state_matches_snapshot, restore_seconds and more. Progress
goes to stderr.

  python examples/multihost.py
  python examples/multihost.py --resume-mesh 1x4 --kill-at 6 --steps 12
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import numpy as np

IN, HIDDEN, BATCH = 32, 256, 128


def log(message: str) -> None:
    print(f"[multihost] {message}", file=sys.stderr, flush=True)


# -- what every process of the job runs -------------------------------------------------

def build(mesh_shape: tuple[int, int]):
    """Mesh, state shardings, initial state, a jitted step and the batch of a step."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from quickstart import step_of

    # With 2 processes x 2 devices, the "model" axis runs across the processes: each
    # holds (and snapshots) its half of the hidden layer, and splits its batch over
    # its two devices. Resumed in one process, that process's devices hold it all.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(mesh_shape[::-1]).T, ("data", "model"))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, name="out")(nn.gelu(nn.Dense(HIDDEN, name="hidden")(x)))

    model, optimizer = MLP(), optax.adamw(1e-3)

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, IN)))
        return {"params": params, "opt_state": optimizer.init(params),
                "step": jnp.zeros((), jnp.int32)}

    def spec(path, leaf) -> P:
        """The hidden layer split over "model" (its kernel's columns, the output
        kernel's rows, the optimizer moments alike); everything else replicated."""
        name = jax.tree_util.keystr(path)
        if "hidden" in name and leaf.ndim == 2:
            return P(None, "model")
        if "hidden" in name and leaf.ndim == 1:
            return P("model")
        if "out" in name and leaf.ndim == 2:
            return P("model", None)
        return P()

    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec(path, leaf)), jax.eval_shape(init))
    batch_sharding = NamedSharding(mesh, P("data"))
    true_w = np.random.default_rng(0).standard_normal((IN, 1)).astype(np.float32)

    def batch(step: int):
        x = np.random.default_rng(1000 + step).standard_normal((BATCH, IN)).astype(np.float32)
        return (jax.device_put(x, batch_sharding),
                jax.device_put(np.sin(x @ true_w), batch_sharding))

    # The quickstart's step, compiled for this mesh: the state keeps its shardings.
    train_step = jax.jit(step_of(model, optimizer),
                         in_shardings=(shardings, batch_sharding, batch_sharding),
                         out_shardings=(shardings, NamedSharding(mesh, P())))
    return shardings, jax.jit(init, out_shardings=shardings), train_step, batch


def digest(state) -> str:
    """A digest of the whole global state (every process gets the same)."""
    import jax
    from jax.experimental import multihost_utils

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(multihost_utils.process_allgather(state, tiled=True)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def train_job(args: dict) -> dict:
    """One process of the job: (restore,) train, snapshot every step, log digests."""
    import jax

    from bubblesnap.clients.jax import ClientOptions, SnapshotClient
    from bubblesnap.testing.multihost import event

    rank, world = jax.process_index(), jax.process_count()
    shardings, init, train_step, batch = build(tuple(args["mesh"]))
    client = SnapshotClient(args["job"], rank, world,
                            options=ClientOptions(daemon=args["daemon"]))
    state, start, restored = init(), 0, None
    if args["resume"]:
        # What each killed process had copied of the newest committed step: every
        # region once in the whole job, by the process holding its replica 0.
        held = [s for s in client.status().steps if s.committed]
        copied = {r.rank: r.nbytes for r in held[-1].ranks if not r.replica} if held else {}
        # The target: the shapes of the state, with THIS run's shardings.
        target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              jax.eval_shape(lambda: state), shardings)
        restored = client.restore(target)
        state, start = restored.state, restored.step + 1
        with open(args["digests"]) as f:
            logged = dict(tuple(json.loads(line).values()) for line in f if line.strip())
        event(event="restored", step=restored.step, seconds=restored.seconds,
              source=restored.source, world_size_before=restored.world_size,
              bytes_copied_per_process=[copied.get(r, 0) for r in range(restored.world_size)],
              matches=logged.get(restored.step) == digest(state))
    loss, result = float("nan"), None
    for step in range(start, args["steps"]):
        state, loss = train_step(state, *batch(step))
        # Logged before the snapshot, so every step a restore can find has its digest.
        line = json.dumps({"step": step, "digest": digest(state)})
        if rank == 0 and not args["resume"]:
            with open(args["digests"], "a") as f:
                f.write(line + "\n")
        result = client.snapshot(step, state, wait=args["wait"])
        event(event="step", process=rank, step=step, loss=float(loss), taken=result.taken,
              committed=result.committed, waited_for=result.waited_for,
              stall_ms=result.stall_seconds * 1e3, reason=result.reason)
    client.close()
    return {"final_step": args["steps"] - 1, "final_loss": float(loss),
            "last_snapshot_committed": bool(result and result.committed)}


# -- the parent: a daemon, the job, the kill, the resumed job -----------------------------

def run(args) -> dict:
    from bubblesnap.testing import DaemonProcess
    from bubblesnap.testing.multihost import JaxJob

    resume_mesh = tuple(int(n) for n in args.resume_mesh.split("x"))
    with DaemonProcess("--memory-budget", "1GiB", own_shm_dir=True) as daemon, \
            tempfile.TemporaryDirectory() as tmp:
        log(f"started a daemon on {daemon.address}")
        common = {"daemon": daemon.address, "job": "multihost", "steps": args.steps,
                  "digests": os.path.join(tmp, "digests.jsonl"), "wait": args.wait}
        target = f"{os.path.abspath(__file__)}:train_job"
        with JaxJob(target, args.processes, {**common, "mesh": [2, 2], "resume": False},
                    devices=4 // args.processes, timeout=args.timeout) as job:
            job.wait_event(lambda e: e.get("event") == "step" and _show(e)
                           and e["step"] >= args.kill_at)
            job.kill()
        log(f"SIGKILLed all {args.processes} processes after step {args.kill_at}; "
            f"resuming in 1 process on a {args.resume_mesh} mesh")
        started = time.perf_counter()
        with JaxJob(target, 1, {**common, "mesh": list(resume_mesh), "resume": True},
                    devices=4, timeout=args.timeout) as resumed:
            (restored,) = resumed.wait_event(lambda e: e.get("event") == "restored")
            log(f"restored step {restored['step']} from {restored['source']} in "
                f"{restored['seconds'] * 1e3:.1f} ms (matches the snapshot: "
                f"{restored['matches']})")
            resumed.wait_event(lambda e: e.get("event") == "step" and _show(e)
                               and e["step"] == args.steps - 1)
            (done,) = resumed.results()
        return {"restored_step": restored["step"], "processes_before": args.processes,
                "processes_after": 1, "mesh_before": "2x2", "mesh_after": args.resume_mesh,
                "world_size_of_the_step": restored["world_size_before"],
                "bytes_copied_per_process": restored["bytes_copied_per_process"],
                "state_matches_snapshot": restored["matches"],
                "restore_seconds": round(restored["seconds"], 6),
                "source": restored["source"], "killed_after_step": args.kill_at,
                "resumed_process_seconds": round(time.perf_counter() - started, 3),
                "wait": args.wait, **done}


def _show(event: dict) -> bool:
    """Logs process 0's steps; True (so it can sit in a wait_event check)."""
    if event["process"] != 0:
        return True
    log(f"step {event['step']:3d}  loss {event['loss']:.5f}  "
        f"snapshot {'yes' if event['taken'] else 'NO ' + event['reason']}  "
        f"committed {event['committed']} ({event['waited_for'] or 'not waited'})  "
        f"held training {event['stall_ms']:.2f} ms")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="training steps in all (default 16)")
    parser.add_argument("--kill-at", type=int, default=9,
                        help="SIGKILL every process once all finished this step (default 9)")
    parser.add_argument("--processes", type=int, choices=[2, 4], default=2,
                        help="processes of the first run, sharing 4 CPU devices (default 2)")
    parser.add_argument("--resume-mesh", choices=["4x1", "1x4", "2x2"], default="4x1",
                        help="(data, model) mesh of the resumed single process (default 4x1)")
    parser.add_argument("--wait", choices=["job", "rank", "none"], default="job",
                        help="what each snapshot waits for: the job committed the step "
                        "(default), this rank's copy is safe in its daemon, or nothing")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each run of the job may take (default 300)")
    args = parser.parse_args()
    if not 0 <= args.kill_at < args.steps - 1:
        parser.error(f"--kill-at must be between 0 and --steps - 2 ({args.steps - 2})")
    args.wait = {"none": False}.get(args.wait, args.wait)
    result = run(args)
    print(json.dumps(result), flush=True)
    return 0 if result["state_matches_snapshot"] else 1


if __name__ == "__main__":
    sys.exit(main())
