"""Host failure and recovery: 3 hosts, each a daemon and one pipeline stage.

Three daemons (separate processes on loopback ports, a ring with --replicas
copies of every committed snapshot on the next hosts and a durable tier)
serve a 3-stage GPT pipeline, one stage process per host, snapshotting in
the bubbles every iteration. The stages train until the failure: once a step
is committed for the job (with --kill-adjacent 2: once a step is written
durably, the newest one two adjacent hosts dying may not lose) and every
stage has trained --steps-past-commit iterations more, host 1 (its daemon
and its stage) is killed with SIGKILL; the surviving stages are
stopped as a job scheduler would stop them. A replacement daemon (new port,
empty memory) takes host 1's place in the ring, and three fresh stage
processes restore the step the whole job can restore: hosts 0 and 2 from
their own memory, host 1 from a neighbour's (or from its own, when the
survivors re-replicated to the replacement before it asked). Training then goes on for
--train-after iterations.

With --kill-adjacent 2, hosts 1 and 2 die together: with --replicas 1 both
copies of stage 1 are gone, and it comes back from the durable tier.

    python examples/failover.py
    python examples/failover.py --kill-adjacent 2 --replicas 1

The last line of output is JSON: restored_step, source (of host 1's stage),
recovery_seconds (from the kill until every stage holds its restored
state, replacement daemon start and process start included; the restore
calls alone are restore_seconds),
state_matches_snapshot (every stage's restored state equals, bit for bit,
the state it had at that step before the failure).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = 3
JOB = "failover"
#: Iterations a stage trains at most before its failure (it is killed long before).
_MAX_ITERATIONS = 100_000


def log(message: str) -> None:
    print(f"[failover] {message}", file=sys.stderr, flush=True)


# -- one stage process ----------------------------------------------------------------------

def stage_main(args) -> int:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[args.stage % len(cores)]})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                               "false --xla_force_host_platform_device_count=1")
    import jax
    import numpy as np

    from bubblesnap.protos.checksum import checksum
    from pipeline.model import GPTConfig, StageProgram
    from pipeline.schedules import SCHEDULES
    from pipeline.snapshot_modes import DaemonSnapshots
    from pipeline.stage import StageRunner
    from pipeline.transport import SocketLinks

    def digest(state) -> list[int]:
        return [checksum(np.ascontiguousarray(np.asarray(leaf))) for leaf in jax.tree.leaves(state)]

    program = StageProgram(GPTConfig(d_model=args.d_model, layers_per_stage=(2,)), STAGES,
                           args.stage, jax.devices())
    snapshots = DaemonSnapshots(args.daemon, JOB, args.stage, STAGES, eager=False)
    digests = os.path.join(args.workdir, f"digests{args.stage}.jsonl")
    first = 0
    if args.resume:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), program.state)
        restored = snapshots.client.restore(abstract)
        program.state = restored.state
        jax.block_until_ready(program.state)
        with open(digests) as f:
            before = {row["iteration"]: row["digest"] for row in map(json.loads, f)}
        report = {"stage": args.stage, "step": restored.step, "source": restored.source,
                  "restore_seconds": restored.seconds, "restored_at": time.time(),
                  "matches": before.get(restored.step) == digest(program.state)}
        with open(os.path.join(args.workdir, f"restored{args.stage}.json"), "w") as f:
            json.dump(report, f)
        first = restored.step + 1

    def record(iteration, state):
        with open(digests, "a") as f:
            f.write(json.dumps({"iteration": iteration, "digest": digest(state)}) + "\n")

    links = SocketLinks(args.rendezvous, STAGES, args.stage)
    inbox, send = links.endpoint(args.stage)
    runner = StageRunner(program, SCHEDULES["1f1b"](STAGES, 4, args.stage), args.stage, STAGES,
                         inbox, send, {"bubblesnap": snapshots})
    try:
        runner.run(["bubblesnap"] * args.iterations, first_iteration=first,
                   after_iteration=record)
    except (ConnectionError, TimeoutError) as err:
        print(f"[stage {args.stage}] a neighbour stage is gone ({err}); stopping", file=sys.stderr)
        return 3
    finally:
        snapshots.close()
        links.close()
    return 0


# -- the hosts ------------------------------------------------------------------------------

class Host:
    """One simulated host: a daemon and, while training, one stage process."""

    def __init__(self, index: int, peers: list[str], args):
        self.index = index
        self.stage = None
        from bubblesnap.testing import DaemonProcess
        self.daemon = DaemonProcess(
            "--peers", ",".join(peers), "--index", str(index),
            "--replicas", str(args.replicas), "--max-interval", "1",
            "--durable-dir", args.durable_dir, "--durable-every-steps", str(args.durable_every),
            "--memory-budget", "2GiB", name=f"daemon {index}")
        self.address = self.daemon.address

    def start_stage(self, args, rendezvous: str, resume: bool) -> None:
        # Before the failure the stages train until they are killed (the cap only
        # bounds a run whose kill never comes); after it, --train-after iterations.
        iterations = args.train_after if resume else _MAX_ITERATIONS
        self.stage = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", "stage",
             "--stage", str(self.index), "--daemon", self.address, "--workdir", args.workdir,
             "--rendezvous", rendezvous, "--iterations", str(iterations), "--d-model",
             str(args.d_model), *(["--resume"] if resume else [])])

    def trained(self, args) -> int:
        """The last iteration this host's stage finished (its digest log; -1: none)."""
        try:
            with open(os.path.join(args.workdir, f"digests{self.index}.jsonl")) as f:
                return max((json.loads(line)["iteration"] for line in f), default=-1)
        except (FileNotFoundError, ValueError):
            return -1

    def kill(self) -> None:
        if self.stage is not None and self.stage.poll() is None:
            self.stage.send_signal(signal.SIGKILL)
            self.stage.wait()
        self.daemon.kill()

    def stop(self) -> None:
        if self.stage is not None and self.stage.poll() is None:
            self.stage.kill()
            self.stage.wait()
        self.daemon.stop()


