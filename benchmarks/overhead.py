"""Step-time overhead of checkpointing a pipeline-parallel GPT, every mode side by side.

Runs examples/pipeline_gpt.py with one process per stage, each pinned to its
own core (os.sched_setaffinity; 2 stages on a 2-core machine), XLA limited to
one thread, activations and gradients passed over Unix sockets, so a stage
that waits for a neighbour leaves its core really idle. The daemon runs at
niceness 10, so it takes idle time first.

Modes:

  none         no checkpointing: the baseline
  bubblesnap   step k fetched in iteration k+1's bubbles, as the daemon plans; the
               daemon runs with --max-interval 1 (a snapshot every iteration;
               what does not fit is spilled, and counted in the step time)
  eager        the same data path, copying the whole state right after the step
  orbax_async  Orbax CheckpointManager, async, saving every step to /dev/shm
  unreplicated bubblesnap with one daemon per stage, as on separate hosts (a ring of
               peers, bubblesnap.testing.Ring), --replicas 0: the baseline of the two below
  replicated   the same ring, --replicas 1: each daemon pushes every new copy to its
               neighbour as soon as it is committed
  paced        the same, --pace-replication: each push waits for the stage's bubble
               (at most --pace-max-wait, default 2 s)

Each mode runs as its own short training run (fresh processes and daemon:
--warmup unmeasured iterations, in which bubblesnap profiles its bubbles and
gets its plan, then --measured iterations), and the runs are interleaved:
round after round over all modes, the order rotated each round, so the
machine's slow moments spread over every mode. Reported per mode: the median
step time (the slowest stage's iteration) over all measured iterations, min
and max, ``overhead_pct`` against ``none`` and the snapshot interval achieved
(measured iterations per committed snapshot; for bubblesnap a step counts
only if it was fetched within measured iterations, so each run's last step,
fetched after the run, does not). Per stage: state bytes, bubble
time per iteration (its waits in ``none`` runs), the time a naive copy of its
whole state takes (``eager``'s copies) and their ratio. For the ring modes,
``replication``: the step-time overhead of replicating, unpaced and paced,
against ``unreplicated``, and from every daemon's Status (its ``replication``
records of the measured steps) the time from each commit until the step's
rank had its 1 + k copies, the seconds pushes waited before they began, and
the fraction of the bytes sent inside the stages' bubbles.

With ``--link-rate RATE`` (a tc rate: 200mbit, 1gbit) the stages run as on
separate hosts joined by a network of that rate: a ``bubblesnap.testing.Cluster``
(root), one network namespace per stage, each with its daemon, every link
shaped both ways with tbf. Activations and gradients travel over TCP between
the namespaces' addresses (the example's --hosts, --netns), so they share the
links with the daemons' replication, which is where BAFT's pacing should pay
off. Only modes none, unreplicated, replicated and paced run, on a fresh
cluster each. The report adds ``link_rate``, ``state_bytes_per_stage``,
per stage ``link_seconds_per_copy`` (one copy of its state at the link rate)
and ``replication.paced_vs_unpaced``; the bubblesnap checks give way to
``paced_below_unpaced``.

  python benchmarks/overhead.py --json [--quick] [--link-rate 1gbit]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

import bench_common as common

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import Ring
from bubblesnap.testing import cluster as cluster_module

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "pipeline_gpt.py")
MODES = ("none", "bubblesnap", "eager", "orbax_async", "unreplicated", "replicated", "paced")
#: The ring modes: the flags of every daemon of the ring (one per stage).
RING_FLAGS = {"unreplicated": ("--replicas", "0"), "replicated": ("--replicas", "1"),
              "paced": ("--replicas", "1", "--pace-replication")}
JOB = "pipeline-bubblesnap"  # the example's job of its bubblesnap mode
#: The modes of a --link-rate run: the ring modes next to their common baseline.
LINK_MODES = ("none", "unreplicated", "replicated", "paced")
#: Where each stage listens for its previous stage's TCP connection in its namespace.
STAGE_PORT = 7300


def run_mode(mode: str, args) -> tuple[dict, list, int]:
    """The example's report of one run and (ring modes) every daemon's replication records
    and the bytes their data channels sent."""
    if args.link_rate:
        return run_on_cluster(mode, args)
    if mode not in RING_FLAGS:
        return run_example(mode, args), [], 0
    ring = Ring(args.stages, "--memory-budget", "8GiB", "--max-interval", "1",
                *RING_FLAGS[mode])
    try:
        report = run_example("bubblesnap", args, "--daemons", ",".join(ring.addresses))
        sent = sum(map(data_sent_bytes, ring.daemons))  # while training ran
        return report, replication_records(ring.daemons), sent
    finally:
        ring.stop()


def run_on_cluster(mode: str, args) -> tuple[dict, list, int]:
    """One run of a --link-rate mode: each stage on a host of a fresh Cluster (its daemons
    idle for ``none``, so every mode runs beside the same processes), activations over
    TCP on the shaped links."""
    flags = RING_FLAGS.get(mode, RING_FLAGS["unreplicated"])
    with cluster_module.Cluster(args.stages, "--memory-budget", "8GiB", "--max-interval", "1",
                                "--pace-max-wait", str(args.pace_max_wait), *flags,
                                rate=args.link_rate) as cluster:
        where = ["--hosts", ",".join(f"{h.address}:{STAGE_PORT}" for h in cluster.hosts),
                 "--netns", ",".join(h.netns for h in cluster.hosts)]
        if mode == "none":
            return run_example("none", args, *where, popen=cluster.hosts[0].popen), [], 0
        report = run_example("bubblesnap", args, *where, "--daemons",
                             ",".join(d.address for d in cluster.daemons),
                             popen=cluster.hosts[0].popen)
        sent = sum(map(data_sent_bytes, cluster.daemons))  # while training ran
        # a push in flight holds the link for one copy's time: no record comes meanwhile
        link = max(s["state_bytes"] for s in report["per_stage"]) * 8 / rate_bits(args.link_rate)
        return report, replication_records(cluster.daemons, quiet=1.0 + link), sent


def replication_records(daemons, quiet: float = 0.5) -> list:
    """Every daemon's records of its pushes, once none arrived for ``quiet`` seconds (the
    last steps' pushes may still run when training ends; a paced one waits for bubbles
    until its stage's reports go stale, about a second after training ended)."""
    deadline, last = time.monotonic() + 5 + 2 * quiet, None
    while True:
        records = [r for d in daemons
                   for job in d.stub.Status(pb.StatusRequest(job=JOB), timeout=30).jobs
                   for r in job.replication]
        if len(records) == last or time.monotonic() > deadline:
            return records
        last = len(records)
        time.sleep(quiet)


