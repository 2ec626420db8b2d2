"""Step-time overhead of checkpointing a pipeline-parallel GPT, every mode in one run.

Runs examples/pipeline_gpt.py with one process per stage, each pinned to its
own core (os.sched_setaffinity; 2 stages on a 2-core machine), XLA limited to
one thread, activations and gradients passed over Unix sockets, so a stage
that waits for a neighbour leaves its core really idle. The daemon runs at
niceness 10, so it takes idle time first.

Modes, interleaved in segments of the same run (rounds x modes, the order
rotated each round; the first iterations of every segment are not measured,
so one mode's leftovers do not land in the next):

  none         no checkpointing: the baseline
  bubblesnap   step k fetched in iteration k+1's bubbles, as the daemon plans; the
               daemon runs with --max-interval 1 (a snapshot every iteration,
               whatever does not fit is spilled and counted in the step time)
  eager        the same data path, copying the whole state right after the step
  orbax_async  Orbax CheckpointManager, async, saving every step to /dev/shm

For each mode: the median step time (the slowest stage's iteration) over the
measured iterations, its min and max, ``overhead_pct`` against ``none``, and
the snapshot interval achieved (measured iterations per committed snapshot).
Per stage: the state bytes, the bubble time per iteration (waits, in ``none``
iterations), the time a naive copy of the whole state takes (``eager``'s
copies) and their ratio.

  python benchmarks/overhead.py --json
"""

import argparse
import json
import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "pipeline_gpt.py")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--rounds", type=int, default=4, help="rounds over all modes (default 4)")
    p.add_argument("--segment", type=int, default=6,
                   help="measured iterations per mode per round (default 6)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers-per-stage", default="2,2")
    p.add_argument("--microbatch-size", type=int, default=2)
    args = p.parse_args()
    cmd = [sys.executable, EXAMPLE, "--transport", "processes", "--json",
           "--modes", "none,bubblesnap,eager,orbax_async", "--rounds", str(args.rounds),
           "--segment", str(args.segment), "--stages", str(args.stages),
           "--microbatches", str(args.microbatches), "--layers-per-stage",
           args.layers_per_stage, "--microbatch-size", str(args.microbatch_size),
           "--max-interval", "1"]
    print(f"running: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if run.returncode != 0:
        return run.returncode
    report = json.loads(run.stdout.strip().splitlines()[-1])
    modes = report["modes"]
    bubblesnap, orbax = modes["bubblesnap"]["overhead_pct"], modes["orbax_async"]["overhead_pct"]
    base = modes["none"]
    report["noise_pct"] = {"none_min_to_median": 100 * (base["min_step_seconds"]
                                                        / base["median_step_seconds"] - 1),
                           "none_max_to_median": 100 * (base["max_step_seconds"]
                                                        / base["median_step_seconds"] - 1)}
    report["checks"] = {
        "bubblesnap_overhead_le_1pct": bubblesnap <= 1.0,
        "bubblesnap_snapshot_every_iteration": modes["bubblesnap"]["snapshot_interval"] == 1.0,
        "bubblesnap_below_third_of_orbax_async": bubblesnap < orbax / 3,
        "naive_copy_ge_third_of_bubble_every_stage": all(
            (s.get("copy_to_bubble_ratio") or 0) >= 1 / 3 for s in report["per_stage"]),
    }
    report["method"] = ("one process per stage pinned to its own core, XLA single-threaded, "
                        "Unix-socket activations; modes interleaved in segments; daemon nice 10")
    if args.json:
        print(json.dumps(report))
    else:
        for mode, row in modes.items():
            print(f"{mode:>12}: median {row['median_step_seconds'] * 1e3:7.2f} ms "
                  f"[{row['min_step_seconds'] * 1e3:.2f}-{row['max_step_seconds'] * 1e3:.2f}] "
                  f"overhead {row['overhead_pct']:+6.2f}%  interval {row['snapshot_interval']}")
        for stage in report["per_stage"]:
            print(f"stage {stage['stage']}: {stage['state_bytes'] / 1e6:.1f} MB state, copy/bubble "
                  f"{stage.get('copy_to_bubble_ratio', float('nan')):.2f}")
        for name, ok in report["checks"].items():
            print(f"{name}: {'yes' if ok else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
