"""Load: one daemon and the ranks of one job, every rank holding its Bubbles stream open.

Pipeline stages keep one Bubbles stream each for their whole run. With the
threaded gRPC server every stream held a server thread, so past 94 of them
every other call, health checks included, waited until its deadline. Here,
for each rank count of --ranks (default 64 and 256), a fresh daemon serves
that many ranks of one job, run as threads in --processes worker processes
(on its Unix socket: nothing leaves the machine). Each rank registers, opens
its stream, then for --iterations iterations sends a START and a REPORT on
it (the bubbles of its iteration), takes a snapshot of its --state-bytes
(BeginStep, copy, CommitStep, and the wait until its daemon holds it) and
sleeps --step-seconds (its compute). Meanwhile this process asks the health
service every --probe-seconds and Status in every fifth probe, timing each
answer. A run stops after --seconds at most.

Reported per rank count (``runs``): snapshots taken, errors (failed
snapshots, broken streams, failed or late health and Status answers: must be
0) with the first few reasons, snapshot latency, health and Status latency
(p50, p99, max in ms), plans the streams received, wall seconds; ``ok`` when
every run had no error.

Usage: python benchmarks/load.py [--json] [--quick] [--ranks 64,256] [--processes 4]
       [--iterations 8] [--step-seconds 0.5] [--state-bytes 65536] [--seconds 300]
"""

import argparse
import json
import queue
import subprocess
import sys
import threading
import time

import bench_common as common

#: How long a health or Status answer may take before it counts as an error: a
#: supervisor's typical probe deadline.
PROBE_DEADLINE_SECONDS = 2.0
ERRORS_SHOWN = 5