def data_sent_bytes(daemon) -> int:
    """What ``daemon``'s data channel sent to peers so far (its metrics): new copies'
    pushes, and re-replication, which keeps no record."""
    with urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                timeout=30) as answer:
        text = answer.read().decode()
    found = re.search(r"^bubblesnap_data_sent_bytes(?:_total)? (\S+)$", text, re.M)
    return int(float(found[1])) if found else 0


def run_example(mode: str, args, *extra: str, popen=subprocess.Popen) -> dict:
    """The example's JSON report of one run in ``mode``; ``popen`` starts it (a Cluster
    host's, to start it in that host's namespace, killed with the cluster)."""
    cmd = [sys.executable, EXAMPLE, "--transport", "processes", "--json", "--modes", mode, *extra,
           "--warmup", str(args.warmup), "--steps", str(args.warmup + args.measured),
           "--stages", str(args.stages), "--microbatches", str(args.microbatches),
           "--schedule", args.schedule,
           "--layers-per-stage", args.layers_per_stage,
           "--microbatch-size", str(args.microbatch_size), "--max-interval", "1"]
    proc = popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        stdout, _ = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted (SIGTERM): its stages die with it
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed: {' '.join(cmd)}")
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds over all modes (default 3)")
    p.add_argument("--warmup", type=int, default=12,
                   help="unmeasured iterations per run: compilation, bubble profiling, the "
                        "first plan and the first snapshots into new memory (default 12)")
    p.add_argument("--measured", type=int, default=8,
                   help="measured iterations per run (default 8)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b",
                   help="pipeline schedule (default 1f1b)")
    p.add_argument("--layers-per-stage", default="2,2")
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--link-rate", type=link_rate, metavar="RATE",
                   help="run none, unreplicated, replicated and paced with every stage on a "
                        "host of its own (a Cluster: network namespaces, needs root), links "
                        "shaped to RATE both ways (a tc rate: 200mbit, 1gbit), activations "
                        "over TCP. The default model's stage holds about 25 MB of state "
                        "(f32 params and AdamW moments): one copy holds a 200mbit link for "
                        "1 s, a 1gbit one for 0.2 s, against about 90 ms per iteration on 2 "
                        "cores, so replication, not the copy into the daemon, is what the "
                        "link limits")
    p.add_argument("--pace-max-wait", type=float, default=2.0, metavar="SECONDS",
                   help="with --link-rate: every daemon's --pace-max-wait, the longest a "
                        "paced push waits for bubbles before the rest goes at once "
                        "(default 2, the daemon's)")
    args = common.parse_args(p, quick={"rounds": 1, "warmup": 6, "measured": 3,
                                       "layers_per_stage": "1,1"})
    common.exit_on_sigterm()  # the ring modes' daemons (or cluster) are stopped on the way out
    if args.link_rate:
        reason = cluster_module.unavailable()
        if reason:
            raise SystemExit(f"--link-rate needs a Cluster: {reason}")
    modes_run = LINK_MODES if args.link_rate else MODES

    times = {mode: [] for mode in modes_run}
    snapshots = dict.fromkeys(modes_run, 0)
    stages: dict[int, dict] = {}
    plan = None
    pushes = {mode: [] for mode in RING_FLAGS}
    traffic = {mode: {"sent": 0, "pushed": 0, "iterations": 0} for mode in RING_FLAGS}
    for round_ in range(args.rounds):
        for k in range(len(modes_run)):
            mode = modes_run[(round_ + k) % len(modes_run)]
            common.log(f"round {round_ + 1}/{args.rounds}: {mode}")
            report, records, sent = run_mode(mode, args)
            row = report["modes"]["bubblesnap" if mode in RING_FLAGS else mode]
            if mode in RING_FLAGS:  # the measured steps' pushes only
                pushes[mode] += [r for r in records if r.step >= args.warmup]
                traffic[mode]["sent"] += sent
                traffic[mode]["pushed"] += sum(r.nbytes for r in records)
                traffic[mode]["iterations"] += args.warmup + args.measured
            times[mode] += row["step_seconds"]
            snapshots[mode] += row["snapshots"]
            plan = report.get("plan", plan)
            for stage in report["per_stage"]:
                into = stages.setdefault(stage["stage"], {"state_bytes": stage["state_bytes"],
                                                          "bubble": [], "copy": []})
                if stage["bubble_seconds_per_iteration"] is not None:
                    into["bubble"].append(stage["bubble_seconds_per_iteration"])
                if stage["naive_copy_seconds"] is not None:
                    into["copy"].append(stage["naive_copy_seconds"])

    base = statistics.median(times["none"])
    modes = {}
    for mode in modes_run:
        median = statistics.median(times[mode])
        modes[mode] = {"median_step_seconds": median, "min_step_seconds": min(times[mode]),
                       "max_step_seconds": max(times[mode]), "measured_steps": len(times[mode]),
                       "snapshots": snapshots[mode],
                       "snapshot_interval": (len(times[mode]) / snapshots[mode]
                                             if snapshots[mode] else None),
                       "overhead_pct": 100.0 * (median - base) / base}
    replication = replication_report(modes, pushes, traffic)
    report = {
        "benchmark": "overhead", "stages": args.stages, "microbatches": args.microbatches,
        "schedule": args.schedule,
        "layers_per_stage": args.layers_per_stage, "microbatch_size": args.microbatch_size,
        "rounds": args.rounds, "modes": modes, "bubblesnap_plan": plan,
        "replication": replication,
        "noise_pct": {"none_min_vs_median": 100 * (modes["none"]["min_step_seconds"] / base - 1),
                      "none_max_vs_median": 100 * (modes["none"]["max_step_seconds"] / base - 1)},
    }
    if args.link_rate:
        report.update(link_report(args, stages, replication))
    else:
        report.update(loopback_report(args, stages, modes))
    common.report_out(report, args.json, print_overhead_table)
    return 0


