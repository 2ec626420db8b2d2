"""bubblesnap in five minutes: train, get killed, restore from the daemon, carry on.

What it does:
  1. starts a bubblesnap daemon (unless --daemon is given),
  2. trains a small Flax MLP with optax AdamW in a child process, snapshotting
     the whole train state into the daemon after every step,
  3. kills that process with SIGKILL once it has finished step --kill-at,
  4. starts a new process that restores the latest committed snapshot from the
     daemon's memory, checks it against the digest the killed process logged
     for that step, and trains on to --steps.

The last line on stdout is JSON: restored_step, restore_seconds,
state_matches_snapshot and more. Progress goes to stderr.

  python examples/quickstart.py                    # everything, own daemon
  python examples/quickstart.py --daemon ADDRESS --kill-at 30 --steps 50   # a running one
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


def log(message: str) -> None:
    print(f"[quickstart] {message}", file=sys.stderr, flush=True)


# -- the training process -----------------------------------------------------

def build_training():
    """Model, optimizer, the initial state and a jitted step; batches depend only on the step."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (256, 256):
                x = nn.gelu(nn.Dense(width)(x))
            return nn.Dense(1)(x)

    model, optimizer = MLP(), optax.adamw(1e-3)
    true_w = np.random.default_rng(0).standard_normal((32, 1)).astype(np.float32)

    def batch(step: int):
        x = np.random.default_rng(1000 + step).standard_normal((128, 32)).astype(np.float32)
        return x, np.sin(x @ true_w)

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, 32)))
        return {"params": params, "opt_state": optimizer.init(params),
                "step": jnp.zeros((), jnp.int32)}

    return init, batch, jax.jit(step_of(model, optimizer))


def step_of(model, optimizer):
    """One training step (mean squared error, one optimizer update, the step counted) on
    a state {"params", "opt_state", "step"}; examples/multihost.py shares it."""
    import jax
    import jax.numpy as jnp
    import optax

    def train_step(state, x, y):
        def loss_fn(params):
            return jnp.mean((model.apply(params, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state, "step": state["step"] + 1}, loss

    return train_step


def digest(state) -> str:
    import jax
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def train(args) -> int:
    """The child process: (restore,) train, snapshot every step, log digests."""
    import jax

    from bubblesnap.clients.jax import ClientOptions, RestoreError, SnapshotClient

    init, batch, train_step = build_training()
    client = SnapshotClient(args.job, options=ClientOptions(daemon=args.daemon,
                                                          show_progress=True))
    state, start = init(), 0
    if args.resume:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        try:
            restored = client.restore(abstract)
        except RestoreError as err:
            log(f"nothing to restore: {err}")
            return 1
        with open(args.digests) as f:
            logged = dict(tuple(json.loads(line).values()) for line in f if line.strip())
        state, start = restored.state, restored.step + 1
        matches = logged.get(restored.step) == digest(state)
        print(json.dumps({"event": "restored", "step": restored.step,
                          "seconds": restored.seconds, "matches": matches}), flush=True)
    loss = float("nan")
    with open(args.digests, "a") as digests:
        for step in range(start, args.steps):
            state, loss = train_step(state, *batch(step))
            result = client.snapshot(step, state)
            # The digest is logged before the step is announced, so the parent
            # never kills the trainer between a snapshot and its digest.
            digests.write(json.dumps({"step": step, "digest": digest(state)}) + "\n")
            digests.flush()
            print(json.dumps({"event": "step", "step": step, "loss": float(loss),
                              "snapshot": result.taken, "stall_ms": result.stall_seconds * 1e3}),
                  flush=True)
    final = client.wait()
    client.close()
    print(json.dumps({"event": "done", "step": args.steps - 1, "loss": float(loss),
                      "last_committed": bool(final and final.committed)}), flush=True)
    return 0


# -- the orchestrating parent ---------------------------------------------------

def forget_job(daemon: str, job: str) -> None:
    """Deletes what an earlier quickstart left under this job name: the demo starts over."""
    import grpc

    from bubblesnap.protos import daemon_pb2, daemon_pb2_grpc
    with grpc.insecure_channel(daemon) as channel:
        try:
            daemon_pb2_grpc.DaemonStub(channel).DeleteSnapshots(
                daemon_pb2.DeleteSnapshotsRequest(job=job), timeout=10)
            log(f"deleted the snapshots an earlier run left under job {job!r}")
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise SystemExit(f"daemon {daemon}: {err.code().name}: {err.details()}") from None


def trainer(args, digests: str, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "train", "--daemon",
           args.daemon, "--job", args.job, "--steps", str(args.steps), "--digests", digests]
    return subprocess.Popen(cmd + (["--resume"] if resume else []), stdout=subprocess.PIPE,
                            text=True)


def orchestrate(args) -> int:
    if not 0 <= args.kill_at < args.steps - 1:
        raise SystemExit(f"--kill-at must be between 0 and --steps - 2 ({args.steps - 2})")
    daemon = None
    if args.daemon is None:
        from bubblesnap.testing import DaemonProcess
        daemon = DaemonProcess("--memory-budget", "1GiB")
        args.daemon = daemon.address
        log(f"started a daemon on {args.daemon}")
    else:
        forget_job(args.daemon, args.job)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            digests = os.path.join(tmp, "digests.jsonl")
            first = trainer(args, digests, resume=False)
            for line in first.stdout:
                event = json.loads(line)
                log(f"step {event['step']:3d}  loss {event['loss']:.5f}  "
                    f"snapshot {'yes' if event['snapshot'] else 'NO'}  "
                    f"held training {event['stall_ms']:.2f} ms")
                if event["step"] == args.kill_at:
                    first.send_signal(signal.SIGKILL)
                    break
            first.wait()
            log(f"trainer killed with SIGKILL after step {args.kill_at}; starting a new one")
            started = time.perf_counter()
            second = trainer(args, digests, resume=True)
            events = [json.loads(line) for line in second.stdout]
            if second.wait() != 0 or not events or events[0]["event"] != "restored":
                raise SystemExit("the new trainer could not restore; see the messages above")
            restored, done = events[0], events[-1]
            log(f"restored step {restored['step']} in {restored['seconds'] * 1e3:.1f} ms "
                f"(matches the snapshot: {restored['matches']}); trained on to step {done['step']}")
            result = {"restored_step": restored["step"],
                      "restore_seconds": round(restored["seconds"], 6),
                      "state_matches_snapshot": restored["matches"],
                      "killed_after_step": args.kill_at,
                      "steps_redone": args.kill_at - restored["step"],
                      "resumed_process_seconds": round(time.perf_counter() - started, 3),
                      "final_step": done["step"], "final_loss": done["loss"],
                      "daemon": args.daemon}
            print(json.dumps(result), flush=True)
            return 0 if restored["matches"] else 1
    finally:
        if daemon is not None:
            daemon.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--daemon", metavar="ADDRESS",
                        help="use this running daemon (its unix:PATH socket, or HOST:PORT) "
                             "instead of starting one")
    parser.add_argument("--steps", type=int, default=40, help="training steps in all (default 40)")
    parser.add_argument("--kill-at", type=int, default=25,
                        help="SIGKILL the trainer after this step (default 25)")
    parser.add_argument("--job", default="quickstart", help="job name (default quickstart)")
    parser.add_argument("--role", choices=["orchestrate", "train"], default="orchestrate",
                        help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--digests", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return train(args) if args.role == "train" else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
