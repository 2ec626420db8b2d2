"""Lossless recovery: a pipeline killed mid-training resumes bit for bit (TranLogs).

A 3-stage GPT pipeline (one process, one thread and one CPU device per
stage, 1F1B) trains from a shuffling data loader. Every step, before it
runs, each stage logs what redoing it needs: the sample indices of its
batch and the loader's state after drawing them (the training log, held by
the daemons and replicated to a peer). Snapshots are taken in the bubbles.

Three runs, each a separate process:
  reference   trains --steps steps, no failure
  failing     the same, SIGKILLed at --fail-at in the --fail-point:
                bubble        while a bubble is fetching a snapshot
                after-commit  at the end of the first step from --fail-at on
                              whose predecessor's snapshot commit was just
                              acknowledged, before the daemons can have
                              replicated it
  resume      restores every stage's latest restorable step from the daemons,
              replays the logged steps after it (the same batches, rebuilding
              the loader's state from the log), then trains on to --steps;
              with --fail-during-replay N it is itself SIGKILLed after
              replaying N steps, and a second resume finishes the job.

The last line is JSON: bitwise_equal (every parameter and optimizer moment
of every stage equals the reference's, byte for byte), lost_steps (steps
finished before the failure that were neither restored nor replayed),
replayed_steps, restored_step, failed_at.

    python examples/lossless.py --fail-at 9 --fail-point bubble
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

STAGES = 3
MICROBATCHES = 4
JOB = "lossless"


def log(message: str) -> None:
    print(f"[lossless] {message}", file=sys.stderr, flush=True)


class DataLoader:
    """A shuffling loader over a synthetic token set; its position is its RNG state.

    Replaying a logged step takes the logged indices; after the last one the
    loader continues from the logged state, exactly where the failed run was.
    """

    def __init__(self, config, seed: int = 0, samples: int = 4096):
        import numpy as np
        self._np = np
        self._tokens = np.random.default_rng(12345).integers(
            0, config.vocab, (samples, config.seq_len + 1), dtype=np.int32)
        self._rng = np.random.default_rng(seed)
        self._per_step = MICROBATCHES * config.microbatch_size
        self._mb = config.microbatch_size
        self._drawn: dict[int, list[int]] = {}
        self._state_after: dict[int, dict] = {}  # the loader's state after drawing a step
        self._lock = threading.Lock()

    def record(self, step: int) -> bytes:
        """The step's log record, drawing its indices if nobody has yet."""
        with self._lock:
            if step not in self._drawn:
                self._drawn[step] = self._rng.choice(len(self._tokens), self._per_step,
                                                     replace=False).tolist()
                self._state_after[step] = self._rng.bit_generator.state
            return json.dumps({"step": step, "indices": self._drawn[step],
                               "loader_state": self._state_after[step]}).encode()

    def replay(self, records) -> None:
        """Takes the logged steps' indices, and the loader's state after the last one."""
        with self._lock:
            for step, payload in records:
                row = json.loads(payload)
                self._drawn[step] = row["indices"]
                self._state_after[step] = row["loader_state"]
                self._rng.bit_generator.state = row["loader_state"]

    def batch(self, step: int, microbatch: int):
        with self._lock:
            rows = self._tokens[self._drawn[step][microbatch * self._mb:
                                                  (microbatch + 1) * self._mb]]
        return rows[:, :-1], rows[:, 1:]


# -- one training process ---------------------------------------------------------------------

