"""Lossless recovery: a pipeline killed mid-training resumes bit for bit (TranLogs).

A 3-stage GPT pipeline (one process, one thread and one CPU device per
stage, 1F1B) trains from a shuffling data loader. Every step, before it
runs, each stage logs what redoing it needs: the sample indices of its
batch and the loader's state after drawing them (the training log, held by
the daemons and replicated to a peer). Snapshots are taken in the bubbles.

Three runs, each a separate process:
  reference   trains --steps steps, no failure
  failing     the same, SIGKILLed at --fail-at in the --fail-point:
                bubble        while a bubble is fetching a snapshot (once the
                              job has committed a step)
                after-commit  at the end of the first step from --fail-at on
                              whose predecessor's snapshot commit was just
                              acknowledged, before the daemons can have
                              replicated it (once the job has committed a step)
  resume      restores every stage's latest restorable step from the daemons,
              replays the logged steps after it (the same batches, rebuilding
              the loader's state from the log), then trains on to --steps;
              with --fail-during-replay N it is itself SIGKILLed after
              replaying N steps, and a second resume finishes the job.

With --fail-scope stage only one stage fails (Swift's stage-local
replay): every stage is its own process on its own simulated host (a
daemon each, in a ring with --replicas 1), talking through a relay, and logs
the tensors it sends across the logged boundaries (boundary logs) to its
host's daemon. Stage --fail-stage is SIGKILLed in step --fail-at; a
replacement process restores that stage's newest snapshot alone (the other
stages' later snapshots stay) and replays the steps after it with its inputs
read from its neighbours' daemons, while the other
stages keep their state and wait (a survivor that had not finished the last
step replays that one step from memory). --log-budget limits the boundary
log's bytes per step: adjacent stages are merged into groups whose inner
boundaries are not logged, and a failure rolls back the failed stage's whole
group (plan_log_groups). With --replay-workers N the replacement replays
each lost step whose inputs all come from the logs with N worker threads,
each on its own CPU device with a copy of the stage's parameters, taking a
share of the step's microbatches (replay_shares); the owner sums their
per-microbatch gradients in the order the step did (combine_in_order), so
the result stays bit for bit, and applies the one update before the next
step. The workers compile their programs while the replacement waits for
the plan and restores; a step is shared among those whose compile finished.
Runs: reference, then failing (which recovers and finishes in the same run).

The last line is JSON: bitwise_equal (every parameter and optimizer moment
of every stage equals the reference's, byte for byte), lost_steps (steps
finished before the failure that were neither kept, restored nor replayed),
replayed_steps, restored_step, failed_at, stages_rolled_back (stages that
went back to a snapshot), and for --fail-scope stage the log plan, the
measured boundary-log bytes per step, the trade-off between log bytes and
replay time of every grouping, and the recovery's timings: replay_seconds
(the slowest replaying stage, restore included), replay_workers, and
failed_stage_replay (the replacement's restore and per-step times, their
sum after the first step, which carries the compiles, the steps the workers
replayed and how many shared each, each device's compile time and how long
the replay waited for the stage's own).

    python examples/lossless.py --fail-at 9 --fail-point bubble
    python examples/lossless.py --fail-scope stage --fail-stage 1 --fail-at 9
    python examples/lossless.py --fail-scope stage --fail-stage 2 --log-budget 300000
    python examples/lossless.py --fail-scope stage --fail-at 11 --steps 14 --replay-workers 2
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

STAGES = 3
MICROBATCHES = 4
JOB = "lossless"


def log(message: str) -> None:
    print(f"[lossless] {message}", file=sys.stderr, flush=True)


# -- one training process ---------------------------------------------------------------------

def train_main(args) -> int:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={STAGES}")
    import jax

    from bubblesnap.clients import LoggedSteps, NoSnapshots
    from bubblesnap.protos import daemon_pb2 as pb
    from bubblesnap.protos.checksum import checksum
    from pipeline.data_loader import DataLoader
    from pipeline.model import GPTConfig, StageProgram
    from pipeline.schedules import SCHEDULES
    from pipeline.snapshot_modes import DaemonSnapshots
    from pipeline.stage import StageRunner
    from pipeline.transport import ThreadLinks, run_stage_threads

    def job_committed(client) -> bool:
        """Whether the job has committed a step, the failures' precondition (one before
        any commit leaves nothing to resume from). Training outpaces the commits on a
        loaded machine, and the stages begin snapshotting at different steps (each
        adopts the daemon's plan when it hears it), so the run could end first: once
        every stage holds a copy of one step, only the daemons' replication is left,
        and this waits for it (the caller's stage holds still meanwhile)."""
        steps = client.status().steps
        if not any(s.committed for s in steps) and any(
                len({r.rank for r in s.ranks if r.state == pb.LOCAL}) == STAGES for s in steps):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                    s.committed for s in client.status().steps):
                time.sleep(0.05)
            steps = client.status().steps
        return any(s.committed for s in steps)

    class DiesMidFetch(DaemonSnapshots):
        """Stage 0 of a failing run with --fail-point bubble: SIGKILLed inside a bubble of
        step --fail-at or later, while it fetches a snapshot, once the job has committed
        a step (job_committed)."""

        committed = False

        def bubble(self, position, receive, arrived=None):
            if self.iteration >= args.fail_at and not self.committed:
                self.committed = job_committed(self.client)
            if self.committed:
                def arrived_then_die():  # polled between the fetch's 1 MiB blocks
                    die(f"SIGKILL inside a bubble of step {self.iteration}, mid-fetch")
                arrived = arrived_then_die
            return super().bubble(position, receive, arrived)

    config = GPTConfig(d_model=args.d_model, layers_per_stage=(1,), vocab=1024)
    loader = DataLoader(config, MICROBATCHES)
    links = ThreadLinks(STAGES)
    devices = jax.devices()
    programs = [StageProgram(config, STAGES, s, [devices[s]]) for s in range(STAGES)]
    snapshotting = args.run != "reference"
    failing = args.run == "failing"

    def mode(stage: int):
        if not snapshotting:
            return NoSnapshots()
        dies = failing and args.fail_point == "bubble" and stage == 0
        return (DiesMidFetch if dies else DaemonSnapshots)(args.daemon, JOB, stage, STAGES,
                                                            eager=False)
    modes = [mode(s) for s in range(STAGES)]
    if snapshotting:  # stage 0 logs from the first step on: the daemon keeps registered ranks'
        modes[0].client.register(programs[0].state)
    progress = os.path.join(args.workdir, f"{args.run}.progress")

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
                    and stage == 0 and job_committed(modes[0].client):
                # the first acknowledged commit of the step before (fetched in this
                # iteration's bubbles, sent by its end at the latest, acknowledged a
                # moment later, seconds under load; one whose snapshot was dropped never
                # is: then the next step is tried)
                acked = modes[0].commits_acknowledged
                deadline = time.monotonic() + 10
                while not (acked and acked[-1] >= iteration - 1) and \
                        time.monotonic() < deadline:
                    time.sleep(0.001)
                if acked and acked[-1] >= iteration - 1:
                    die(f"SIGKILL in step {iteration} right after the commit of step "
                        f"{acked[-1]} was acknowledged")
        return hook

    # The stages share one data order: stage 0 logs it (held by the daemons while the
    # step runs, waited for as it ends), all replay from it.
    hooks = [LoggedSteps(modes[0].client, loader.record, modes[0]) if snapshotting else modes[0],
             *modes[1:]]

    def work(stage: int):
        inbox, send = links.endpoint(stage)
        runner = StageRunner(programs[stage], SCHEDULES["1f1b"](STAGES, MICROBATCHES, stage),
                             stage, STAGES, inbox, send, {"m": hooks[stage]},
                             batch=loader.batch)
        runner.run(["m"] * (args.steps - first), first_iteration=first,
                   after_iteration=after(stage))

    run_stage_threads(work, STAGES)
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


# -- one stage fails (--fail-scope stage) -------------------------------------------------------

def stage_main(args) -> int:
    """One stage process of a stage-scope run."""
    # A replacement's replay workers each get a device of their own (their own XLA
    # programs, run in parallel); the stage itself stays on the first.
    workers = args.replay_workers if args.replacement else 1
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={workers}")
    import jax

    from bubblesnap.clients import BoundaryLog, LoggedSteps
    from bubblesnap.clients.jax import ClientOptions, SnapshotClient
    from bubblesnap.protos.checksum import checksum
    from pipeline.data_loader import DataLoader
    from pipeline.model import GPTConfig, StageProgram
    from pipeline.parallel_replay import ReplayWorkers
    from pipeline.schedules import SCHEDULES
    from pipeline.stage import StageRunner
    from pipeline.stage_recovery import PeriodicSnapshots, StageProcess
    from pipeline.transport import RelayLinks

    stage, job = args.stage, f"{JOB}-{args.run}"
    config = GPTConfig(d_model=args.d_model, layers_per_stage=(1,), vocab=1024)
    loader = DataLoader(config, MICROBATCHES)
    program = StageProgram(config, STAGES, stage, jax.devices()[:1])
    schedule = SCHEDULES["1f1b"](STAGES, MICROBATCHES, stage)
    # As soon as the program exists: the workers compile while the replacement
    # connects, waits for the coordinator's plan and restores the snapshot.
    replay_workers = ReplayWorkers(program, schedule, stage, STAGES, loader.batch,
                                   jax.devices()) if workers > 1 else None
    daemons = args.daemons.split(",")  # stage s runs on the host of daemon s

    def options_of(stage: int) -> ClientOptions:
        return ClientOptions(daemon=daemons[stage])
    client = SnapshotClient(job, rank=stage, world_size=STAGES, options=options_of(stage))
    links = RelayLinks(os.path.join(args.workdir, args.run, "relay.sock"), stage)
    incarnation = "replacement" if args.replacement else "initial"
    # Each step logs its loader's record; it ends once that and the boundary tensors
    # it sent are held, before it is snapshotted or counted as finished.
    mode = LoggedSteps(client, loader.record, PeriodicSnapshots(
        client, args.snapshot_every,
        os.path.join(args.workdir, args.run, f"stage{stage}.{incarnation}.progress")))
    boundary_log = BoundaryLog(client, json.loads(args.logged), options_of)

    def make_runner(inbox, send, mode):
        return StageRunner(program, schedule, stage, STAGES, inbox, send, {"m": mode},
                           batch=loader.batch)

    def restore(step: int, alone: bool) -> int:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=x.sharding),
                                program.state)
        restored = client.restore(abstract, step=step, alone=alone)
        program.state = restored.state
        client.register(program.state)  # a replacement's daemon may not know it yet: it logs
        if args.replacement:  # a new process: the loader learns its place from the log
            loader.replay(client.read_log(step - 1))
        return restored.step

    sent = []

    def die_after_sends(key) -> None:
        if key[1] == args.die_in_step:
            sent.append(key)
            if len(sent) == args.fail_after_sends:
                die(f"SIGKILL stage {stage} in step {args.die_in_step} after it sent {sent}")

    process = StageProcess(stage, links, boundary_log, mode, make_runner, restore,
                           None if args.die_in_step is None else die_after_sends,
                           replay_workers)
    if not args.replacement:  # it logs from the first step on (a replacement after restoring)
        client.register(program.state)
    process.train(args.steps, replacement=args.replacement)
    training = process.runners[0]
    compute = sum(stop - start for label, start, stop in training.events if label in "FBU")
    report = {"digests": [checksum(jax.device_get(leaf).tobytes())
                          for leaf in jax.tree.leaves(program.state)],
              "recoveries": process.recoveries,
              "logged_bytes_by_boundary": boundary_log.bytes_by_boundary,
              "compute_seconds_per_step": compute / max(1, len(training.iterations)),
              "steps_trained": len(training.iterations)}
    if replay_workers is not None:
        replay_workers.close()
        report["replay_warm_up_seconds"] = replay_workers.warm_up_seconds
        report["replay_waited_for_warm_up_seconds"] = replay_workers.waited_for_warm_up
        report["replay_workers_by_step"] = replay_workers.workers_by_step
    with open(os.path.join(args.workdir, args.run, f"stage{stage}.{incarnation}.json"),
              "w") as f:
        json.dump(report, f)
    boundary_log.close()
    client.close()
    links.tell({"event": "done"})
    links.close()
    return 0


