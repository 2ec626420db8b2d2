"""Pipeline-parallel GPT training with snapshots taken in the pipeline bubbles.

A GPT-style Flax decoder is split into S stages, each on its own devices
(several devices per stage: its kernels are sharded over them), trained with
optax AdamW under a GPipe or 1F1B schedule of M microbatches. Each stage tells
its BubbleSnapshotter where it waits for a neighbour; the daemon plans which
chunks of the previous step's state to fetch in each bubble.

Two ways to run the stages:
  --transport threads    one process, one thread and one forced CPU device set per
                         stage (the demo and the timeline; stages share the cores)
  --transport processes  one process per stage, each pinned to its own core with
                         os.sched_setaffinity, activations passed over Unix sockets:
                         idle time is really idle (what benchmarks/overhead.py uses);
                         with --hosts over TCP, and with --netns each stage in a
                         network namespace of its own (as on separate hosts)

Examples:
  python examples/pipeline_gpt.py --stages 4 --schedule 1f1b --timeline timeline.png
  python examples/pipeline_gpt.py --transport processes --stages 2 --steps 30 --json

With --modes a,b,... the iterations cycle through snapshot modes in segments
(--rounds x modes x (--segment-warmup + --segment) iterations after --warmup),
so modes are compared side by side in one run. The last line of --json output
is one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def log(message: str) -> None:
    print(f"[pipeline] {message}", file=sys.stderr, flush=True)


def iteration_plan(args) -> tuple[list[str], list[bool]]:
    """The snapshot mode of every iteration, and whether it is measured."""
    modes = args.modes.split(",")
    if len(modes) == 1:
        return ([modes[0]] * args.steps,
                [i >= args.warmup for i in range(args.steps)])
    plan, measured = [modes[0]] * args.warmup, [False] * args.warmup
    for round_ in range(args.rounds):
        for k in range(len(modes)):
            mode = modes[(round_ + k) % len(modes)]  # rotate the order every round
            plan += [mode] * (args.segment_warmup + args.segment)
            measured += [False] * args.segment_warmup + [True] * args.segment
    return plan, measured


def build_config(args):
    from pipeline.model import GPTConfig
    return GPTConfig(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                     layers_per_stage=args.layers_per_stage, seq_len=args.seq_len,
                     microbatch_size=args.microbatch_size)


def make_modes(args, stage: int, stages: int) -> dict:
    from pipeline import snapshot_modes
    made = {}
    for name in set(args.modes.split(",")):
        if name == "none":
            made[name] = snapshot_modes.NoCheckpoints()
        elif name in ("bubblesnap", "eager"):
            daemon = args.daemons.split(",")[stage] if args.daemons else args.daemon
            made[name] = snapshot_modes.DaemonSnapshots(daemon, f"{args.job}-{name}", stage,
                                                        stages, eager=name == "eager")
        elif name == "orbax_async":
            made[name] = snapshot_modes.OrbaxAsync(os.path.join(args.orbax_dir, f"stage{stage}"))
    return made


def run_stage(args, stage: int, devices, inbox, send) -> dict:
    """Builds and runs one stage; returns what the parent needs to report."""
    import jax

    from pipeline.model import StageProgram
    from pipeline.schedules import SCHEDULES
    from pipeline.stage import StageRunner
    program = StageProgram(build_config(args), args.stages, stage, devices)
    schedule = SCHEDULES[args.schedule](args.stages, args.microbatches, stage)
    modes = make_modes(args, stage, args.stages)
    runner = StageRunner(program, schedule, stage, args.stages, inbox, send, modes,
                         keep_states=16 if args.verify_restore else 0)
    plan, _ = iteration_plan(args)
    try:
        runner.run(plan)
        result = {"stage": stage, "iterations": runner.iterations, "events": runner.events,
                  "spans": {name: m.spans() for name, m in modes.items()},
                  "snapshots": {name: m.snapshots() for name, m in modes.items()},
                  "stats": {name: m.stats() for name, m in modes.items()},
                  "state_bytes": program.state_bytes()}
        if "bubblesnap" in modes and stage == 0:
            from google.protobuf import json_format
            result["plan"] = json_format.MessageToDict(modes["bubblesnap"].client.status().plan)
        if args.verify_restore in modes:
            result["restore"] = verify_restore(modes[args.verify_restore].client, runner, jax)
    finally:
        for mode in modes.values():
            mode.close()
    return result


def verify_restore(client, runner: "StageRunner", jax) -> dict:  # noqa: F821
    """Restores the job's latest committed step and compares it with the state of that step.

    Other stages may still be committing their last step: waits up to a minute
    for a step that every stage holds.
    """
    import numpy as np

    from bubblesnap.clients import RestoreError
    state = runner.program.state
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    deadline = time.monotonic() + 60
    while True:
        try:
            restored = client.restore(abstract)
            break
        except RestoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    expected = runner.kept_states.get(restored.step)
    matches = expected is not None and all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes() and a.sharding == b.sharding
        for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(expected), strict=True))
    return {"step": restored.step, "seconds": restored.seconds, "matches": bool(matches)}


# -- running the stages ------------------------------------------------------------------------

def run_threads(args) -> list[dict]:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={args.stages * args.devices_per_stage}")
    import jax

    from pipeline.transport import ThreadLinks, run_stage_threads
    links, results = ThreadLinks(args.stages), [None] * args.stages
    devices = jax.devices()

    def work(stage):
        d = args.devices_per_stage
        inbox, send = links.endpoint(stage)
        results[stage] = run_stage(args, stage, devices[stage * d:(stage + 1) * d], inbox, send)

    run_stage_threads(work, args.stages)
    return results


def stage_process(args) -> int:
    """--role stage: one stage of a multi-process run."""
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[args.stage % len(cores)]})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                               "false --xla_force_host_platform_device_count="
                               f"{args.devices_per_stage}")
    import jax

    from pipeline.transport import SocketLinks
    links = SocketLinks(args.rendezvous, args.stages, args.stage,
                        addresses=args.hosts.split(",") if args.hosts else None)
    inbox, send = links.endpoint(args.stage)
    result = run_stage(args, args.stage, jax.devices(), inbox, send)
    links.close()
    with open(os.path.join(args.rendezvous, f"result{args.stage}.json"), "w") as f:
        json.dump(result, f)
    return 0


def run_processes(args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bubblesnap-pipeline-") as rendezvous:
        passthrough = [a for a in sys.argv[1:] if a != "--json"]
        daemon = ["--daemon", args.daemon] if args.daemon else []
        netns = args.netns.split(",") if args.netns else None
        procs = [subprocess.Popen([*(["ip", "netns", "exec", netns[s]] if netns else []),
                                   sys.executable, os.path.abspath(__file__), *passthrough,
                                   "--role", "stage", "--stage", str(s), "--rendezvous",
                                   rendezvous, "--orbax-dir", args.orbax_dir, *daemon],
                                  preexec_fn=_die_with_parent)
                 for s in range(args.stages)]
        codes = _wait_all(procs)
        if any(codes):
            raise SystemExit(f"stage processes exited with {codes}")
        results = []
        for s in range(args.stages):
            with open(os.path.join(rendezvous, f"result{s}.json")) as f:
                results.append(json.load(f))
        return results


def _die_with_parent() -> None:
    """Runs in each stage's child before it starts: the kernel kills the stage when
    this process dies, so a run killed from outside (a benchmark stopping it, even by
    SIGKILL) leaves no stage behind. Linux only; elsewhere a no-op."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass


def _wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Waits for every stage; if one fails, the others are stopped instead of waiting for it."""
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    return [p.returncode for p in procs]


# -- reporting ----------------------------------------------------------------------------------

def summarize(args, results: list[dict]) -> dict:
    plan, measured = iteration_plan(args)
    per_mode: dict[str, list[float]] = {}
    for i, (mode, counted) in enumerate(zip(plan, measured, strict=True)):
        if counted:
            per_mode.setdefault(mode, []).append(
                max(r["iterations"][i]["seconds"] for r in results))
    modes = {}
    for mode, times in per_mode.items():
        measured_iterations = {i for i, (m, c) in enumerate(zip(plan, measured, strict=True))
                               if c and m == mode}
        if mode == "bubblesnap":
            # Step k is fetched in iteration k+1: count it only if that iteration was
            # measured too (the step pending when a segment ends is flushed untimed).
            measured_iterations = {i for i in measured_iterations if i + 1 in measured_iterations}
        snapshots = len(set.intersection(*[set(r["snapshots"].get(mode, [])) for r in results])
                        & measured_iterations)
        modes[mode] = {"median_step_seconds": statistics.median(times),
                       "min_step_seconds": min(times), "max_step_seconds": max(times),
                       "measured_steps": len(times), "step_seconds": times,
                       "snapshots": snapshots,
                       "snapshot_interval": len(times) / snapshots if snapshots else None}
    if "none" in modes:
        base = modes["none"]["median_step_seconds"]
        for row in modes.values():
            row["overhead_pct"] = 100.0 * (row["median_step_seconds"] - base) / base
    stages = []
    for r in results:
        waits = _per_iteration(r, "wait", plan, measured, "none")
        copies = [stop - start for label, start, stop in r["spans"].get("eager", [])
                  if label == "spill"]
        row = {"stage": r["stage"], "state_bytes": r["state_bytes"],
               "bubble_seconds_per_iteration": statistics.median(waits) if waits else None,
               "naive_copy_seconds": statistics.median(copies) if copies else None}
        if row["bubble_seconds_per_iteration"] and row["naive_copy_seconds"]:
            row["copy_to_bubble_ratio"] = (row["naive_copy_seconds"]
                                           / row["bubble_seconds_per_iteration"])
        if r["stats"].get("bubblesnap"):
            row["bubblesnap"] = r["stats"]["bubblesnap"]
        if "restore" in r:
            row["restore"] = r["restore"]
        stages.append(row)
    report = {"stages": args.stages, "microbatches": args.microbatches,
              "schedule": args.schedule, "transport": args.transport,
              "devices_per_stage": args.devices_per_stage, "iterations": len(plan),
              "modes": modes, "per_stage": stages}
    if "plan" in results[0]:
        report["plan"] = results[0]["plan"]
    if args.verify_restore:
        report["restore_matches"] = all(s.get("restore", {}).get("matches") for s in stages)
    return report


def _per_iteration(result: dict, label: str, plan, measured, mode: str) -> list[float]:
    """Seconds of ``label`` events per measured iteration of ``mode`` for one stage."""
    totals = []
    iterations = result["iterations"]
    for i, it in enumerate(iterations):
        if not measured[i] or plan[i] != mode or i + 1 >= len(iterations):
            continue
        start, stop = it["start"], iterations[i + 1]["start"]
        totals.append(sum(min(e, stop) - max(s, start) for lbl, s, e in result["events"]
                          if lbl == label and e > start and s < stop))
    return totals


def draw_timeline(args, results: list[dict], path: str) -> None:
    from pipeline import timeline
    plan, measured = iteration_plan(args)
    mode = "bubblesnap" if "bubblesnap" in plan else plan[-1]
    candidates = [i for i in range(len(plan) - 2) if plan[i] == plan[i + 1] == mode and measured[i]]
    first = candidates[-1] if candidates else max(0, len(plan) - 3)
    first_stage = results[0]["iterations"]
    window = (first_stage[first]["start"], first_stage[first + 2]["start"]
              if first + 2 < len(first_stage) else first_stage[-1]["start"]
              + first_stage[-1]["seconds"])
    lanes = [{"events": r["events"], "spans": r["spans"].get(mode, [])} for r in results]
    timeline.draw(lanes, window, path, f"{args.stages} stages, {args.schedule}, "
                  f"{args.microbatches} microbatches, snapshots: {mode} "
                  f"(iterations {first}-{first + 1})")


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or N,N,... blocks per stage") from None
    if any(n < 0 for n in layers):
        raise argparse.ArgumentTypeError("blocks per stage cannot be negative")
    return layers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches (default 4)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--steps", type=int, default=12,
                   help="iterations, with a single mode (default 12)")
    p.add_argument("--transport", choices=["threads", "processes"], default="threads")
    p.add_argument("--devices-per-stage", type=int, default=1,
                   help="forced CPU devices per stage; >1 shards each stage's kernels")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="with --transport processes: do not pin stage s to core s")
    p.add_argument("--hosts", metavar="HOST:PORT,...",
                   help="with --transport processes: stage s listens for its previous "
                        "stage on the s-th address and activations travel over TCP "
                        "(default: Unix sockets)")
    p.add_argument("--netns", metavar="NS,...",
                   help="with --transport processes: run stage s in network namespace NS "
                        "(ip netns exec, as root: a bubblesnap.testing.Cluster's hosts; "
                        "benchmarks/overhead.py --link-rate)")
    model = p.add_argument_group("model size")
    model.add_argument("--vocab", type=int, default=2048)
    model.add_argument("--d-model", type=int, default=256)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--layers-per-stage", type=_layers, default=(2,),
                       help="decoder blocks per stage: one number for all, or one per stage "
                            "(e.g. 3,2: the last stage also holds the LM head)")
    model.add_argument("--seq-len", type=int, default=32)
    model.add_argument("--microbatch-size", type=int, default=2)
    snap = p.add_argument_group("snapshots")
    snap.add_argument("--modes", default="bubblesnap",
                      help="snapshot mode(s), comma separated: none, bubblesnap, eager, "
                           "orbax_async (default bubblesnap)")
    snap.add_argument("--warmup", type=int, default=3, help="unmeasured first iterations")
    snap.add_argument("--rounds", type=int, default=3, help="with several modes: rounds")
    snap.add_argument("--segment", type=int, default=5, help="measured iterations per segment")
    snap.add_argument("--segment-warmup", type=int, default=2,
                      help="unmeasured iterations when a segment starts")
    snap.add_argument("--daemon", help="use this daemon instead of starting one")
    snap.add_argument("--daemons", metavar="ADDR,ADDR,...",
                      help="one daemon per stage, as on separate hosts (a ring of peers, "
                           "bubblesnap.testing.Ring): stage s uses the s-th")
    snap.add_argument("--max-interval", type=int, default=8,
                      help="for the daemon started here: longest snapshot interval its planner "
                           "may choose (1: every iteration, spilling what does not fit)")
    snap.add_argument("--job", default="pipeline", help="job name prefix")
    snap.add_argument("--verify-restore", nargs="?", const="bubblesnap", default=None,
                      choices=("bubblesnap", "eager"), metavar="MODE",
                      help="after training, restore the latest committed step of MODE's job "
                           "(default bubblesnap) on every stage and compare it with the state "
                           "of that step. bubblesnap's steps follow the daemon's plan, which "
                           "each stage adopts a couple of iterations ahead: in a short segment "
                           "on a loaded host a stage may take none; eager's are every "
                           "iteration")
    p.add_argument("--timeline", metavar="PNG", help="draw two iterations of every stage")
    p.add_argument("--json", action="store_true", help="print a JSON report last")
    p.add_argument("--events", metavar="FILE",
                   help="write every stage's raw events and iterations as JSON")
    p.add_argument("--role", choices=["main", "stage"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", help=argparse.SUPPRESS)
    p.add_argument("--orbax-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.modes.split(",")) - {"none", "bubblesnap", "eager", "orbax_async"}
    if unknown:
        p.error(f"unknown snapshot modes {sorted(unknown)}")
    if args.stages < 2:
        p.error("--stages must be at least 2")
    if args.daemons and len(args.daemons.split(",")) != args.stages:
        p.error(f"--daemons names {len(args.daemons.split(','))} daemons for {args.stages} "
                "stages")
    for flag, value in (("--hosts", args.hosts), ("--netns", args.netns)):
        if value and len(value.split(",")) != args.stages:
            p.error(f"{flag} names {len(value.split(','))} entries for {args.stages} stages")
        if value and args.transport != "processes":
            p.error(f"{flag} needs --transport processes")
    if len(args.layers_per_stage) not in (1, args.stages):
        p.error(f"--layers-per-stage has {len(args.layers_per_stage)} entries for "
                f"{args.stages} stages")
    return args


def main() -> int:
    args = parse_args()
    if args.role == "stage":
        return stage_process(args)
    daemon = None
    needs_daemon = {"bubblesnap", "eager"} & set(args.modes.split(","))
    if needs_daemon and args.daemon is None and not args.daemons:
        from bubblesnap.testing import DaemonProcess
        daemon = DaemonProcess("--memory-budget", "8GiB", "--max-interval", str(args.max_interval))
        args.daemon = daemon.address
        log(f"started a daemon on {args.daemon}")
    orbax_dir = tempfile.mkdtemp(prefix="bubblesnap-orbax-", dir="/dev/shm")
    args.orbax_dir = orbax_dir
    try:
        plan, _ = iteration_plan(args)
        log(f"{args.stages} stages x {args.devices_per_stage} device(s), {args.schedule}, "
            f"{args.microbatches} microbatches, {len(plan)} iterations, {args.transport}")
        try:
            results = (run_processes(args) if args.transport == "processes"
                       else run_threads(args))
        except BaseException:
            if daemon is not None:  # what a daemon the stages waited on was doing
                log(daemon.dump_stacks())
            raise
        report = summarize(args, results)
        if args.events:
            with open(args.events, "w") as f:
                json.dump({"plan": iteration_plan(args), "stages": results}, f)
        if args.timeline:
            draw_timeline(args, results, args.timeline)
            report["timeline"] = args.timeline
            log(f"timeline written to {args.timeline}")
    finally:
        import shutil
        shutil.rmtree(orbax_dir, ignore_errors=True)
        if daemon is not None:
            daemon.stop()
    for mode, row in report["modes"].items():
        log(f"{mode:>12}: median step {row['median_step_seconds'] * 1e3:.1f} ms"
            + (f", overhead {row['overhead_pct']:+.2f}%" if "overhead_pct" in row else "")
            + (f", snapshot every {row['snapshot_interval']:.2f} steps"
               if row["snapshot_interval"] else ", no snapshots"))
    if args.json:
        print(json.dumps(report), flush=True)
    return 0 if report.get("restore_matches", True) else 1


if __name__ == "__main__":
    sys.exit(main())
