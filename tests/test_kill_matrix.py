"""The kill matrix: SIGKILL a trainer, a daemon, both, or a peer of a ring at random moments.

Every trial ends with a restore that must give back, bit for bit, a step the
trainers were told was committed, or a newer one: never a torn tensor, never
tensors of two steps, and never nothing (or an older step) while a copy of a
committed step survives, on its daemon's shared memory or at a peer. A
killed daemon is restarted on the same --shm-dir (and the same socket and ports) and
adopts what its predecessor committed. Real processes throughout: daemons
(``bubblesnap daemon``) and trainers (tests/programs/numpy_trainer.py).

``BUBBLESNAP_KILL_TRIALS`` sets the trials per variant (default 10; e.g. 200
for a long run); each variant prints its counts.
"""

import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from bubblesnap.clients import ClientOptions, NumpyClient, RestoreError
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import DaemonProcess, free_port, wait_for
from tests.programs.numpy_trainer import steps_of

TRIALS = int(os.environ.get("BUBBLESNAP_KILL_TRIALS", "10"))
ROWS = 512  # 640 KiB a step: a kill lands in a copy, a hash or a commit as often as between


@dataclasses.dataclass
class Tally:
    """What the trials of one variant restored."""

    variant: str
    trials: int = 0
    restored: int = 0  # a committed step or newer, bit for bit
    torn: int = 0      # a tensor of no step, or tensors (or ranks) of several steps
    lost: int = 0      # nothing, or a step older than the newest reported committed
    problems: list = dataclasses.field(default_factory=list)

    def judge(self, committed: int, restored: list[tuple[int, int, dict] | str],
              adopted: tuple[int, int] | None = None) -> None:
        """One trial: ``restored`` holds (rank, step, arrays) per rank, or why it failed.
        ``adopted``: the newest step the restarted daemon adopted, and the newest step
        reported committed when it was killed: a loss the restore would not show (live
        trainers, or peers, hold newer or other copies)."""
        self.trials += 1
        if adopted is not None and adopted[0] < adopted[1]:
            self.lost += 1
            self.problems.append(f"trial {self.trials}: adopted step {adopted[0]}, but "
                                 f"{adopted[1]} was committed when the daemon was killed")
            return
        failed = [r for r in restored if isinstance(r, str)]
        if failed:
            self.lost += 1
            self.problems.append(f"trial {self.trials}: committed {committed}, {failed}")
            return
        steps = {step for _, step, _ in restored}
        whole = all(set(steps_of(arrays, rank, ROWS).values()) == {step}
                    for rank, step, arrays in restored)
        if not whole or len(steps) != 1:
            self.torn += 1
            self.problems.append(f"trial {self.trials}: torn or mixed: "
                                 f"{[step for _, step, _ in restored]}")
        elif steps.pop() < committed:
            self.lost += 1
            self.problems.append(f"trial {self.trials}: restored {restored[0][1]} < committed "
                                 f"{committed}")
        else:
            self.restored += 1

    def check(self) -> None:
        print(f"\nkill matrix {self.variant}: {self.trials} trials, {self.restored} restored a "
              f"committed step or newer, {self.torn} torn or mixed, {self.lost} lost")
        assert (self.restored, self.torn, self.lost) == (self.trials, 0, 0), self.problems


class Trainer:
    """A numpy_trainer process; its events are collected on a thread as they are printed."""

    def __init__(self, log, address: str, *flags: str):
        """``log``: where its stderr goes (it warns of every snapshot a dead daemon missed)."""
        with open(log, "a") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.programs.numpy_trainer", "--daemon", address,
                 "--rows", str(ROWS), *flags], stdout=subprocess.PIPE, stderr=stderr, text=True)
        self._events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._events.append(json.loads(line))

    def committed(self) -> list[int]:
        """The steps it was told were committed, in order."""
        return [e["step"] for e in list(self._events) if e.get("committed")]

    def wait_committed(self, count: int, timeout: float = 60) -> None:
        wait_for(lambda: len(self.committed()) >= count, f"{count} committed snapshots",
                 timeout, failed=lambda: self.proc.poll() is not None and
                 f"the trainer exited with {self.proc.returncode}: {self._events[-3:]}")

    def kill(self) -> None:
        """SIGKILL; then every line it printed before it died has been read."""
        self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=10)


def _restore(address: str, job: str, rank: int, world: int, attempts: int = 5):
    """(rank, step, arrays) of a restore through ``address``, or why it failed. A live
    trainer's retention may free the chosen step meanwhile: asked again then."""
    client = NumpyClient(job, rank, world, ClientOptions(daemon=address))
    try:
        for attempt in range(attempts):
            try:
                step, arrays = client.restore()
                return rank, step, arrays
            except RestoreError as err:
                if attempt == attempts - 1:
                    return f"rank {rank}: {err}"
                time.sleep(0.2)
    finally:
        client.close()


def _adopted(daemon: DaemonProcess, job: str) -> int:
    """The newest step of ``job`` the daemon adopted when it started (-1: none)."""
    adoption = daemon.stub.Status(pb.StatusRequest(), timeout=10).adoption
    return max((c.step for c in adoption.adopted if c.job == job), default=-1)


