"""Planner scale: how long the bubble planner takes for a job of 1,024 pipeline stages.

The synthetic job (defaults; every number is a flag):

  model     175e9 parameters (GPT-3 class), split evenly over the stages.
  state     14 bytes per parameter: bf16 params 2 + fp32 master copy 4 + fp32
            Adam m 4 + fp32 Adam v 4. Each stage's share is 8 slots: those four
            tensors for each of two weight groups, attention (1/3 of the
            stage's parameters) and MLP (2/3), as a transformer block has.
  compute   forward time per microbatch per stage f = 2 * (stage params) *
            (tokens per microbatch) / (achieved FLOP/s), default 2,048 tokens
            (one sequence) at 300 TFLOP/s (~30% of an H100's dense bf16 peak);
            backward b = 2 f. Attention-score FLOPs and communication are ignored.
  schedule  1F1B (PipeDream-flush; `--schedule gpipe` for GPipe), simulated op
            by op: an op starts when its stage is free and its input is there
            (forward i of stage s after forward i of stage s-1; backward i of
            stage s after backward i of stage s+1). Every gap in a stage's
            timeline is a bubble: the warm-up wait before its first forward
            (s*f), the waits between its ops, and the cool-down after its last
            backward until the iteration ends (s*b). In both schedules each
            stage idles (p-1)(f+b) per iteration, which the run checks.
  fetch     25 GB/s device-to-host (PCIe Gen5 x16 class), the same for every stage.

Reported: the plan (interval, predicted overhead, spilled bytes) and the wall
time of ``planner.plan`` over all stages (median, min, max of --repeats runs;
the requirement is < 1 s for 1,024 stages). Then the daemon-side use, through
:class:`bubblesnap.service.bubble_plans.BubblePlans`, for one daemon holding
--ranks-per-daemon stages and for one holding all of them: recording two
iterations of bubble reports, making the plan and answering the first START,
and the steady-state cost of a START that already holds the plan.

Usage: python benchmarks/plan_scale.py [--json] [--quick] [--stages 1024] [--microbatches 64]
       [--params 175e9] [--bandwidth 25e9] [--schedule 1f1b|gpipe] [--repeats 5]
"""

import argparse
import dataclasses
import statistics
import sys
import time

import bench_common as common

from bubblesnap.service.bubbles import planner
from bubblesnap.service.bubbles.plans import BubbleOptions, BubblePlans
from bubblesnap.service.bubbles.schedules import bubbles_of, simulate

# (state kind, bytes per parameter) of the Adam training state, in slot order.
STATE_KINDS = (("param_bf16", 2), ("master_fp32", 4), ("adam_m_fp32", 4), ("adam_v_fp32", 4))
WEIGHT_GROUPS = (("attention", 1, 3), ("mlp", 2, 3))  # (name, numerator, denominator)


def stage_slots(params: int, stages: int) -> list[tuple[int, ...]]:
    """Slot bytes per stage: the parameters split evenly, then by weight group and state kind."""
    slots = []
    for s in range(stages):
        count = params // stages + (1 if s < params % stages else 0)
        first = count * WEIGHT_GROUPS[0][1] // WEIGHT_GROUPS[0][2]
        groups = (first, count - first)
        slots.append(tuple(n * width for n in groups for _, width in STATE_KINDS))
    return slots


def build_profiles(args):
    params_per_stage = args.params / args.stages
    forward = 2 * params_per_stage * args.tokens_per_microbatch / (args.tflops * 1e12)
    backward = 2 * forward
    timeline, iteration = simulate(args.stages, args.microbatches, forward, backward,
                                   args.schedule)
    slots = stage_slots(int(args.params), args.stages)
    profiles = {s: planner.RankProfile(bubbles=bubbles_of(timeline[s], iteration, 1e-9 * forward),
                                       iteration_seconds=iteration,
                                       copy_bytes_per_second=args.bandwidth,
                                       slot_bytes=slots[s])
                for s in range(args.stages)}
    return profiles, forward, backward, iteration


def timed(fn, repeats: int):
    """Result of the last call, and the wall seconds of each of ``repeats`` calls."""
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - started)
    return result, seconds


def summary(seconds):
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
            "runs": len(seconds)}