def loopback_report(args, stages: dict, modes: dict) -> dict:
    """The per-stage rows and checks of a run on this host (no --link-rate)."""
    per_stage = []
    for number, s in sorted(stages.items()):
        bubble, copy = statistics.median(s["bubble"]), statistics.median(s["copy"])
        per_stage.append({"stage": number, "state_bytes": s["state_bytes"],
                          "bubble_seconds_per_iteration": bubble, "naive_copy_seconds": copy,
                          "copy_to_bubble_ratio": copy / bubble})
    bubblesnap, orbax = modes["bubblesnap"]["overhead_pct"], modes["orbax_async"]["overhead_pct"]
    return {
        "per_stage": per_stage,
        "checks": {
            "bubblesnap_overhead_le_1pct": bubblesnap <= 1.0,
            # Each run's last step is fetched after the run ends, so it is not counted.
            "bubblesnap_snapshot_every_iteration": modes["bubblesnap"]["snapshots"]
            >= modes["bubblesnap"]["measured_steps"] - args.rounds,
            "bubblesnap_below_third_of_orbax_async": bubblesnap < orbax / 3,
            "naive_copy_ge_third_of_bubble_every_stage": all(
                s["copy_to_bubble_ratio"] >= 1 / 3 for s in per_stage)},
        "method": "one process per stage pinned to its own core, XLA single-threaded, "
                  "Unix-socket activations, daemon nice 10; one run per mode, runs "
                  "interleaved round by round; ring modes: one daemon per stage on "
                  "loopback, replicating over its data channel"}