@pytest.fixture
def trainer(tmp_path):
    """Starts a Trainer (its stderr in the test's tmp_path)."""
    def start(address: str, *flags: str) -> Trainer:
        return Trainer(tmp_path / "trainers.log", address, *flags)
    return start


@pytest.fixture
def host(tmp_path):
    """Starts a daemon on a given shm dir and the trainer socket of host ``name`` (a restart
    reuses both; a Unix socket, the trainers' default, so a trainer may roll back without
    a token); every daemon started is stopped after the test."""
    started = []

    def start(shm: str, name: str, *flags: str) -> DaemonProcess:
        log = tmp_path / f"daemon-{len(started)}.log"
        started.append(DaemonProcess("--shm-dir", shm, "--listen",
                                     f"unix:{tmp_path}/{name}.sock",
                                     "--keep", "2", *flags, own_shm_dir=False, stderr=log,
                                     log_level="INFO", name=f"daemon ({log})"))
        return started[-1]
    yield start
    for daemon in started:
        daemon.stop()


def test_kill_the_trainer(shm_dirs, host, trainer):
    rng, tally = random.Random(101), Tally("trainer")
    daemon, committed = host(shm_dirs(), "host"), -1
    for _ in range(TRIALS):
        run = trainer(daemon.address, "--job", "t", *(["--resume"] * (committed >= 0)))
        run.wait_committed(rng.randint(1, 6))
        time.sleep(rng.uniform(0, 0.02))
        run.kill()
        committed = max([committed, *run.committed()])
        tally.judge(committed, [_restore(daemon.address, "t", 0, 1)])
    tally.check()


def test_kill_the_daemon_while_its_trainer_runs_on(shm_dirs, host, trainer):
    """The trainer outlives every daemon restart and reattaches to the adopted copies."""
    rng, tally = random.Random(202), Tally("daemon")
    shm = shm_dirs()
    daemon = host(shm, "host")
    run = trainer(daemon.address, "--job", "d")
    try:
        for _ in range(TRIALS):
            run.wait_committed(len(run.committed()) + rng.randint(1, 6))
            time.sleep(rng.uniform(0, 0.02))
            daemon.kill()
            time.sleep(rng.uniform(0.01, 0.3))  # the trainer snapshots into the void meanwhile
            committed = max(run.committed())  # each one the dead daemon answered
            daemon = host(shm, "host")
            tally.judge(committed, [_restore(daemon.address, "d", 0, 1)],
                        adopted=(_adopted(daemon, "d"), committed))
        run.wait_committed(len(run.committed()) + 3)  # it snapshots on
    finally:
        run.kill()
    tally.check()


def test_kill_the_trainer_and_its_daemon(shm_dirs, host, trainer):
    """Both die, in either order; the restarted daemon restores before anyone registers."""
    rng, tally = random.Random(303), Tally("both")
    shm, committed = shm_dirs(), -1
    daemon = host(shm, "host")
    for _ in range(TRIALS):
        run = trainer(daemon.address, "--job", "b", *(["--resume"] * (committed >= 0)))
        run.wait_committed(rng.randint(1, 6))
        time.sleep(rng.uniform(0, 0.02))
        first, second = rng.sample([run.kill, daemon.kill], 2)
        first()
        time.sleep(rng.uniform(0, 0.02))
        second()
        committed = max([committed, *run.committed()])
        daemon = host(shm, "host")
        tally.judge(committed, [_restore(daemon.address, "b", 0, 1)])
    tally.check()


def test_kill_a_peer_of_a_ring(shm_dirs, host, trainer):
    """A ring of 3 (--replicas 1), a job of 2 ranks on daemons 0 and 1; any daemon dies
    and comes back on its shared memory, then the job is restarted from it."""
    rng, tally = random.Random(404), Tally("peer")
    shms = [shm_dirs() for _ in range(3)]
    peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))

    def start(i: int) -> DaemonProcess:
        return host(shms[i], f"host{i}", "--peers", peers, "--index", str(i), "--replicas", "1")

    daemons, committed = [start(i) for i in range(3)], -1
    for _ in range(TRIALS):
        trainers = [trainer(daemons[r].address, "--job", "p", "--rank", str(r), "--world-size",
                            "2", "--wait", "job", *(["--resume"] * (committed >= 0)))
                    for r in range(2)]
        trainers[rng.randrange(2)].wait_committed(rng.randint(1, 3))
        time.sleep(rng.uniform(0, 0.05))
        victim = rng.randrange(3)
        # Every daemon holds a copy of each committed step (its rank's, or a replica).
        held = max([-1, *(s for t in trainers for s in t.committed())])
        daemons[victim].kill()
        time.sleep(rng.uniform(0, 0.3))
        for run in trainers:
            run.kill()
        committed = max([committed, *(s for t in trainers for s in t.committed())])
        daemons[victim] = start(victim)
        adopted = _adopted(daemons[victim], "p")
        tally.judge(committed, [_restore(daemons[r].address, "p", r, 2) for r in range(2)],
                    adopted=(adopted, held))
    tally.check()