def run_pipeline(args, name: str, logged, group_of, fail: bool) -> dict:
    """Runs the stage processes of one stage-scope run to the end, recovering from a
    failure; returns each stage's final report and the coordinator's recoveries."""
    from bubblesnap.clients import ClientOptions, NumpyClient
    from pipeline.coordinator import Coordinator
    from pipeline.relay import Relay

    directory = os.path.join(args.workdir, name)
    os.makedirs(directory)
    relay = Relay(directory)
    procs: dict[int, list[subprocess.Popen]] = {}
    statuses = [NumpyClient(f"{JOB}-{name}", options=ClientOptions(daemon=address))
                for address in args.daemons]

    def start(stage: int, replacement: bool = False) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "stage", "--run", name,
               "--stage", str(stage), "--steps", str(args.steps), "--d-model", str(args.d_model),
               "--workdir", args.workdir, "--daemons", ",".join(args.daemons),
               "--logged", json.dumps(logged),
               "--snapshot-every", str(args.snapshot_every),
               "--replay-workers", str(args.replay_workers)]
        if fail and stage == args.fail_stage and not replacement:
            cmd += ["--die-in-step", str(args.fail_at),
                    "--fail-after-sends", str(args.fail_after_sends)]
        if replacement:
            log(f"{name}: starting a replacement for stage {stage}")
            cmd.append("--replacement")
        procs.setdefault(stage, []).append(subprocess.Popen(cmd))

    for stage in range(STAGES):
        start(stage)
    coordinator = Coordinator(relay, STAGES, group_of,
                              lambda: newest_step_held_for_every_stage(statuses),
                              lambda stage: start(stage, replacement=True))
    try:
        coordinator.run(args.timeout)
    finally:
        relay.close()
        for status in statuses:
            status.close()
        for stage_procs in procs.values():
            for proc in stage_procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    codes = {s: [p.returncode for p in ps] for s, ps in procs.items()}
    log(f"{name}: exit codes by stage {codes}")
    reports = {}
    for stage, stage_procs in procs.items():
        incarnation = "replacement" if len(stage_procs) > 1 else "initial"
        with open(os.path.join(directory, f"stage{stage}.{incarnation}.json")) as f:
            reports[stage] = json.load(f)
    return {"stages": reports, "recoveries": coordinator.recoveries, "exit_codes": codes}


