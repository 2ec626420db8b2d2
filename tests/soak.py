"""make soak: the save path struck anywhere, for as long as asked; every resume judged.

    python -m tests.soak                           # 30 minutes from seed 1
    python -m tests.soak --minutes 5 --seed 40
    python -m tests.soak --seed 57 --rounds 1      # replays the round of seed 57
    python -m tests.soak --quick                   # one round of two kinds (the suite's)

Rounds, one after another, each with a seed of its own (a soak from seed S runs S, S+1,
...: a failing round replays alone with ``--seed`` its seed ``--rounds 1``). A *loop
round* runs a 2-process ``jax.distributed`` job (tests/programs/soak_loop.py: Orbax's
CheckpointManager loop or the v1 Checkpointer loop, the import swapped, its folder inside
the daemons' durable tier, so the daemons write its steps) against a cluster lab of 2
hosts (network namespaces, a daemon each, in a ring), strikes once at a seeded point,
resumes the job and judges the resume. A *pipeline round* runs examples/failover.py (3
stages, a host or two adjacent ones SIGKILLed, a replacement daemon with an empty
memory) with seeded flags and judges its stages' restores the same way.

Judged by bubblesnap.testing.history on what the job was told and what the tier held at
the strike: every rank of a resume restored the same step, a step that was committed
(every process's ``save`` returned, or Orbax's folder lists it), bit for bit the state
saved at that step, and no older than the newest step the fault keeps: the committed one
when a trainer dies or a process is frozen, the one on disk when a daemon's memory is
lost. A save in flight when its trainer died must be finished or dropped within a minute
by the primary's daemon, if its part reached it, else by the resumed manager before it
restores. The last line is the summary: rounds, resumes, faults
struck by kind, disagreements, lost committed steps, torn restores, failed rounds.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import checkpoint_record, save_in_flight
from bubblesnap.testing import Cluster, reaped_tempdir, wait_for
from bubblesnap.testing.history import History, violations
from bubblesnap.testing.multihost import JaxJob, JobError
from tests.helpers import ROOT

PROGRAM = str(ROOT / "tests" / "programs" / "soak_loop.py") + ":run"
PROCESSES = 2
#: A job's processes give up after this long (a hang is a failed round, not a stall).
_JOB_TIMEOUT = 240.0
#: How long the primary's daemon has to finish or drop a save its trainer left in flight.
_SETTLE_SECONDS = 60.0
#: The suffix of a step's (and an item's) folder while Orbax saves it.
_TMP = ".orbax-checkpoint-tmp"

#: The faults a loop round strikes with: (name, what a resume after it may not lose).
LOOP_FAULTS = (
    ("trainer killed inside save", "committed"),
    ("trainer killed right after save", "committed"),
    ("trainer killed while training", "committed"),
    ("resume killed inside its restore", "committed"),
    ("trainer frozen", "committed"),
    ("daemon frozen", "committed"),
    ("daemon killed, replaced empty", "durable"),
    ("host killed, daemon replaced empty", "durable"),
)
PIPELINE = "pipeline host killed, replaced empty"


class RoundFailed(RuntimeError):
    """A round could not go on (a job hung or failed, a save stayed in flight)."""


class LoopRound:
    """One loop round: a job, one strike, the resumes after it, their judgement."""

    def __init__(self, cluster: Cluster, tier: str, seed: int, fault: str | None = None):
        self.rng = random.Random(seed)
        self.seed, self.cluster = seed, cluster
        self.loop = self.rng.choice(("v0", "v1"))
        drawn = self.rng.choice(LOOP_FAULTS)[0]  # drawn even when named: the same seed,
        self.fault = fault or drawn                  # the same draws after it
        self.keeps = dict(LOOP_FAULTS)[self.fault]
        self.directory = os.path.join(tier, f"round{seed}")
        self.history = History()
        self.digests: dict[int, str] = {}  # step -> the state saved at it (every process)
        self.saved: dict[int, set[int]] = {}  # step -> the processes whose save returned
        self.resumes = 0
        self.problems: list[str] = []  # what the history does not judge

    def run(self) -> list[str]:
        """Strikes, resumes, judges: the contract's violations (none: it held)."""
        self._strike(self._start())
        resumed = self._start()
        if self.fault == "resume killed inside its restore":
            self._pump(resumed, lambda i, e: e["event"] == "restoring")
            time.sleep(self.rng.uniform(0, 0.1))
            self._trainers_died(resumed, self.fault)
            resumed = self._start()
        self._judge_resume(resumed)
        return violations(self.history) + self.problems

    def told(self) -> str:
        """What the round's resumes restored, against the newest step held at the fault."""
        held = max((c.step for c in self.history.commits), default=None)
        restored = sorted({(r.resume, r.step) for r in self.history.rank_restores})
        return f"held {held}, restored {', '.join(str(s) for _, s in restored) or 'nothing'}"

    def close(self, keep_folder: bool = False) -> None:
        """Forgets the round's job in every daemon and removes its folder (unless
        ``keep_folder``: a failed round's, for its cause)."""
        for daemon in self.cluster.daemons:
            for item in ("state", "meta"):
                try:
                    daemon.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(
                        job=f"{self.directory}/{item}"), timeout=30)
                except grpc.RpcError:
                    pass  # not held there
        if not keep_folder:
            shutil.rmtree(self.directory, ignore_errors=True)

    # -- the job --------------------------------------------------------------------------

    def _start(self) -> JaxJob:
        name = f"{self.seed}.{self.resumes}"
        self.resumes += 1
        return JaxJob(PROGRAM, PROCESSES, {
            "loop": self.loop, "directory": self.directory, "resume": name,
            "daemons": [d.address for d in self.cluster.daemons]}, timeout=_JOB_TIMEOUT)

    def _pump(self, job: JaxJob, until) -> tuple[int, dict]:
        """Records the job's events until one ``until(process, fields)`` accepts."""
        try:
            return job.watch(until, seen=self._record)
        except JobError as err:
            raise RoundFailed(str(err)) from None

    def _drain(self, job: JaxJob) -> None:
        """Kills the job; what it printed before is recorded."""
        job.kill()
        for got in job.events():
            self._record(*got)

    def _record(self, process: int, fields: dict) -> None:
        kind, step = fields.get("event"), fields.get("step")
        if kind == "saving":
            self.digests[step] = fields["digest"]
        elif kind == "saved":
            self.saved.setdefault(step, set()).add(process)
        elif kind == "restored":
            self.history.rank_restored(self.directory, fields["resume"], process, step,
                                       fields["digest"])

    def _saved_by_all(self, job: JaxJob, step: int) -> int:
        """Waits until every process's save of a step >= ``step`` returned; that step."""
        def done(_, e) -> bool:
            return e["event"] == "saved" and e["step"] >= step and \
                len(self.saved.get(e["step"], ())) == PROCESSES
        return self._pump(job, done)[1]["step"]

    # -- the strike -----------------------------------------------------------------------

    def _strike(self, job: JaxJob) -> None:
        """Strikes the running job once, where the round's seed says, and records the
        fault with what was held when it struck; returns once the job is dead."""
        rng, fault, host = self.rng, self.fault, self.rng.randrange(PROCESSES)
        target = rng.randrange(4, 13, 2)
        if fault == "trainer killed inside save":
            self._pump(job, lambda i, e: e["event"] == "saving" and e["step"] >= target
                       and i == host)
            time.sleep(rng.uniform(0, 0.05))
            return self._trainers_died(job, f"{fault} (process {host})")
        step = self._saved_by_all(job, target)
        if fault == "trainer killed while training":
            time.sleep(rng.uniform(0, 0.5))
        elif fault == "trainer frozen":
            os.kill(job.procs[host].pid, signal.SIGSTOP)
            time.sleep(rng.uniform(1, 3))
            os.kill(job.procs[host].pid, signal.SIGCONT)
            self._saved_by_all(job, step + 4)
        elif fault == "daemon frozen":
            self.cluster.freeze(host)
            time.sleep(rng.uniform(2, 6))
            self.cluster.thaw(host)
            self._saved_by_all(job, step + 4)
        elif fault in ("daemon killed, replaced empty", "host killed, daemon replaced empty"):
            time.sleep(rng.uniform(0, 0.3))
            at = time.monotonic()
            if fault.startswith("host"):
                job.procs[host].kill()
            self.cluster.kill(host, wipe_memory=True)
            self._drain(job)  # the scheduler stops the rest of the job
            self._record_held(at)
            self.history.fault(f"{fault} (host {host})", self.keeps, at=at)
            self.cluster.restart(host)
            return None
        if fault == "resume killed inside its restore":  # its first strike: a plain kill
            return self._trainers_died(job, "trainer killed right after save")
        return self._trainers_died(job, fault)

    def _trainers_died(self, job: JaxJob, what: str) -> None:
        """Kills every process of the job (its daemons live). A save left in flight that
        the primary's daemon took (its part answered: it watches the save) is finished or
        dropped by it; one it never heard of waits for the resumed manager (checked
        then). The fault is recorded with what was held at the kill."""
        at = time.monotonic()
        self._drain(job)
        if self._in_flight(primary_took=True):
            try:
                wait_for(lambda: not self._in_flight(),
                         "the primary's daemon to finish or drop the save left in flight",
                         timeout=_SETTLE_SECONDS)
            except TimeoutError as err:
                raise RoundFailed(f"{err}: steps {self._in_flight()}") from None
        self._record_held(at)
        self.history.fault(what, "committed", at=at)

    def _in_flight(self, primary_took: bool = False) -> list[int]:
        """The steps whose save is still in flight (its record there); ``primary_took``:
        those whose primary process's part some daemon began writing or answered."""
        pending = os.path.join(self.directory, save_in_flight.FOLDER)
        steps = sorted(int(n) for n in _listing(pending) if n.isdigit())
        if not primary_took:
            return steps
        return [s for s in steps if any(
            n.startswith("rank_0.") for item in _listing(os.path.join(
                self.directory, f"{s}{_TMP}")) for n in _listing(os.path.join(
                    self.directory, f"{s}{_TMP}", item, checkpoint_record.STATE_DIR)))]

    def _record_held(self, at: float) -> None:
        """The steps committed before ``at`` (every process's save returned, or the folder
        lists the step finalized, by Orbax or by a daemon after the trainer's death) and
        those on disk, recorded just before ``at``."""
        on_disk = finalized_steps(self.directory)
        before = at - 1e-6
        for step in sorted({s for s, p in self.saved.items() if len(p) == PROCESSES}
                           | set(on_disk)):
            if step in self.digests:
                self.history.committed(self.directory, step,
                                       dict.fromkeys(range(PROCESSES), self.digests[step]),
                                       at=before)
        for step in on_disk:
            self.history.durable(self.directory, step, at=before)

    # -- the resume -----------------------------------------------------------------------

    def _judge_resume(self, job: JaxJob) -> None:
        """Every process restores (one that starts afresh while steps were held is recorded
        as restoring step -1: a loss), then the resumed run saves a step of its own."""
        started: set[int] = set()
        while len(started) < PROCESSES:
            process, fields = self._pump(job, lambda i, e: e["event"] in ("restored",
                                                                           "saving"))
            if fields["event"] == "saving" and process not in started:
                self.history.rank_restored(self.directory, f"{self.seed}.{self.resumes - 1}",
                                           process, -1, "")
            started.add(process)
        restored = max((r.step for r in self.history.rank_restores), default=-1)
        left = [s for s in self._in_flight() if s <= restored]
        if left:  # the resumed manager resolves every save of the run it resumes first
            self.problems.append(f"{self.directory}: the resume restored step {restored} "
                                 f"and left the saves of steps {left} in flight")
        self._saved_by_all(job, 0)
        self._drain(job)