def link_report(args, stages: dict, replication: dict) -> dict:
    """The per-stage rows and checks of a --link-rate run: how long one copy of each
    stage's state holds its link, next to the stage's bubbles."""
    bits = rate_bits(args.link_rate)
    per_stage = []
    for number, s in sorted(stages.items()):
        bubble = statistics.median(s["bubble"])
        link = s["state_bytes"] * 8 / bits
        per_stage.append({"stage": number, "state_bytes": s["state_bytes"],
                          "bubble_seconds_per_iteration": bubble,
                          "link_seconds_per_copy": link,
                          "link_to_bubble_ratio": link / bubble if bubble else None})
    pct = replication["overhead_pct_vs_unreplicated"]
    return {
        "link_rate": args.link_rate, "link_bits_per_second": bits,
        "pace_max_wait_seconds": args.pace_max_wait,
        "state_bytes_per_stage": [s["state_bytes"] for s in per_stage],
        "per_stage": per_stage,
        "checks": {"paced_below_unpaced": pct["paced"] < pct["replicated"]},
        "method": "one host per stage: network namespaces of a bubblesnap.testing.Cluster on a "
                  f"bridge, every link shaped to {args.link_rate} both ways (tbf); one process "
                  "per stage pinned to its own core, XLA single-threaded, activations over "
                  "TCP between the hosts' addresses, one daemon per host (nice 10) "
                  "replicating over its data channel on the same links; a fresh cluster per "
                  "run, runs interleaved round by round"}


