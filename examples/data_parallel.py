"""Data-parallel recovery (Swift): a lost worker's state comes from a surviving replica.

Two data-parallel workers (ranks 0 and 1, one process each) train the same
small Flax MLP on synthetic regression data. Every step each computes the
gradient of its half of the step's batch, the two swap gradients over a
Unix socket and both apply the same average, (g0 + g1) / 2 computed in the
same order, so the replicas stay bitwise identical. A step counts as done
for the job only once every worker has finished it (an end-of-step
barrier; a real job learns it at the next all-reduce). Rank 0 logs each
step's batch (its sample indices and the loader's state after drawing them)
to the daemon's training log before the step runs, and every
--snapshot-every steps the workers snapshot their state to the daemon as one
replica group (world size 2, replica_group (0, 1)): the daemons copy a
replicated shard once per group, so only rank 0 copies it and rank 1 is held
through rank 0's copy (its snapshot() returns at once, copied_by 0; its
restore gets rank 0's copy). Snapshots are taken after the end-of-step
barrier, so a step only one worker finished is never snapshotted.

Three runs, each worker a separate process:
  reference   trains --steps steps, no failure; saves its state after step
              --fail-at - 1 (the true state the undo should reach) and at the end
  failing     worker 1 is SIGKILLed at step --fail-at after the gradient
              exchange and before its update; worker 0 has applied that update,
              so it is one update ahead of the job's last finished step. The
              supervisor starts a replacement worker 1, and worker 0 (the
              survivor) recovers it:
                replica    worker 0 undoes its last update with the inverse of its
                           optimizer and the averaged gradient it holds
                           (inverse_updates: SGD with momentum, AdamW), checks the
                           undo by re-applying the update (check_undo), and when the
                           error is within --undo-bound sends its state straight to
                           the replacement over the socket: no snapshot involved
                snapshot   when the optimizer has no inverse here (adafactor) or the
                           check fails, both workers restore the latest committed
                           snapshot from the daemon and replay the logged steps after it
              then both redo step --fail-at with the logged batch and train on.

The undo is exact in real numbers only: after it the run is close to the
reference, not bitwise equal, and the report says by how much. The snapshot
path replays the same batches through the same computation and ends bitwise
equal.

--undo-bound (default 1e-5) bounds check_undo's relative error: per tensor,
the largest |redo(undo(state)) - state| divided by the tensor's largest
magnitude, maximised over every parameter and optimizer moment. float32
rounding of one update is about 1e-7 of a tensor's scale; 1e-5 leaves room
for the cancellation in AdamW's second moment and still catches a wrong
gradient or hyperparameter.

The last line is JSON: recovered_from ("replica" or "snapshot"), optimizer,
undo_error (largest relative error of the undone state against the
reference's true state after step --fail-at - 1, per tensor normalised by
its largest magnitude; null when nothing was undone), undo_abs_error,
undo_check (check_undo's numbers), undo_bound, bitwise_equal (both workers'
final parameters and optimizer state equal the reference's byte for byte),
max_abs_diff_vs_reference, replicas_equal (the two workers end identical),
lost_steps (steps the job finished before the failure that were neither
recovered nor replayed), failed_at, finished_before_failure, steps,
snapshot_used, restored_step, replayed_steps. Exit code 0 on a correct
recovery: replica path, the undo within the bound (checked and against the
true state) and the replicas identical; snapshot path, bitwise equal; both,
no lost steps.

    python examples/data_parallel.py --optimizer adamw --fail-at 6
"""

import argparse
import dataclasses
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from bubblesnap.shared.sockets import recv_exact

JOB = "data-parallel"
WORLD = 2
FEATURES = 32
HIDDEN = 128
SAMPLES = 2048
BATCH = 64  # per step, split in halves between the two workers

#: Hyperparameters of each optimizer; the undo functions get the same ones.
SGD = {"learning_rate": 0.02, "momentum": 0.9}
ADAMW = {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-4}
ADAFACTOR = {"learning_rate": 1e-2}


def log(message: str) -> None:
    print(f"[data-parallel] {message}", file=sys.stderr, flush=True)