def job_status(address: str):
    import grpc

    from bubblesnap.protos import daemon_pb2, daemon_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        try:
            jobs = daemon_pb2_grpc.DaemonStub(channel).Status(
                daemon_pb2.StatusRequest(job=JOB), timeout=5).jobs
        except grpc.RpcError:
            return None
    return jobs[0] if jobs else None


def wait_until_safe(hosts: list[Host], args) -> tuple[int, int]:
    """Waits until a step the failure may not lose exists, then until every stage
    trained ``--steps-past-commit`` iterations past it, so the failure strikes a job
    that had moved on. Returns (the step committed, the step the failure may not
    lose). One host dying may not lose the committed step; two adjacent hosts with
    one replica take both copies of a stage, so only the durable tier's newest whole
    step is safe then."""
    deadline = time.monotonic() + args.timeout
    safe = None
    while time.monotonic() < deadline:
        if any(h.stage.poll() is not None for h in hosts):
            raise SystemExit("a stage process ended before the kill: see its output above")
        if safe is None:
            status = job_status(hosts[0].address)
            if status is not None and status.latest_committed_step >= args.kill_after:
                if args.kill_adjacent == 1:
                    safe = status.latest_committed_step
                elif status.durable_steps and max(status.durable_steps) >= args.kill_after:
                    safe = max(status.durable_steps)
        elif min(h.trained(args) for h in hosts) >= safe + args.steps_past_commit:
            status = job_status(hosts[0].address)
            return (status.latest_committed_step if status is not None else safe), safe
        time.sleep(0.05)
    raise SystemExit(f"the kill's condition did not hold within {args.timeout:.0f} s")