def train_main(args) -> int:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={STAGES}")
    import jax

    from bubblesnap.protos.checksum import checksum
    from pipeline.model import GPTConfig, StageProgram
    from pipeline.schedules import SCHEDULES
    from pipeline.snapshot_modes import DaemonSnapshots, NoSnapshots
    from pipeline.stage import StageRunner
    from pipeline.transport import ThreadLinks

    config = GPTConfig(d_model=args.d_model, layers_per_stage=(1,), vocab=1024)
    loader = DataLoader(config)
    links = ThreadLinks(STAGES)
    devices = jax.devices()
    programs = [StageProgram(config, STAGES, s, [devices[s]]) for s in range(STAGES)]
    snapshotting = args.run != "reference"
    modes = [DaemonSnapshots(args.daemon, JOB, s, STAGES, eager=False) if snapshotting
             else NoSnapshots() for s in range(STAGES)]
    progress = os.path.join(args.workdir, f"{args.run}.progress")
    failing = args.run == "failing"

    first, replayed = 0, []
    if args.run.startswith("resume"):
        restored = []
        for s in range(STAGES):
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=x.sharding),
                                    programs[s].state)
            r = modes[s].client.restore(abstract)
            programs[s].state = r.state
            restored.append(r.step)
        if len(set(restored)) != 1:
            raise SystemExit(f"stages restored different steps: {restored}")
        first = restored[0] + 1
        if not args.without_log:
            # From the restored step's own record: it holds the loader's state after
            # that step, even when no later step was logged.
            logged = modes[0].client.read_log(restored[0] - 1)
            loader.replay(logged)
            replayed = [(step, record) for step, record in logged if step > restored[0]]
        with open(os.path.join(args.workdir, f"{args.run}.json"), "w") as f:
            json.dump({"restored_step": restored[0],
                       "replayable": [step for step, _ in replayed]}, f)
        log(f"{args.run}: restored step {restored[0]}; replaying logged steps "
            f"{[step for step, _ in replayed]}")

    def after(stage: int):
        def hook(iteration, state):
            if stage == 0:
                with open(progress, "a") as f:
                    f.write(f"{iteration}\n")
            if args.die_after_replaying is not None and replayed and \
                    iteration == replayed[0][0] + args.die_after_replaying - 1:
                die(f"SIGKILL after replaying {args.die_after_replaying} step(s)")
            if failing and args.fail_point == "after-commit" and iteration >= args.fail_at \
                    and stage == 0:
                # the first acknowledged commit of the step before (fetched in this
                # iteration's bubbles, acknowledged a moment later)
                acked = modes[0].snap.commits_acknowledged
                deadline = time.monotonic() + 0.5
                while not (acked and acked[-1] >= iteration - 1) and \
                        time.monotonic() < deadline:
                    time.sleep(0.001)
                if acked and acked[-1] >= iteration - 1:
                    die(f"SIGKILL in step {iteration} right after the commit of step "
                        f"{acked[-1]} was acknowledged")
        return hook

    class Logged:
        """Logs each step's record before the step runs, then behaves like ``mode``."""

        def __init__(self, stage: int, mode):
            self.stage, self.mode = stage, mode

        def __getattr__(self, name):
            return getattr(self.mode, name)

        # The stages share one data order: stage 0 logs it, all replay from it.
        def begin_iteration(self, iteration: int) -> None:
            record = loader.record(iteration)
            if snapshotting and self.stage == 0:  # held by the daemons while the step runs
                modes[0].client.log(iteration, record)
            self.mode.begin_iteration(iteration)

        def end_iteration(self, iteration: int, state) -> None:
            if snapshotting and self.stage == 0:  # the step is done once its record is held
                modes[0].client.wait_log()
            self.mode.end_iteration(iteration, state)

        def bubble(self, position, receive, arrived=None):
            if failing and args.fail_point == "bubble" and self.stage == 0 and \
                    self._iteration >= args.fail_at:
                def arrived_then_die():  # polled between the fetch's 1 MiB blocks
                    die(f"SIGKILL inside a bubble of step {self._iteration}, mid-fetch")
                return self.mode.bubble(position, receive, arrived_then_die)
            return self.mode.bubble(position, receive, arrived)

        @property
        def _iteration(self):
            return self.mode.snap._iteration if snapshotting else -1

    errors = []

    def work(stage: int):
        try:
            inbox, send = links.endpoint(stage)
            runner = StageRunner(programs[stage], SCHEDULES["1f1b"](STAGES, MICROBATCHES, stage),
                                 stage, STAGES, inbox, send, {"m": Logged(stage, modes[stage])},
                                 batch=loader.batch)
            runner.run(["m"] * (args.steps - first), first_iteration=first,
                       after_iteration=after(stage))
        except BaseException as err:
            errors.append(err)
            raise

    threads = [threading.Thread(target=work, args=(s,)) for s in range(STAGES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a stage failed: {errors[0]!r}")
    for mode in modes:
        mode.close()
    digests = [[checksum(jax.device_get(leaf).tobytes()) for leaf in jax.tree.leaves(p.state)]
               for p in programs]
    with open(os.path.join(args.workdir, f"{args.run}.digests.json"), "w") as f:
        json.dump(digests, f)
    return 0


def die(why: str) -> None:
    log(why)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# -- the three runs -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemons() -> tuple[list[subprocess.Popen], str]:
    """Two daemons in a ring, --replicas 1: the trainer's host and its neighbour."""
    peers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    procs, address = [], ""
    for index in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "bubblesnap", "daemon", "--listen", "127.0.0.1:0",
             "--metrics", "", "--peers", ",".join(peers), "--index", str(index),
             "--replicas", "1", "--max-interval", "1", "--log-level", "ERROR"],
            stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("a daemon did not start; run `bubblesnap daemon` to see why")
        procs.append(proc)
        address = address or json.loads(line)["address"]
    return procs, address


def run(args, name: str, *extra: str) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "train", "--run", name,
           "--steps", str(args.steps), "--d-model", str(args.d_model),
           "--workdir", args.workdir, "--daemon", args.daemon, *extra]
    code = subprocess.run(cmd, timeout=args.timeout).returncode
    log(f"{name}: exit code {code}")
    return code