def newest_step_held_for_every_stage(statuses) -> int:
    """The newest step of which every stage has a finished copy on some daemon (-1: none).

    Not the group's committed step (every stage with 1 + --replicas copies): the
    daemons learn that a second or so late, and a stage that replays alone
    needs only one copy. Every daemon keeps it and the boundary records after
    it: each frees only steps older than what it saw committed, which is never
    newer than this."""
    from bubblesnap.protos import daemon_pb2 as pb
    held: dict[int, set[int]] = {}
    for status in statuses:
        for step in status.status().steps:
            held.setdefault(step.step, set()).update(
                r.rank for r in step.ranks if r.state == pb.LOCAL)
    return max((step for step, ranks in held.items() if len(ranks) == STAGES), default=-1)


def finished_steps(args, name: str, stage: int, incarnation: str) -> list[int]:
    try:
        with open(os.path.join(args.workdir, name,
                               f"stage{stage}.{incarnation}.progress")) as f:
            return [int(line) for line in f]
    except FileNotFoundError:
        return []


def stage_scope_run(args) -> dict:
    from bubblesnap.clients import plan_log_groups, trade_off

    ring = start_daemons(count=STAGES)  # a host per stage
    args.daemons = ring.addresses
    everything = list(range(STAGES - 1))
    try:
        reference = cached_reference(
            args, "stage", lambda: run_pipeline(args, "reference", everything, None, fail=False))
        reference["stages"] = {int(s): r for s, r in reference["stages"].items()}
        steps = args.steps
        # The profile the plan is made from: measured in the reference run.
        boundary_bytes = [sum(r["logged_bytes_by_boundary"].get(str(b), 0)
                              for r in reference["stages"].values()) // steps
                          for b in range(STAGES - 1)]
        stage_seconds = [reference["stages"][s]["compute_seconds_per_step"]
                         for s in range(STAGES)]
        budget = sum(boundary_bytes) if args.log_budget is None else args.log_budget
        plan = plan_log_groups(boundary_bytes, stage_seconds, budget, MICROBATCHES)
        log(f"log plan for a budget of {budget} bytes per step: groups {plan.groups}, "
            f"logged boundaries {plan.logged_boundaries}")
        failing = run_pipeline(args, "failing", list(plan.logged_boundaries), plan.group_of,
                               fail=True)
    finally:
        ring.stop()
    if len(failing["recoveries"]) != 1:
        raise SystemExit(f"expected one recovery, saw {failing['recoveries']}")
    recovery = failing["recoveries"][0]
    failed = recovery["failed_stage"]
    replacement = failing["stages"][failed]
    replay = replacement["recoveries"][0]
    before = max([recovery["resumed_after"],
                  *finished_steps(args, "failing", failed, "initial")])
    return {"bitwise_equal": all(failing["stages"][s]["digests"] ==
                                 reference["stages"][s]["digests"] for s in range(STAGES)),
            "lost_steps": before - recovery["resumed_after"],
            "replayed_steps": recovery["replayed_steps"][failed],
            "restored_step": recovery["restored_step"],
            "stages_rolled_back": len(recovery["rolled_back"]),
            "rolled_back": recovery["rolled_back"],
            "replayed_steps_by_stage": recovery["replayed_steps"],
            "failed_stage": failed, "failed_at": args.fail_at,
            "resumed_after": recovery["resumed_after"],
            "survivors_finished": recovery["survivors_finished"],
            "fail_scope": "stage", "steps": steps,
            "log_budget_bytes_per_step": budget,
            "log_groups": [list(g) for g in plan.groups],
            "logged_boundaries": list(plan.logged_boundaries),
            "boundary_log_bytes_per_step": plan.log_bytes_per_step,
            "bytes_per_step_by_boundary": boundary_bytes,
            "stage_compute_seconds_per_step": stage_seconds,
            "recovery_seconds": recovery["recovery_seconds"],
            "replay_seconds": recovery["replay_seconds"],
            "replay_workers": args.replay_workers,
            "failed_stage_replay": {
                "seconds": replay["replay_seconds"], "restore_seconds": replay["restore_seconds"],
                "step_seconds": replay["replay_step_seconds"],
                "seconds_after_the_first_step": sum(replay["replay_step_seconds"][1:]),
                "steps_by_the_workers": replay["parallel_steps"],
                "workers_by_step": replacement.get("replay_workers_by_step"),
                "warm_up_seconds_by_device": replacement.get("replay_warm_up_seconds"),
                "waited_for_warm_up_seconds":
                    replacement.get("replay_waited_for_warm_up_seconds")},
            "trade_off": [{"groups": [list(g) for g in p.groups],
                           "log_bytes_per_step": p.log_bytes_per_step,
                           "expected_replay_seconds_per_step":
                               p.expected_replay_seconds_per_step}
                          for p in trade_off(boundary_bytes, stage_seconds, MICROBATCHES)]}