def _listing(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def finalized_steps(directory: str) -> list[int]:
    """The steps Orbax's folder lists (finalized: a folder named by the step alone)."""
    return sorted(int(n) for n in _listing(directory) if n.isdigit())


def pipeline_round(seed: int) -> tuple[str, list[str], str]:
    """examples/failover.py with seeded flags, its stages' restores judged."""
    rng = random.Random(seed)
    adjacent = rng.choice((1, 2))
    flags = ["--kill-after", str(rng.randrange(4, 13)),
             "--steps-past-commit", str(rng.randrange(0, 4)),
             "--kill-adjacent", str(adjacent), "--replicas", "1"]
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "failover.py"), *flags],
                              capture_output=True, text=True, timeout=_JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RoundFailed(f"examples/failover.py {' '.join(flags)} ran past "
                          f"{_JOB_TIMEOUT:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if proc.returncode != 0 or "stages" not in report:
        raise RoundFailed(f"examples/failover.py {' '.join(flags)} exited {proc.returncode}: "
                          f"{proc.stderr[-3000:]}")
    history, job, at = History(), "pipeline", time.monotonic()
    stages = range(len(report["stages"]))
    # the steps the daemons held committed at the kill: the newest (before the kill and
    # as the survivors saw it after), those the survivors held of stage 1 (each a
    # committed step's copy) and the whole steps on the durable tier
    for step in {report["committed_at_kill"], report["committed_after_kill"],
                 *report["stage1_steps_on_survivors"], *report["durable_at_kill"]}:
        history.committed(job, step, dict.fromkeys(stages, "snapshot"), at=at - 2e-6)
    history.durable(job, report["safe_at_kill"], at=at - 2e-6)
    history.fault(f"{PIPELINE} ({' '.join(flags)})",
                  "committed" if adjacent == 1 else "durable", at=at - 1e-6)
    for stage in report["stages"]:
        history.rank_restored(job, "resume", stage["stage"], stage["step"],
                              "snapshot" if stage["matches"] else "other")
    return (f"{PIPELINE} ({adjacent} host{'s' if adjacent > 1 else ''})", violations(history),
            f"held {report['committed_at_kill']}, restored {report['restored_step']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    tally, failures, resumes = Counter(), [], 0
    work = args.keep or reaped_tempdir("bubblesnap-soak-")
    tier = os.path.join(work, "tier")
    os.makedirs(tier, exist_ok=True)
    deadline = time.monotonic() + args.minutes * 60
    plan = [(args.seed, "trainer killed right after save"),
            (args.seed + 1, "host killed, daemon replaced empty")] if args.quick else None
    with Cluster(PROCESSES, "--durable-dir", tier, directory=os.path.join(work, "lab")) as lab:
        seed = args.seed
        while True:
            if plan is not None:
                if not plan:
                    break
                seed, fault = plan.pop(0)
            else:
                if (args.rounds and seed - args.seed >= args.rounds) or \
                        (not args.rounds and time.monotonic() > deadline):
                    break
                fault = None
            started, detail = time.monotonic(), ""
            found = ["the round broke off"]
            pipeline = plan is None and random.Random(seed).random() < args.pipeline_share
            round_ = None if pipeline else LoopRound(lab, tier, seed, fault)
            kind = PIPELINE if pipeline else f"{round_.fault} ({round_.loop})"
            try:
                if pipeline:
                    kind, found, detail = pipeline_round(seed)
                    resumes += 1
                else:
                    try:
                        found = round_.run()
                        detail = round_.told()
                    finally:
                        resumes += round_.resumes - 1
                        round_.close(keep_folder=bool(found))
            except RoundFailed as err:
                found = [f"the round could not go on: {err}"]
            tally[kind] += 1
            verdict = "ok" if not found else "VIOLATED"
            print(f"[soak] seed {seed}: {kind}: {verdict} in {time.monotonic() - started:.0f} s"
                  f"{'; ' + detail if detail else ''}", file=sys.stderr, flush=True)
            for line in found:
                print(f"[soak]   {line}", file=sys.stderr, flush=True)
                failures.append((seed, line))
            seed += 1
    summary = {
        "rounds": sum(tally.values()), "resumes": resumes, "faults": dict(sorted(tally.items())),
        "disagreements": sum("mixed restore" in line for _, line in failures),
        "lost_committed_steps": sum("older than step" in line or "restored step -1" in line
                                    for _, line in failures),
        "torn_restores": sum("not those committed" in line for _, line in failures),
        "failed_rounds": sum("could not go on" in line for _, line in failures),
        "violations": len(failures),
        "replay": sorted({f"python -m tests.soak --seed {s} --rounds 1 --keep /tmp/soak-{s}"
                      for s, _ in failures}),
    }
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0,
                   help="run rounds for this long (default 30); --rounds overrides it")
    p.add_argument("--rounds", type=int, default=0,
                   help="run this many rounds instead, seeds --seed, --seed + 1, ...")
    p.add_argument("--seed", type=int, default=1, help="the first round's seed (default 1)")
    p.add_argument("--pipeline-share", type=float, default=0.2,
                   help="the share of rounds that run the pipeline example (default 0.2)")
    p.add_argument("--keep", metavar="DIR",
                   help="work in DIR and keep it: the daemons' logs (lab/host<i>.log) and a "
                        "failed round's folder (default: a temporary folder, removed)")
    p.add_argument("--quick", action="store_true",
                   help="two loop rounds (a trainer killed right after save, a host killed "
                        "and its daemon replaced empty), as the suite runs it")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