def die(why: str) -> None:
    log(why)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def data_loader(seed: int = 0):
    """A shuffling loader over a synthetic regression set (pipeline/data_loader.py's
    logged sample order); a step's batch is split between the workers by rank."""
    import numpy as np

    from pipeline.data_loader import SampleOrder

    class RegressionLoader(SampleOrder):
        def __init__(self):
            super().__init__(SAMPLES, BATCH, seed)
            data = np.random.default_rng(12345)
            self.x = data.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
            teacher = data.standard_normal((FEATURES, 8), dtype=np.float32) / np.sqrt(FEATURES)
            self.y = np.sin(self.x @ teacher).sum(axis=1, keepdims=True).astype(np.float32)

        def batch(self, step: int, rank: int):
            half = BATCH // WORLD
            rows = self.indices(step)[rank * half:(rank + 1) * half]
            return self.x[rows], self.y[rows]

    return RegressionLoader()


# -- the link between the two workers ---------------------------------------------------------

class PeerLost(Exception):
    """The other worker stopped answering (its process is gone)."""


class Link:
    """Length-prefixed messages over a connected Unix socket."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def send(self, payload: bytes) -> None:
        try:
            self._sock.sendall(struct.pack("!Q", len(payload)) + payload)
        except OSError as err:  # BrokenPipe, ConnectionReset, timeout
            raise PeerLost(f"send: {err!r}") from None

    def receive(self) -> bytearray:
        try:
            (size,) = struct.unpack("!Q", recv_exact(self._sock, 8))
            return recv_exact(self._sock, size)
        except OSError as err:  # the peer closed the connection (ConnectionError), timeout
            raise PeerLost(f"receive: {err!r}") from None

    def close(self) -> None:
        self._sock.close()


def state_bytes(state) -> bytes:
    """Every leaf of a state pytree, in tree order, as an npz archive."""
    import jax
    import numpy as np
    buffer = io.BytesIO()
    np.savez(buffer, *[np.asarray(leaf) for leaf in jax.tree.leaves(state)])
    return buffer.getvalue()


def state_from_bytes(payload: bytes, like):
    """The state ``state_bytes`` wrote, in the structure of ``like`` (shapes and dtypes
    must match)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    with np.load(io.BytesIO(payload)) as archive:
        arrays = [archive[f"arr_{i}"] for i in range(len(archive.files))]
    leaves, treedef = jax.tree.flatten(like)
    if [(a.shape, a.dtype) for a in arrays] != [(x.shape, x.dtype) for x in leaves]:
        raise SystemExit("the state received does not match this worker's layout")
    return jax.tree.unflatten(treedef, [jnp.asarray(a) for a in arrays])


# -- one worker ---------------------------------------------------------------------------------

def build_optimizer(name: str):
    """(optax transformation, undo function taking (params, opt_state, grads) or None)."""
    import functools

    import optax

    from bubblesnap.clients.jax import undo_adamw, undo_sgd_momentum
    if name == "sgd-momentum":
        return optax.sgd(**SGD), functools.partial(undo_sgd_momentum, **SGD)
    if name == "adamw":
        return optax.adamw(**ADAMW), functools.partial(undo_adamw, **ADAMW)
    return optax.adafactor(**ADAFACTOR), None  # no inverse: recovery takes the snapshot