def percentiles(samples: list[float]) -> dict:
    """p50, p99 and max of ``samples`` (seconds) in ms; zeros when there are none."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5) * 1e3, 2), "p99": round(pick(0.99) * 1e3, 2),
            "max": round(ordered[-1] * 1e3, 2)}


# -- a worker process: some ranks, one thread each ------------------------------------------

def _rank(args, rank: int, results: dict, lock: threading.Lock) -> None:
    import grpc
    import numpy as np

    from bubblesnap.clients import ClientOptions, NumpyClient
    from bubblesnap.protos import daemon_pb2 as pb
    from bubblesnap.protos import daemon_pb2_grpc

    def failed(reason: str) -> None:
        with lock:
            results["errors"] += 1
            if len(results["reasons"]) < ERRORS_SHOWN:
                results["reasons"].append(f"rank {rank}: {reason}")

    client = NumpyClient(args.job, rank, args.world, ClientOptions(
        daemon=args.daemon, backoff_seconds=0.0))
    state = {"w": np.full(args.state_bytes // 4, rank, dtype=np.float32)}
    first = client.snapshot(0, state)  # registers; not timed
    if not first.taken:
        failed(first.reason)
    channel = grpc.insecure_channel(args.daemon)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = daemon_pb2_grpc.DaemonStub(channel).Bubbles(iter(requests.get, None))
    plan_version = [0]

    def pump() -> None:
        try:
            for plan in call:
                plan_version[0] = plan.plan_version
                with lock:
                    results["plans"] += 1
        except grpc.RpcError as err:
            failed(f"stream: {err.code().name}: {err.details()}")

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    deadline = time.monotonic() + args.seconds
    for iteration in range(1, args.iterations + 1):
        if time.monotonic() > deadline:
            break
        event = dict(job=args.job, rank=rank, stage=rank, step=iteration - 1,
                     iteration=iteration)
        requests.put(pb.BubbleEvent(kind=pb.BubbleEvent.START, position=0,
                                    expected_seconds=0.01, plan_version=plan_version[0],
                                    **event))
        requests.put(pb.BubbleEvent(kind=pb.BubbleEvent.REPORT,
                                    iteration_seconds=args.step_seconds,
                                    reports=[pb.BubbleReport(position=0,
                                                             measured_seconds=0.01)], **event))
        started = time.perf_counter()
        result = client.snapshot(iteration, state)
        took = time.perf_counter() - started
        if result.taken:
            with lock:
                results["snapshot_seconds"].append(took)
        else:
            failed(result.reason)
        time.sleep(args.step_seconds)
    requests.put(None)  # the stream ends well
    pumping.join(timeout=30)
    client.close()
    channel.close()


def worker(args) -> int:
    """Runs ranks [--first-rank, --first-rank + --count) and prints their results as JSON."""
    results = {"snapshot_seconds": [], "errors": 0, "reasons": [], "plans": 0}
    lock = threading.Lock()
    threads = [threading.Thread(target=_rank, args=(args, rank, results, lock))
               for rank in range(args.first_rank, args.first_rank + args.count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(results), flush=True)
    return 0


# -- the parent: one daemon per rank count, the workers, the probes -------------------------

def _probe(daemon, stop: threading.Event, interval: float, found: dict) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from bubblesnap.protos import daemon_pb2 as pb
    from bubblesnap.testing import DAEMON_SERVICE

    health = health_pb2_grpc.HealthStub(daemon.channel)
    n = 0
    while not stop.wait(interval):
        kind = "status" if n % 5 == 1 else "health"
        n += 1
        started = time.perf_counter()
        try:
            if kind == "health":
                health.Check(health_pb2.HealthCheckRequest(service=DAEMON_SERVICE),
                             timeout=PROBE_DEADLINE_SECONDS)
            else:
                daemon.stub.Status(pb.StatusRequest(), timeout=PROBE_DEADLINE_SECONDS)
        except grpc.RpcError as err:
            found["errors"] += 1
            if len(found["reasons"]) < ERRORS_SHOWN:
                found["reasons"].append(f"{kind}: {err.code().name}")
            continue
        found[kind].append(time.perf_counter() - started)


def run(args, ranks: int) -> dict:
    from bubblesnap.testing import DaemonProcess

    budget = max(256 << 20, ranks * args.state_bytes * (args.iterations + 4))
    processes = min(args.processes, ranks)
    with DaemonProcess("--memory-budget", str(budget), own_shm_dir=True,
                       log_level="ERROR") as daemon:
        probes = {"health": [], "status": [], "errors": 0, "reasons": []}
        stop = threading.Event()
        prober = threading.Thread(target=_probe, args=(daemon, stop, args.probe_seconds,
                                                       probes))
        started = time.perf_counter()
        prober.start()
        per = -(-ranks // processes)
        workers = [subprocess.Popen(
            [sys.executable, __file__, "--worker", "--daemon", daemon.address, "--job", "load",
             "--world", str(ranks), "--first-rank", str(first),
             "--count", str(min(per, ranks - first)), "--iterations", str(args.iterations),
             "--step-seconds", str(args.step_seconds), "--state-bytes", str(args.state_bytes),
             "--seconds", str(args.seconds)], stdout=subprocess.PIPE, text=True)
            for first in range(0, ranks, per)]
        try:
            outputs = [json.loads(w.communicate(timeout=args.seconds + 120)[0].splitlines()[-1])
                       for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
            stop.set()
            prober.join()
        seconds = time.perf_counter() - started
    snapshots = [s for out in outputs for s in out["snapshot_seconds"]]
    reasons = [r for out in outputs for r in out["reasons"]] + probes["reasons"]
    return {"ranks": ranks, "processes": len(workers), "streams": ranks,
            "snapshots": len(snapshots),
            "errors": sum(out["errors"] for out in outputs) + probes["errors"],
            "error_reasons": reasons[:ERRORS_SHOWN],
            "snapshot_ms": percentiles(snapshots),
            "health_ms": {**percentiles(probes["health"]), "probes": len(probes["health"])},
            "status_ms": {**percentiles(probes["status"]), "probes": len(probes["status"])},
            "plans_received": sum(out["plans"] for out in outputs),
            "seconds": round(seconds, 1)}


def print_table(report: dict) -> None:
    print(f"{'ranks':>6}{'snapshots':>10}{'errors':>7}  {'snapshot ms p50/p99/max':>24}"
          f"  {'health ms p50/p99/max':>22}  {'status ms p50/p99/max':>22}")
    for row in report["runs"]:
        cols = [f"{row[k]['p50']:.1f}/{row[k]['p99']:.1f}/{row[k]['max']:.1f}"
                for k in ("snapshot_ms", "health_ms", "status_ms")]
        print(f"{row['ranks']:>6}{row['snapshots']:>10}{row['errors']:>7}  {cols[0]:>24}"
              f"  {cols[1]:>22}  {cols[2]:>22}")
    print("ok" if report["ok"] else "ERRORS: " + "; ".join(
        r for row in report["runs"] for r in row["error_reasons"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="64,256", help="rank counts, one run each")
    p.add_argument("--processes", type=int, default=4, help="worker processes per run")
    p.add_argument("--iterations", type=int, default=8, help="snapshots per rank")
    p.add_argument("--step-seconds", type=float, default=0.5, help="compute between them")
    p.add_argument("--state-bytes", type=int, default=64 << 10, help="each rank's state")
    p.add_argument("--probe-seconds", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=300.0, help="most a run may take")
    for name in ("--daemon", "--job", "--world", "--first-rank", "--count"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = common.parse_args(p, quick={"ranks": "8,16", "processes": 2, "iterations": 2,
                                       "step_seconds": 0.05, "state_bytes": 4096,
                                       "seconds": 60})
    if args.worker:
        args.world, args.first_rank, args.count = int(args.world), int(args.first_rank), \
            int(args.count)
        return worker(args)
    common.exit_on_sigterm()
    runs = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        runs.append(run(args, ranks))
        row = runs[-1]
        common.log(f"{ranks} ranks: {row['snapshots']} snapshots, {row['errors']} errors, "
                   f"snapshot p99 {row['snapshot_ms']['p99']} ms, health p99 "
                   f"{row['health_ms']['p99']} ms (max {row['health_ms']['max']})")
    report = {"benchmark": "load", "runs": runs, "ok": all(r["errors"] == 0 for r in runs)}
    common.report_out(report, args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
