"""``bubblesnap plan``: the bubble plan for a pipeline, before it runs or as a daemon holds it.

From a profile on the command line: the schedule (1F1B or GPipe) of
--stages stages and --microbatches microbatches is simulated op by op with
the forward and backward times given, each stage's bubbles are measured,
and the planner (the daemon's own, bubbles/planner.py) says how often to
snapshot, which chunks to fetch in which bubble, what spills (fetched while
training waits) and the overhead it predicts. With --daemon, the plan a
running daemon holds for --job instead, as its Status reports it.
"""

import argparse
import json
import sys

import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import daemon_pb2_grpc
from bubblesnap.service.bubbles import planner
from bubblesnap.service.bubbles.schedules import SCHEDULES, bubbles_of, simulate
from bubblesnap.shared.sizes import human_bytes, parse_bytes


def add_parser(sub) -> None:
    d = planner.PlannerOptions()
    p = sub.add_parser("plan", help="print the bubble plan for a pipeline profile or a daemon",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="per iteration (default 8)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="default 1f1b")
    p.add_argument("--forward-ms", type=float, default=10.0,
                   help="one microbatch's forward on one stage (default 10 ms)")
    p.add_argument("--backward-ms", type=float, default=None,
                   help="one microbatch's backward (default twice the forward)")
    p.add_argument("--state", type=parse_bytes, default=parse_bytes("1GiB"),
                   help="training state per stage, e.g. 12GiB (default 1GiB)")
    p.add_argument("--slots", type=int, default=8,
                   help="tensors the state is split into, evenly (default 8)")
    p.add_argument("--copy-gbps", type=float, default=10.0,
                   help="device-to-host fetch rate, GB/s (default 10)")
    p.add_argument("--max-interval", type=int, default=d.max_interval,
                   help=f"longest snapshot interval the plan may choose (default "
                        f"{d.max_interval})")
    p.add_argument("--safety", type=float, default=d.safety,
                   help=f"fraction of a bubble that may be filled (default {d.safety})")
    p.add_argument("--daemon", default=None,
                   help="print the plan this daemon holds for --job instead")
    p.add_argument("--job", default="", help="the job, with --daemon")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def profile_plan(args) -> dict:
    """The plan for the profile the flags describe, as plain values."""
    for name in ("stages", "microbatches", "slots", "max_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    forward = args.forward_ms / 1e3
    backward = (args.backward_ms if args.backward_ms is not None else 2 * args.forward_ms) / 1e3
    if forward <= 0 or backward <= 0 or args.copy_gbps <= 0 or args.state < 1:
        raise ValueError("--forward-ms, --backward-ms, --copy-gbps and --state must be > 0")
    timeline, iteration = simulate(args.stages, args.microbatches, forward, backward,
                                   args.schedule)
    slot = -(-args.state // args.slots)
    slots = tuple(min(slot, args.state - i * slot) for i in range(args.slots))
    profiles = {s: planner.RankProfile(bubbles=bubbles_of(timeline[s], iteration, 1e-9 * forward),
                                       iteration_seconds=iteration,
                                       copy_bytes_per_second=args.copy_gbps * 1e9,
                                       slot_bytes=slots)
                for s in range(args.stages)}
    options = planner.PlannerOptions(max_interval=args.max_interval, safety=args.safety)
    made = planner.plan(profiles, options)
    return {"source": "profile", "schedule": args.schedule, "iteration_seconds": iteration,
            "interval": made.interval, "predicted_overhead": made.predicted_overhead,
            "spill_bytes": made.spill_bytes, "ranks": [
                {"rank": s, "bubbles": len(profiles[s].bubbles),
                 "bubble_seconds": sum(t for _, t in profiles[s].bubbles),
                 "usable_bubbles": r.usable_bubbles, "step_bytes": args.state,
                 "chunks": sum(len(c) for c in r.assignments.values()),
                 "spill_bytes": r.spill_bytes, "predicted_overhead": r.predicted_overhead}
                for s, r in sorted(made.ranks.items())]}


def daemon_plan(address: str, job: str) -> dict:
    """The plan ``address`` holds for ``job`` (its Status)."""
    with grpc.insecure_channel(address) as channel:
        [status] = daemon_pb2_grpc.DaemonStub(channel).Status(
            pb.StatusRequest(job=job), timeout=10).jobs
    plan = status.plan
    return {"source": f"daemon {address}", "job": job, "interval": plan.interval,
            "version": plan.version, "predicted_overhead": plan.predicted_overhead,
            "spill_bytes": sum(r.planned_spill_bytes for r in plan.ranks), "ranks": [
                {"rank": r.rank, "bubbles": r.bubbles, "bubble_seconds": r.bubble_seconds,
                 "step_bytes": r.step_bytes, "spill_bytes": r.planned_spill_bytes,
                 "predicted_overhead": r.predicted_overhead} for r in plan.ranks]}


def format_plan(plan: dict) -> str:
    lines = [f"plan ({plan['source']}): snapshot every {plan['interval']} iteration(s), "
             f"predicted overhead {100 * plan['predicted_overhead']:.2f}% (worst stage), "
             f"{human_bytes(plan['spill_bytes'])} spilled in all"]
    for r in plan["ranks"]:
        chunks = f", {r['chunks']} chunks" if "chunks" in r else ""
        lines.append(f"  stage {r['rank']}: {r['bubbles']} bubbles, "
                     f"{1e3 * r['bubble_seconds']:.1f} ms idle per iteration{chunks}, "
                     f"{human_bytes(r['step_bytes'])} state, {human_bytes(r['spill_bytes'])} "
                     f"spilled, overhead {100 * r['predicted_overhead']:.2f}%")
    return "\n".join(lines)


def run(args) -> int:
    try:
        if args.daemon:
            if not args.job:
                raise ValueError("--daemon needs --job (the job whose plan to print)")
            plan = daemon_plan(args.daemon, args.job)
        else:
            plan = profile_plan(args)
    except ValueError as err:
        print(f"bubblesnap plan: {err}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(f"bubblesnap plan: daemon {args.daemon}: {err.code().name}: {err.details()}",
              file=sys.stderr)
        return 1
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0