class Worker:
    """One data-parallel replica: trains, swaps gradients, and recovers its peer."""

    def __init__(self, args):
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import optax

        from bubblesnap.clients.jax import ClientOptions, SnapshotClient

        self.args, self.rank = args, args.rank
        self.failing = args.run == "failing"
        self.loader = data_loader()
        self.tx, self.undo = build_optimizer(args.optimizer)

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.relu(nn.Dense(HIDDEN)(x))
                x = nn.relu(nn.Dense(HIDDEN)(x))
                return nn.Dense(1)(x)

        model = MLP()
        params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES), jnp.float32))["params"]
        self.state = {"params": params, "opt": self.tx.init(params)}
        self._grad_leaves, self._grad_tree = jax.tree.flatten(params)

        def loss(p, x, y):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        def apply(state, grads):
            updates, opt = self.tx.update(grads, state["opt"], state["params"])
            return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

        self._grad = jax.jit(jax.grad(loss))
        self._apply = jax.jit(apply)
        self.client = self.log_reader = None
        if self.failing:
            options = ClientOptions(daemon=args.daemon)
            self.client = SnapshotClient(JOB, self.rank, WORLD, options,
                                         replica_group=tuple(range(WORLD)))
            # The job's data order is logged once, under rank 0; every worker reads it there.
            self.log_reader = (self.client if self.rank == 0 else
                               SnapshotClient(JOB, 0, WORLD, options))
        self.link: Link | None = None
        self._listener: socket.socket | None = None
        self.applied, self.last_grads = -1, None  # the last update applied, and its gradient

    def path(self, name: str) -> str:
        return os.path.join(self.args.workdir, f"{self.args.run}.{name}")

    # -- connecting ---------------------------------------------------------------------

    def connect(self) -> None:
        """Rank 0 listens on a Unix socket in the workdir, rank 1 connects to it."""
        address = self.path("sock")
        if self.rank == 0:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(address)
            self._listener.listen(1)
            self.accept()
            return
        deadline = time.monotonic() + self.args.timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker 0 never listened on {address}") from None
                time.sleep(0.05)
        sock.settimeout(self.args.timeout)
        self.link = Link(sock)

    def accept(self) -> None:
        self._listener.settimeout(self.args.timeout)
        sock, _ = self._listener.accept()
        sock.settimeout(self.args.timeout)
        self.link = Link(sock)

    # -- training -----------------------------------------------------------------------

    def exchange(self, grads):
        """The average of both workers' gradients, bitwise the same on both."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        mine = np.concatenate([np.asarray(g, np.float32).ravel()
                               for g in jax.tree.leaves(grads)])
        self.link.send(mine.tobytes())
        theirs = np.frombuffer(self.link.receive(), np.float32)
        g0, g1 = (mine, theirs) if self.rank == 0 else (theirs, mine)
        average = (g0 + g1) / np.float32(2)
        leaves, offset = [], 0
        for like in self._grad_leaves:
            leaves.append(jnp.asarray(average[offset:offset + like.size].reshape(like.shape)))
            offset += like.size
        return self._grad_tree.unflatten(leaves)

    def train(self, first: int) -> None:
        """Steps ``first`` .. --steps - 1; raises PeerLost (with the step's averaged
        gradient in ``self.last_grads``) when the peer disappears."""
        args = self.args
        if self.client and self.rank == 0:  # it logs before its first snapshot
            self.client.register(self.state)
        for step in range(first, args.steps):
            record = self.loader.record(step)
            if self.client and self.rank == 0:  # held by the daemon while the step runs
                self.client.log(step, record)
            x, y = self.loader.batch(step, self.rank)
            grads = self.exchange(self._grad(self.state["params"], x, y))
            if step == args.die_at:
                die(f"worker 1: SIGKILL in step {step}, after the gradient exchange, "
                    "before its update")
            self.state = self._apply(self.state, grads)
            self.last_grads, self.applied = grads, step
            with open(self.path(f"rank{self.rank}.progress"), "a") as f:
                f.write(f"{step}\n")
            if self.client and self.rank == 0:  # a step is done once its record is held
                self.client.wait_log()
            self.link.send(b"done")  # the end-of-step barrier: the job finished the step
            self.link.receive()
            if self.client and (step + 1) % args.snapshot_every == 0:
                result = self.client.snapshot(step, self.state, wait=True)
                if not result.taken and result.copied_by is None:
                    log(f"worker {self.rank}: no snapshot of step {step}: {result.reason}")
            if args.run == "reference" and self.rank == 0 and step == args.save_at:
                self.save(self.path(f"step{step}.npz"), self.state)

    def save(self, path: str, state) -> None:
        with open(path, "wb") as f:
            f.write(state_bytes(state))

    # -- recovery -----------------------------------------------------------------------

    def recover_peer(self) -> int:
        """Survivor (worker 0): waits for the replacement, steps back to the job's step,
        and hands it the state, or sends both to the snapshot. Returns the next step."""
        from bubblesnap.clients.jax import undo_or_restore
        self.link.close()
        log(f"worker 0: peer lost after applying step {self.applied}; waiting for a "
            "replacement")
        self.accept()
        resume_after = json.loads(self.link.receive())["resume_after"]
        ahead = self.applied - resume_after
        report = {"ahead": ahead, "undone": False, "undo_check": None}
        decision = undo_or_restore(self.tx, self.undo, self.state["params"], self.state["opt"],
                                   self.last_grads, ahead, self.args.undo_bound)
        state = {"params": decision.params, "opt": decision.opt_state}
        reason = decision.fallback_reason
        if decision.undone:
            check = decision.check
            self.save(self.path("undone.npz"), state)
            report.update(undone=True, undo_check=dataclasses.asdict(check))
            log(f"worker 0: undid step {self.applied}: check_undo max_rel "
                f"{check.max_rel_error:.3g}, max_abs {check.max_abs_error:.3g}")
        if reason:
            log(f"worker 0: falling back to the snapshot: {reason}")
            self.link.send(json.dumps({"recovery": "snapshot"}).encode())
            report.update(self.restore_snapshot(), recovered_from="snapshot", reason=reason)
        else:
            self.link.send(json.dumps({"recovery": "replica"}).encode())
            self.link.send(state_bytes(state))
            self.state = state
            self.follow_log(resume_after)
            report.update(recovered_from="replica", restored_step=None, replayable=[])
        with open(self.path("recovery.json"), "w") as f:
            json.dump(report, f)
        return (report["restored_step"] if report["restored_step"] is not None
                else resume_after) + 1

    def join(self) -> int:
        """Replacement (worker 1): tells the survivor the job's step and takes the state
        it hands over, or restores the snapshot. Returns the next step."""
        self.link.send(json.dumps({"resume_after": self.args.resume_after}).encode())
        how = json.loads(self.link.receive())["recovery"]
        if how == "replica":
            self.state = state_from_bytes(self.link.receive(), self.state)
            self.save(self.path(f"rank{self.rank}.received.npz"), self.state)
            self.follow_log(self.args.resume_after)
            log(f"worker 1: took worker 0's state of step {self.args.resume_after}")
            return self.args.resume_after + 1
        return self.restore_snapshot()["restored_step"] + 1

    def follow_log(self, step: int) -> list[int]:
        """Positions the loader from the log: the record of ``step`` (the loader's state
        after it) and of every logged step after it. Returns those later steps."""
        records = self.log_reader.read_log(step - 1)
        self.loader.replay(records)
        return [s for s, _ in records if s > step]

    def restore_snapshot(self) -> dict:
        """Restores the job's latest committed snapshot and positions the loader after it;
        returns the restored step and the logged steps to replay."""
        import jax
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
        restored = self.client.restore(abstract)
        self.state = restored.state
        replayable = self.follow_log(restored.step)
        log(f"worker {self.rank}: restored step {restored.step} from the daemon; replaying "
            f"logged steps {replayable}")
        return {"restored_step": restored.step, "replayable": replayable}


def worker_main(args) -> int:
    worker = Worker(args)
    worker.connect()
    first = worker.join() if args.join else 0
    while True:
        try:
            worker.train(first)
            break
        except PeerLost as err:
            if worker.rank != 0 or not worker.failing:
                raise SystemExit(f"worker {worker.rank}: peer lost: {err}") from None
            first = worker.recover_peer()
    worker.save(worker.path(f"rank{worker.rank}.final.npz"), worker.state)
    if worker.client:
        worker.client.close()
        if worker.log_reader is not worker.client:
            worker.log_reader.close()
    return 0


# -- the supervisor -----------------------------------------------------------------------------

def launch(args, run: str, rank: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", "worker", "--run", run,
         "--rank", str(rank), "--steps", str(args.steps), "--optimizer", args.optimizer,
         "--snapshot-every", str(args.snapshot_every), "--undo-bound", repr(args.undo_bound),
         "--timeout", str(args.timeout), "--workdir", args.workdir, "--daemon", args.daemon,
         *extra])


def wait(args, procs: list[subprocess.Popen], what: str) -> list[int | None]:
    """Exit codes of ``procs``; once one fails (or --timeout passes) the others are
    killed and count as None."""
    deadline = time.monotonic() + args.timeout
    codes = [p.poll() for p in procs]
    while None in codes and not any(codes) and time.monotonic() < deadline:
        time.sleep(0.05)
        codes = [p.poll() for p in procs]
    for p, code in zip(procs, codes, strict=True):
        if code is None:
            p.kill()
            p.wait()
    log(f"{what}: exit codes {codes}")
    return codes


def finished(args, run: str, rank: int) -> int:
    """The last step ``rank`` applied in ``run`` (-1: none)."""
    try:
        with open(os.path.join(args.workdir, f"{run}.rank{rank}.progress")) as f:
            return max((int(line) for line in f), default=-1)
    except FileNotFoundError:
        return -1


def load(args, name: str) -> list:
    import numpy as np
    with np.load(os.path.join(args.workdir, name)) as archive:
        return [archive[f"arr_{i}"] for i in range(len(archive.files))]


def errors(got: list, want: list) -> tuple[float, float]:
    """(max abs error, max over tensors of its max error / its largest magnitude)."""
    import numpy as np
    abs_err = rel_err = 0.0
    for a, b in zip(got, want, strict=True):
        if not b.size:
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        err = float(np.max(np.abs(a - b)))  # NaN anywhere makes it NaN
        err = err if np.isfinite(err) else float("inf")  # and max() would skip a NaN
        abs_err, rel_err = max(abs_err, err), max(rel_err, err / max(np.max(np.abs(b)), 1e-30))
    return abs_err, rel_err


def main_run(args) -> dict:
    from bubblesnap.testing import DaemonProcess
    daemon = DaemonProcess(log_level="ERROR")
    args.daemon = daemon.address
    try:
        if wait(args, [launch(args, "reference", r, "--save-at", str(args.fail_at - 1))
                       for r in range(WORLD)], "reference") != [0, 0]:
            raise SystemExit("the reference run failed")
        survivor = launch(args, "failing", 0)
        failing = launch(args, "failing", 1, "--die-at", str(args.fail_at))
        if wait(args, [failing], "failing worker 1") != [-signal.SIGKILL]:
            survivor.kill()
            survivor.wait()
            raise SystemExit("worker 1 was meant to die by SIGKILL")
        # The job resumes after the last step every worker finished.
        job_step = min(finished(args, "failing", r) for r in range(WORLD))
        log(f"the job finished step {job_step}; worker 0 applied step "
            f"{finished(args, 'failing', 0)}; starting a replacement worker 1")
        replacement = launch(args, "failing", 1, "--join", "--resume-after", str(job_step))
        if wait(args, [survivor, replacement], "recovered run") != [0, 0]:
            raise SystemExit("the recovered run failed")
    finally:
        daemon.stop()
    with open(os.path.join(args.workdir, "failing.recovery.json")) as f:
        recovery = json.load(f)
    reference = load(args, "reference.rank0.final.npz")
    finals = [load(args, f"failing.rank{r}.final.npz") for r in range(WORLD)]
    snapshot = recovery["recovered_from"] == "snapshot"
    undo_abs = undo_rel = None
    if recovery["undone"]:
        # What the replacement received when it was handed over, else what worker 0 undid.
        undone = load(args, "failing.undone.npz" if snapshot else "failing.rank1.received.npz")
        undo_abs, undo_rel = errors(undone, load(args, f"reference.step{args.fail_at - 1}.npz"))
    recovered = (recovery["restored_step"] + len(recovery["replayable"]) if snapshot
                 else job_step)
    return {"recovered_from": recovery["recovered_from"], "optimizer": args.optimizer,
            "undo_error": undo_rel, "undo_abs_error": undo_abs,
            "undo_check": recovery["undo_check"], "undo_bound": args.undo_bound,
            "fallback_reason": recovery.get("reason"),
            "bitwise_equal": all(_same(final, reference) for final in finals),
            "max_abs_diff_vs_reference": max(errors(final, reference)[0] for final in finals),
            "replicas_equal": _same(finals[0], finals[1]),
            "lost_steps": max(0, job_step - recovered), "failed_at": args.fail_at,
            "finished_before_failure": job_step, "steps": args.steps,
            "snapshot_used": snapshot, "restored_step": recovery["restored_step"],
            "replayed_steps": len(recovery["replayable"])}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and
                                    x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def correct(report: dict) -> bool:
    if report["lost_steps"] != 0:
        return False
    if report["snapshot_used"]:
        return report["bitwise_equal"]
    return (report["undo_check"]["within_bound"] and report["replicas_equal"] and
            report["undo_error"] <= report["undo_bound"])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=["sgd-momentum", "adamw", "adafactor"],
                   default="adamw", help="adafactor has no inverse: it shows the fallback "
                                         "(default adamw)")
    p.add_argument("--steps", type=int, default=12, help="steps the job trains (default 12)")
    p.add_argument("--fail-at", type=int, default=6,
                   help="step in which worker 1 is killed (default 6)")
    p.add_argument("--snapshot-every", type=int, default=4,
                   help="snapshot both workers after every N-th step (default 4)")
    p.add_argument("--undo-bound", type=float, default=1e-5,
                   help="largest relative undo error accepted before falling back to the "
                        "snapshot (default 1e-5; 0 forces the fallback)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any process or socket may wait (default 120)")
    p.add_argument("--role", choices=["main", "worker"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--daemon", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--save-at", type=int, help=argparse.SUPPRESS)
    p.add_argument("--die-at", type=int, help=argparse.SUPPRESS)
    p.add_argument("--join", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume-after", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "main" and not args.snapshot_every <= args.fail_at < args.steps:
        p.error("--fail-at must be at least --snapshot-every (a snapshot must be committed "
                "before the failure for the fallback) and below --steps")
    return args


def main() -> int:
    args = parse_args()
    if args.role == "worker":
        return worker_main(args)
    with tempfile.TemporaryDirectory(prefix="bubblesnap-data-parallel-") as workdir:
        args.workdir = workdir
        report = main_run(args)
    print(json.dumps(report), flush=True)
    return 0 if correct(report) else 1


if __name__ == "__main__":
    sys.exit(main())