#: tc's rate units, in bits per second per unit (tc: bit, and bps for bytes per second).
_RATE_UNITS = {"bit": 1, "bps": 8}
_RATE_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                  "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate ("200mbit", "1gbit", "125mbps")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]i?)?(bit|bps)?", rate.strip().lower())
    if not match or float(match[1]) <= 0:
        raise ValueError(rate)
    return float(match[1]) * _RATE_PREFIXES[match[2] or ""] * _RATE_UNITS[match[3] or "bit"]


def link_rate(text: str) -> str:
    """--link-rate's type: a tc rate this benchmark can also turn into bits per second."""
    try:
        rate_bits(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a tc rate such as 200mbit, 1gbit or 125mbps") from None
    return text.strip().lower()


def replication_report(modes: dict, pushes: dict, traffic: dict) -> dict:
    """Step-time overhead of replication against the ring without it, and per ring mode
    how its pushes went (seconds from commit to 1 + k copies, waits, time in bubbles);
    the bytes the data channels sent while training ran, per iteration, next to those
    of the pushes' records (new copies, pushed then or after): more sent than pushed is
    re-replication of copies short of 1 + k."""
    base = modes["unreplicated"]["median_step_seconds"]
    pct = {mode: 100.0 * (modes[mode]["median_step_seconds"] - base) / base
           for mode in ("replicated", "paced")}
    # BAFT's claim as one number: what paced replication costs as a fraction of what
    # unpaced costs. None where unpaced cost nothing measurable (no ratio to take).
    report = {"overhead_pct_vs_unreplicated": pct,
              "paced_vs_unpaced": (pct["paced"] / pct["replicated"] if pct["replicated"] > 0
                                   else None)}
    for mode, records in pushes.items():
        copies = [r.copies_seconds for r in records]
        sent = sum(r.nbytes for r in records)
        report[mode] = {
            "pushes": len(records),
            "copies_seconds_median": statistics.median(copies) if copies else None,
            "copies_seconds_max": max(copies) if copies else None,
            "waited_seconds_median": (statistics.median(r.waited_seconds for r in records)
                                      if records else None),
            "push_seconds_median": (statistics.median(r.push_seconds for r in records)
                                    if records else None),
            "in_bubbles_fraction": (sum(r.idle_bytes for r in records) / sent
                                    if sent else None),
            "sent_bytes_per_iteration": traffic[mode]["sent"] / traffic[mode]["iterations"],
            "pushed_bytes_per_iteration": (traffic[mode]["pushed"]
                                           / traffic[mode]["iterations"])}
    return report


def print_overhead_table(report: dict) -> None:
    for mode, row in report["modes"].items():
        print(f"{mode:>12}: median {row['median_step_seconds'] * 1e3:7.2f} ms "
              f"[{row['min_step_seconds'] * 1e3:.2f}-{row['max_step_seconds'] * 1e3:.2f}] "
              f"overhead {row['overhead_pct']:+6.2f}%  interval {row['snapshot_interval']}")
    if "link_rate" in report:
        print(f"links: {report['link_rate']} (a Cluster, activations over TCP)")
    for stage in report["per_stage"]:
        ratio = ("link/bubble", stage["link_to_bubble_ratio"]) if "link_rate" in report else (
            "copy/bubble", stage["copy_to_bubble_ratio"])
        print(f"stage {stage['stage']}: {stage['state_bytes'] / 1e6:.1f} MB state, "
              f"{ratio[0]} {ratio[1]:.2f}")
    for mode, pct in report["replication"]["overhead_pct_vs_unreplicated"].items():
        row = report["replication"][mode]
        print(f"{mode:>12}: {pct:+6.2f}% against unreplicated; 1 + k copies "
              f"{row['copies_seconds_median']} s after the commit (median), "
              f"{row['in_bubbles_fraction']} of the bytes sent in bubbles")
    print(f"paced vs unpaced: {report['replication']['paced_vs_unpaced']}")
    for name, ok in report["checks"].items():
        print(f"{name}: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    sys.exit(main())
