"""Cost of the training log and the boundary log: bytes per step and step time.

The 3-stage GPT pipeline of examples/lossless.py (one process, one thread
and one forced CPU device per stage, 1F1B, 4 microbatches) trains with the
same shuffling data loader in three modes, interleaved in segments of one
run (the order rotates every round):

  none          no log
  training_log  stage 0 sends the step's record (batch sample indices and the
                loader's RNG state, JSON; the stages share one data order) as
                the step begins, and waits at the step's end until the local
                daemon and its --replicas 1 peer hold it
  boundary_log  the training log, and every stage logs each activation and
                gradient it sends to a neighbour (both boundaries, .npy bytes,
                one stream per kind and microbatch) to its daemon as it sends
                it, and waits at the step's end until they are held: what
                stage-local replay (examples/lossless.py --fail-scope stage)
                reads back

Reported per mode: the median step time (slowest stage) with min-max, the
overhead against none, and the bytes each log takes per step.

Usage: python benchmarks/log_cost.py [--json] [--quick] [--rounds 4] [--segment 8]
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

import bench_common as common

from bubblesnap.testing import Ring

# The pipeline runtime and the lossless example live in examples/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

STAGES = 3


def run(args, daemon: str) -> dict:
    import jax
    import numpy as np
    from lossless import MICROBATCHES

    from bubblesnap.clients import BoundaryLog, LoggedSteps, NoSnapshots
    from bubblesnap.clients.jax import ClientOptions, SnapshotClient
    from pipeline.data_loader import DataLoader
    from pipeline.model import GPTConfig, StageProgram
    from pipeline.schedules import SCHEDULES
    from pipeline.stage import StageRunner
    from pipeline.transport import ThreadLinks

    config = GPTConfig(d_model=args.d_model, layers_per_stage=(1,), vocab=1024)
    loader = DataLoader(config, MICROBATCHES)
    options = ClientOptions(daemon=daemon)
    clients = [SnapshotClient("log-cost-bench", s, STAGES, options) for s in range(STAGES)]
    boundary_logs = [BoundaryLog(clients[s], range(STAGES - 1), lambda stage: options)
                     for s in range(STAGES)]
    record_bytes = []
    current = [""] * STAGES  # each stage's mode in the iteration it runs

    class Mode(NoSnapshots):
        """Tells the senders which mode the stage's iteration runs in."""

        def __init__(self, stage: int, mode: str):
            self.stage, self.mode = stage, mode

        def begin_iteration(self, iteration: int) -> None:
            current[self.stage] = self.mode

    def record(iteration: int) -> bytes:
        payload = loader.record(iteration)
        record_bytes.append(len(payload))
        return payload

    def hooks(stage: int, mode: str):
        """A logging mode's step sends the record as it begins (stage 0: one data order
        for all stages) and waits for it and the boundary records as it ends."""
        if mode == "none":
            return Mode(stage, mode)
        return LoggedSteps(clients[stage], record if stage == 0 else None, Mode(stage, mode))

    def sender(stage: int, send):
        def logged_send(to: int, key, value) -> None:
            if current[stage] == "boundary_log":
                boundary_logs[stage].write(min(stage, to), key, np.asarray(value))
            send(to, key, value)
        return logged_send

    modes = ("none", "training_log", "boundary_log")
    plan, measured = ["none"] * args.warmup, [False] * args.warmup
    for round_ in range(args.rounds):
        for k in range(len(modes)):
            plan += [modes[(round_ + k) % len(modes)]] * (2 + args.segment)
            measured += [False] * 2 + [True] * args.segment
    links = ThreadLinks(STAGES)
    devices = jax.devices()
    runners = []
    for s in range(STAGES):
        inbox, send = links.endpoint(s)
        program = StageProgram(config, STAGES, s, [devices[s]])
        clients[s].register(program.state)  # the daemon keeps records of registered ranks
        runners.append(StageRunner(
            program,
            SCHEDULES["1f1b"](STAGES, MICROBATCHES, s), s, STAGES, inbox, sender(s, send),
            {m: hooks(s, m) for m in modes}, batch=loader.batch))
    threads = [threading.Thread(target=r.run, args=(plan,)) for r in runners]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    common.log(f"{len(plan)} iterations in {time.perf_counter() - started:.1f} s")
    for c in clients:
        c.close()
    per_mode: dict[str, list[float]] = {m: [] for m in modes}
    for i, (mode, counted) in enumerate(zip(plan, measured, strict=True)):
        if counted:
            per_mode[mode].append(max(r.iterations[i]["seconds"] for r in runners))
    base = statistics.median(per_mode["none"])
    report = {"benchmark": "log_cost", "modes": {}}
    for mode, times in per_mode.items():
        med = statistics.median(times)
        report["modes"][mode] = {"median_step_ms": round(med * 1e3, 2),
                                 "min_step_ms": round(min(times) * 1e3, 2),
                                 "max_step_ms": round(max(times) * 1e3, 2),
                                 "measured_steps": len(times),
                                 "overhead_pct": round(100 * (med - base) / base, 2)}
    report["training_log_bytes_per_step"] = statistics.median(record_bytes)
    boundary_steps = plan.count("boundary_log")
    by_boundary = [sum(b.bytes_by_boundary.get(boundary, 0) for b in boundary_logs)
                   // boundary_steps for boundary in range(STAGES - 1)]
    report["boundary_log_bytes_per_step"] = {"per_boundary": by_boundary,
                                             "all_boundaries": sum(by_boundary)}
    report["state_bytes_per_stage"] = [int(sum(np.asarray(x).nbytes for x in
                                               jax.tree.leaves(r.program.state)))
                                       for r in runners]
    report["config"] = {"stages": STAGES, "microbatches": MICROBATCHES, "d_model": args.d_model,
                        "rounds": args.rounds, "segment": args.segment}
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--segment", type=int, default=8, help="measured steps per segment")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    args = common.parse_args(p, quick={"rounds": 1, "segment": 2, "warmup": 1, "d_model": 32})
    common.force_cpu_devices(STAGES)
    common.exit_on_sigterm()
    # The ring examples/lossless.py runs on: the trainer's host and the one holding replicas.
    ring = Ring(2, "--replicas", "1", "--max-interval", "1", log_level="ERROR")
    try:
        report = run(args, ring.addresses[0])
    finally:
        ring.stop()
    for mode, row in report["modes"].items():
        common.log(f"{mode:>13}: median step {row['median_step_ms']:.2f} ms "
                   f"({row['min_step_ms']:.2f}-{row['max_step_ms']:.2f}), "
                   f"overhead {row['overhead_pct']:+.2f}%")
    common.log(f"training log: {report['training_log_bytes_per_step']:.0f} bytes per step; "
               f"boundary log: {report['boundary_log_bytes_per_step']['all_boundaries']} bytes "
               "per step")
    if args.json:
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