def completed(args, name: str) -> list[int]:
    try:
        with open(os.path.join(args.workdir, f"{name}.progress")) as f:
            return [int(line) for line in f]
    except FileNotFoundError:
        return []


def main_run(args) -> dict:
    daemons, args.daemon = start_daemons()
    try:
        if run(args, "reference") != 0:
            raise SystemExit("the reference run failed")
        code = run(args, "failing", "--fail-at", str(args.fail_at),
                   "--fail-point", args.fail_point)
        resume_flags = ["--without-log"] if args.without_log else []
        if code != -signal.SIGKILL:
            raise SystemExit(f"the failing run was meant to die by SIGKILL; exit code {code}")
        finished = max(completed(args, "failing"), default=-1)
        resumes = ["resume"]
        if args.fail_during_replay:
            code = run(args, "resume", "--die-after-replaying", str(args.fail_during_replay),
                       *resume_flags)
            if code != -signal.SIGKILL:
                raise SystemExit(f"the resume was meant to die while replaying; exit {code}")
            resumes.append("resume2")
        if run(args, resumes[-1], *resume_flags) != 0:
            raise SystemExit("the resumed run failed")
    finally:
        for proc in daemons:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    with open(os.path.join(args.workdir, "reference.digests.json")) as f:
        reference = json.load(f)
    with open(os.path.join(args.workdir, f"{resumes[-1]}.digests.json")) as f:
        resumed = json.load(f)
    with open(os.path.join(args.workdir, "resume.json")) as f:
        first_resume = json.load(f)
    recovered = first_resume["restored_step"] + len(first_resume["replayable"])
    return {"bitwise_equal": reference == resumed,
            "lost_steps": max(0, finished - recovered),
            "replayed_steps": len(first_resume["replayable"]),
            "restored_step": first_resume["restored_step"],
            "failed_at": args.fail_at, "fail_point": args.fail_point,
            "finished_before_failure": finished, "steps": args.steps,
            "killed_during_replay": bool(args.fail_during_replay),
            "used_log": not args.without_log}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="steps the job trains (default 16)")
    p.add_argument("--fail-at", type=int, default=9, help="step that fails (default 9)")
    p.add_argument("--fail-point", choices=["bubble", "after-commit"], default="bubble")
    p.add_argument("--fail-during-replay", type=int, default=0, metavar="N",
                   help="also kill the resumed run after it replayed N steps")
    p.add_argument("--without-log", action="store_true",
                   help="resume from the snapshot alone, ignoring the training log (to see "
                        "what the log is for: the loader starts over and the run diverges)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--role", choices=["main", "train"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--daemon", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--die-after-replaying", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "main" and not 4 <= args.fail_at < args.steps - 1:
        p.error("--fail-at must be between 4 (snapshots start after a few warm-up steps) "
                "and --steps - 2")
    return args


def main() -> int:
    args = parse_args()
    if args.role == "train":
        return train_main(args)
    with tempfile.TemporaryDirectory(prefix="bubblesnap-lossless-") as workdir:
        args.workdir = workdir
        report = main_run(args)
    print(json.dumps(report), flush=True)
    return 0 if report["bitwise_equal"] and report["lost_steps"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