def run(args) -> dict:
    from bubblesnap.testing import free_port
    peers = [f"127.0.0.1:{free_port()}" for _ in range(STAGES)]
    hosts = [Host(i, peers, args) for i in range(STAGES)]
    try:
        log(f"3 daemons in a ring ({', '.join(h.address for h in hosts)}), --replicas "
            f"{args.replicas}, durable every {args.durable_every} steps in {args.durable_dir}")
        rendezvous = tempfile.mkdtemp(dir=args.workdir)
        for host in hosts:
            host.start_stage(args, rendezvous, resume=False)
        committed, safe = wait_until_safe(hosts, args)
        doomed = list(range(1, 1 + args.kill_adjacent))
        killed_at = time.time()
        for i in doomed:
            hosts[i].kill()
        # Copies of stage 1 the survivors hold: besides the replicas the ring placed, a
        # survivor may hold one that re-replication made (a copy whose holders had dropped
        # to one: the primary's was freed by retention while a replica stayed)
        survivors = [job_status(h.address) for h in hosts if h.index not in doomed]
        survivors_hold = sorted({s.step for status in survivors
                                 for s in getattr(status, "steps", ())
                                 if any(r.rank == 1 for r in s.ranks)})
        # what the group holds after the kill: its newest committed step (a step may
        # commit between the kill's condition and the kill) and the whole durable steps
        held_after = {"committed_after_kill": max(
            (s.latest_committed_step for s in survivors if s is not None), default=-1),
            "durable_at_kill": sorted({d for s in survivors if s is not None
                                       for d in s.durable_steps})}
        log(f"step {committed} committed, step {safe} may not be lost; killed host(s) {doomed} "
            f"(daemon and stage) with SIGKILL; the survivors hold stage 1 at {survivors_hold}")
        for host in hosts:  # the scheduler stops the rest of the job
            if host.stage.poll() is None:
                host.stage.kill()
                host.stage.wait()
        for i in doomed:
            peers[i] = f"127.0.0.1:{free_port()}"
            hosts[i] = Host(i, peers, args)
            log(f"replacement daemon for host {i} on {peers[i]} (empty memory)")
        replaced_at = time.time()
        rendezvous = tempfile.mkdtemp(dir=args.workdir)
        for host in hosts:
            host.start_stage(args, rendezvous, resume=True)
        codes = [h.stage.wait(timeout=args.timeout) for h in hosts]
        if any(codes):
            raise SystemExit(f"resumed stages exited with {codes}")
    finally:
        for host in hosts:
            host.stop()
    restored = []
    for s in range(STAGES):
        with open(os.path.join(args.workdir, f"restored{s}.json")) as f:
            restored.append(json.load(f))
    for r in restored:
        log(f"stage {r['stage']}: step {r['step']} from {r['source']} in "
            f"{r['restore_seconds'] * 1e3:.0f} ms, matches the snapshot: {r['matches']}")
    steps = {r["step"] for r in restored}
    return {"restored_step": restored[1]["step"] if len(steps) == 1 else sorted(steps),
            "source": restored[1]["source"],
            "recovery_seconds": max(r["restored_at"] for r in restored) - killed_at,
            # where that time went: replacement daemons up, then trainers up and restored
            "replacement_daemons_seconds": replaced_at - killed_at,
            "restore_seconds": max(r["restore_seconds"] for r in restored),
            "state_matches_snapshot": all(r["matches"] for r in restored) and len(steps) == 1,
            "killed_hosts": doomed, "replicas": args.replicas,
            "stage1_steps_on_survivors": survivors_hold,
            "committed_at_kill": committed, **held_after,
            # the newest step the failure may not lose (see wait_until_safe)
            "safe_at_kill": safe,
            "trained_to_step": max(r["step"] for r in restored) + args.train_after,
            "stages": [{k: r[k] for k in ("stage", "step", "source", "restore_seconds",
                                          "matches")} for r in restored]}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kill-adjacent", type=int, choices=[1, 2], default=1,
                   help="hosts killed together, from host 1 on (default 1)")
    p.add_argument("--replicas", type=int, default=1,
                   help="copies of every snapshot on the next hosts (default 1)")
    p.add_argument("--kill-after", type=int, default=8,
                   help="kill once this step is committed for the job (default 8)")
    p.add_argument("--steps-past-commit", type=int, default=2,
                   help="iterations every stage trains past the committed step before the "
                        "kill (default 2)")
    p.add_argument("--train-after", type=int, default=10,
                   help="iterations the job trains after it is restored (default 10)")
    p.add_argument("--durable-every", type=int, default=4,
                   help="write every N-th step to the durable tier (default 4)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after (seconds)")
    p.add_argument("--role", choices=["main", "stage"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--daemon", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--iterations", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps_past_commit < 0 or args.train_after < 1:
        p.error("--steps-past-commit must be >= 0 and --train-after >= 1")
    return args


def main() -> int:
    args = parse_args()
    if args.role == "stage":
        return stage_main(args)
    args.workdir = tempfile.mkdtemp(prefix="bubblesnap-failover-")
    args.durable_dir = os.path.join(args.workdir, "durable")
    try:
        report = run(args)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(report), flush=True)
    return 0 if report["state_matches_snapshot"] else 1


if __name__ == "__main__":
    sys.exit(main())