def daemon_use(profiles, ranks, options: planner.PlannerOptions, repeats: int) -> dict:
    """BubblePlans holding ``ranks``: two iterations of REPORTs, the plan, then steady STARTs.

    Every rank reports two iterations of bubbles (one REPORT each), then one
    START with no plan makes the daemon plan and answer; afterwards a START
    that holds the current plan is a lookup with no answer.
    """
    plans = BubblePlans(lambda job, rank: tuple((k, 0, n) for k, n in
                                                enumerate(profiles[rank].slot_bytes)),
                        BubbleOptions(planner=options,
                                      initial_copy_bytes_per_second=profiles[ranks[0]]
                                      .copy_bytes_per_second))
    iteration = profiles[ranks[0]].iteration_seconds
    started = time.perf_counter()
    for it in (0, 1):
        for rank in ranks:
            for position, seconds in profiles[rank].bubbles:
                plans.record_end("job", rank, it, position, seconds, iteration)
    learned = time.perf_counter() - started
    started = time.perf_counter()
    first = plans.answer_start("job", ranks[0], 0)
    plan_seconds = time.perf_counter() - started
    _, steady = timed(lambda: plans.answer_start("job", ranks[-1], first.version), repeats)
    return {"ranks": len(ranks), "record_two_iterations_seconds": learned,
            "plan_and_answer_seconds": plan_seconds, "interval": first.interval,
            "steady_start_seconds": summary(steady)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=1024, help="pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, default=64, help="microbatches per iteration")
    parser.add_argument("--params", type=float, default=175e9, help="model parameters")
    parser.add_argument("--bandwidth", type=float, default=25e9,
                        help="device-to-host fetch bytes/s per stage (default 25e9, PCIe class)")
    parser.add_argument("--tokens-per-microbatch", type=int, default=2048)
    parser.add_argument("--tflops", type=float, default=300.0,
                        help="achieved TFLOP/s per stage, sets f and b (default 300)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--repeats", type=int, default=5, help="timed planner runs (median)")
    parser.add_argument("--ranks-per-daemon", type=int, default=8,
                        help="stages one host's daemon serves (default 8)")
    parser.add_argument("--skip-daemon", action="store_true",
                        help="skip the BubblePlans measurements")
    parser.add_argument("--skip-all-ranks-daemon", action="store_true",
                        help="skip BubblePlans holding every stage (the slow worst case)")
    args = common.parse_args(parser, quick={"stages": 64, "microbatches": 8, "repeats": 2},
                             argv=argv)

    options = planner.PlannerOptions()
    started = time.perf_counter()
    profiles, forward, backward, iteration = build_profiles(args)
    build_seconds = time.perf_counter() - started
    result, seconds = timed(lambda: planner.plan(profiles, options), args.repeats)

    idle = [sum(s for _, s in p.bubbles) for p in profiles.values()]
    expected_idle = (args.stages - 1) * (forward + backward)
    state_bytes = sum(p.step_bytes for p in profiles.values())
    report = {
        "benchmark": "plan_scale", "stages": args.stages, "microbatches": args.microbatches,
        "schedule": args.schedule,
        "params": args.params, "state_bytes_per_param": sum(w for _, w in STATE_KINDS),
        "state_bytes": state_bytes, "state_bytes_per_stage": state_bytes // args.stages,
        "slots_per_stage": len(STATE_KINDS) * len(WEIGHT_GROUPS),
        "forward_seconds": forward, "backward_seconds": backward,
        "iteration_seconds": iteration,
        "bubble_fraction": (args.stages - 1) / (args.microbatches + args.stages - 1),
        "bubbles_per_stage": {"min": min(len(p.bubbles) for p in profiles.values()),
                              "max": max(len(p.bubbles) for p in profiles.values())},
        "bubbles_total": sum(len(p.bubbles) for p in profiles.values()),
        "idle_seconds_per_stage": {"min": min(idle), "max": max(idle),
                                   "formula_(p-1)(f+b)": expected_idle},
        "bandwidth_bytes_per_second": args.bandwidth,
        "planner_options": dataclasses.asdict(options),
        "interval": result.interval,
        "predicted_overhead": result.predicted_overhead,
        "spill_bytes": result.spill_bytes,
        "ranks_spilling": sum(1 for r in result.ranks.values() if r.spill_bytes),
        "profile_build_seconds": build_seconds,
        "plan_seconds": summary(seconds),
        "plan_under_one_second": statistics.median(seconds) < 1.0,
    }
    if not args.skip_daemon:
        ranks = sorted(profiles)
        report["bubble_plans"] = {"per_host_daemon": daemon_use(
            profiles, ranks[:args.ranks_per_daemon], options, max(args.repeats, 20))}
        if not args.skip_all_ranks_daemon:
            report["bubble_plans"]["one_daemon_all_ranks"] = daemon_use(
                profiles, ranks, options, args.repeats)
    common.report_out(report, args.json, print_plan_scale_table)
    return 0


def print_plan_scale_table(report: dict) -> None:
    for key, value in report.items():
        print(f"{key:>28}: {value}")


if __name__ == "__main__":
    sys.exit(main())