# -- the three runs -------------------------------------------------------------------------

def start_daemons(count: int = 2):
    """Daemons in a ring, --replicas 1, one per simulated host (a bubblesnap.testing.Ring)."""
    from bubblesnap.testing import Ring
    return Ring(count, "--replicas", "1", "--max-interval", "1", log_level="ERROR")


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


def cached_reference(args, scope: str, run_it):
    """The reference run's report: run now, or taken from --reference-cache, where an
    earlier run of the same scope, --steps and --d-model left it (it depends on nothing
    else: no failure, no snapshot), and left there for the next."""
    if args.reference_cache is None:
        return run_it()
    path = os.path.join(args.reference_cache, f"{scope}-{args.steps}-{args.d_model}.json")
    try:
        with open(path) as f:
            log(f"reference: {path}, from an earlier run")
            return json.load(f)
    except FileNotFoundError:
        pass
    report = run_it()
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    return report


def main_run(args) -> dict:
    ring = start_daemons()
    args.daemon = ring.addresses[0]  # the trainer's host; the other holds the replicas
    try:
        def reference_run() -> list:
            if run(args, "reference") != 0:
                raise SystemExit("the reference run failed")
            with open(os.path.join(args.workdir, "reference.digests.json")) as f:
                return json.load(f)
        with open(os.path.join(args.workdir, "reference.digests.json"), "w") as f:
            json.dump(cached_reference(args, "job", reference_run), f)
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
        ring.stop()
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
            "used_log": not args.without_log, "stages_rolled_back": STAGES}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="steps the job trains (default 16)")
    p.add_argument("--fail-at", type=int, default=9, help="step that fails (default 9)")
    p.add_argument("--fail-point", choices=["bubble", "after-commit"], default="bubble",
                   help="where the whole job fails (--fail-scope job)")
    p.add_argument("--fail-scope", choices=["job", "stage"], default="job",
                   help="job: every stage dies (SIGKILL of the training process); stage: "
                        "only --fail-stage dies and replays alone (default job)")
    p.add_argument("--fail-stage", type=int, default=1,
                   help="the stage that fails with --fail-scope stage (default 1)")
    p.add_argument("--fail-after-sends", type=int, default=2, metavar="N",
                   help="with --fail-scope stage, the stage dies in step --fail-at right "
                        "after it sent its N-th tensor of that step (default 2; a middle "
                        f"stage sends {2 * MICROBATCHES} a step, the first and last "
                        f"{MICROBATCHES})")
    p.add_argument("--log-budget", type=int, metavar="BYTES",
                   help="boundary-log bytes per step with --fail-scope stage; adjacent stages "
                        "are grouped until the log fits (default: log every boundary)")
    p.add_argument("--replay-workers", type=int, default=1, metavar="N",
                   help="with --fail-scope stage, the failed stage's replacement replays "
                        "each lost step whose inputs are all logged with N workers, each on "
                        f"its own CPU device, taking a share of the {MICROBATCHES} "
                        "microbatches (default 1: the replacement alone)")
    p.add_argument("--snapshot-every", type=int, default=4,
                   help="with --fail-scope stage, each stage snapshots every N steps "
                        "(default 4)")
    p.add_argument("--fail-during-replay", type=int, default=0, metavar="N",
                   help="also kill the resumed run after it replayed N steps")
    p.add_argument("--without-log", action="store_true",
                   help="resume from the snapshot alone, ignoring the training log (to see "
                        "what the log is for: the loader starts over and the run diverges)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--reference-cache", metavar="DIR",
                   help="reuse the reference run an earlier run with the same --steps, "
                        "--d-model and scope left in DIR (and leave it there): runs that only "
                        "fail differently share it (the tests do)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--role", choices=["main", "train", "stage"], default="main",
                   help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--logged", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--die-in-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--daemon", help=argparse.SUPPRESS)
    p.add_argument("--daemons", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--die-after-replaying", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "main" and not 4 <= args.fail_at < args.steps - 1:
        p.error("--fail-at must be between 4 (snapshots start after a few warm-up steps) "
                "and --steps - 2")
    if args.role == "main" and args.fail_scope == "stage":
        if not 0 <= args.fail_stage < STAGES:
            p.error(f"--fail-stage must be a stage, 0 to {STAGES - 1}")
        if not 1 <= args.snapshot_every <= args.fail_at:
            p.error("--snapshot-every must be between 1 and --fail-at: the failed stage "
                    "restores a snapshot taken before it failed")
        if args.fail_during_replay or args.without_log:
            p.error("--fail-during-replay and --without-log go with --fail-scope job")
        sends = MICROBATCHES if args.fail_stage in (0, STAGES - 1) else 2 * MICROBATCHES
        if not 1 <= args.fail_after_sends <= sends:
            p.error(f"stage {args.fail_stage} sends {sends} tensors a step: "
                    f"--fail-after-sends must be between 1 and {sends}")
        if args.log_budget is not None and args.log_budget < 0:
            p.error("--log-budget must not be negative")
        if not 1 <= args.replay_workers <= MICROBATCHES:
            p.error(f"--replay-workers must be between 1 and {MICROBATCHES} (a worker takes "
                    "at least one microbatch of a step)")
    return args


def main() -> int:
    args = parse_args()
    if args.role == "train":
        return train_main(args)
    if args.role == "stage":
        return stage_main(args)
    with tempfile.TemporaryDirectory(prefix="bubblesnap-lossless-") as workdir:
        args.workdir = workdir
        report = stage_scope_run(args) if args.fail_scope == "stage" else main_run(args)
    print(json.dumps(report), flush=True)
    return 0 if report["bitwise_equal"] and report["lost_steps"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
