"""Stage-local recovery (Swift), a stage's side: one stage fails, only its log group rolls back.

Stage processes train through the relay (relay.py). Each logs, every step,
its data loader's record to its daemon (the training log, through
bubblesnap.clients.LoggedSteps) and the tensors it sends across a logged
boundary (bubblesnap.clients.BoundaryLog, one stream per kind and
microbatch), and snapshots its state every few steps. When a stage fails:

  1. waits for its tensors raise NeighbourLost; each survivor tells the
     coordinator the last step it finished and stops. The coordinator
     silences every stage that stopped, so a stage waiting on one of those
     stops too, and no stage stops while a tensor it waits for can come;
  2. the coordinator picks M, the newest step a survivor finished, and who
     replays: the failed stage's log group (a replacement process and any
     other stage of the group) restores the newest snapshot and replays up
     to M; a survivor that had not finished M replays that one step from its
     own memory; the rest keep their state and wait;
  3. a replaying stage takes a tensor live from a neighbour that replays the
     same step, and otherwise from that neighbour's boundary log, waiting for
     records still on their way; a step whose inputs all come from logs may
     be replayed by several workers, each taking a share of its microbatches
     (parallel_replay.py);
  4. everybody goes on from M + 1.

Why at most one step behind: within a step every stage needs its
neighbours' tensors, so no survivor finishes a step after one the failed
stage could not have fed. Replays are bit for bit: the same state, inputs
and batch give the same outputs, so a replayed stage's tensors are the ones
its neighbours already consumed.
"""

import time

import numpy as np

from bubblesnap.clients import BoundaryLog, NoSnapshots, PipelineHooks
from pipeline.coordinator import Recovery
from pipeline.transport import NeighbourLost


class PeriodicSnapshots(NoSnapshots):
    """Snapshots every ``snapshot_every`` steps (waiting for the commit) and appends
    every finished step to ``progress`` (a file, which outlives a killed process).

    A training step wraps it in LoggedSteps: the step's records are held
    before it is snapshotted or counted as finished."""

    def __init__(self, client, snapshot_every: int, progress: str):
        self.client, self.every, self._progress = client, snapshot_every, progress

    def end_iteration(self, iteration: int, state) -> None:
        if self.every and iteration % self.every == self.every - 1:
            self.client.snapshot(iteration, state, wait=True)
        with open(self._progress, "a") as f:
            f.write(f"{iteration}\n")


class ReplayInbox:
    """A replaying stage's inputs: live from a neighbour that replays the same step,
    otherwise from the neighbour's boundary log."""

    def __init__(self, stage: int, inbox, boundary_log: BoundaryLog,
                 replaying: dict[int, int]):
        self._stage, self._inbox, self._log, self._replaying = stage, inbox, boundary_log, \
            replaying

    def live(self, stage: int, step: int) -> bool:
        return self._replaying.get(stage, step + 1) <= step

    def has(self, key) -> bool:
        return self._inbox.has(key)

    def take(self, key, sender: int):
        if self.live(sender, key[1]):
            return self._inbox.take(key, sender)
        return self._log.read(sender, self._stage, key), time.perf_counter()


class StageProcess:
    """One stage's training, surviving neighbours' failures (see the module docstring).

    ``make_runner(inbox, send, mode)`` builds a StageRunner on the stage's
    program; ``restore(step, alone)`` replaces the program's state with a snapshot
    (``alone``: other stages keep theirs, see Recovery). ``workers``
    (parallel_replay.ReplayWorkers, or None: the stage's runner alone) replay
    the steps whose inputs all come from boundary logs.
    """

    def __init__(self, stage: int, links, boundary_log: BoundaryLog, mode: PipelineHooks,
                 make_runner, restore, die=None, workers=None):
        self.stage, self.links, self.log, self.mode = stage, links, boundary_log, mode
        self._make_runner, self._restore, self._die = make_runner, restore, die
        self._workers = workers
        self.completed = -1
        self.recoveries: list[dict] = []
        self.runners: list = []  # the training runners (one per start), for their timings

    def train(self, steps: int, replacement: bool = False) -> None:
        first = 0
        if replacement:
            first = self._recover(self._wait_for("recover")) + 1
        else:  # a tensor sent before its receiver joined the relay would be lost
            self._wait_for("go")
        while first < steps:
            runner = self._make_runner(self.links.inbox, self._send, self.mode)
            self.runners.append(runner)
            try:
                runner.run(["m"] * (steps - first), first_iteration=first,
                           after_iteration=self._finished)
                return
            except NeighbourLost as lost:
                self.log.client.wait_log()  # what this stage sent may be replayed from
                self.links.tell({"event": "aborted", "completed": self.completed,
                                 "why": str(lost)})
                first = self._recover(self._wait_for("recover")) + 1

    def _finished(self, iteration: int, state) -> None:
        self.completed = iteration

    def _send(self, to: int, key, value, live: bool = True) -> None:
        """Logs a tensor crossing a logged boundary, then sends it if ``live``."""
        value = np.asarray(value)
        if self.log.logged(self.stage, to):
            self.log.write(min(self.stage, to), key, value)
        if live:
            self.links.send(to, key, value)
        if self._die is not None:
            self._die(key)

    def _recover(self, message: dict) -> int:
        plan = Recovery.from_message(message)
        started = time.perf_counter()
        first = plan.replaying.get(self.stage)
        restored, restore_seconds, step_seconds, parallel_steps = None, 0.0, [], 0
        if first is not None:
            if self.stage in plan.rolled_back:
                restored = self._restore(plan.restore_step, plan.alone)
                restore_seconds = time.perf_counter() - started
            inbox = ReplayInbox(self.stage, self.links.inbox, self.log, plan.replaying)

            def send(to: int, key, value) -> None:
                self._send(to, key, value, live=inbox.live(to, key[1]))

            for step in range(first, plan.after + 1):
                step_started = time.perf_counter()
                parallel_steps += self._replay(step, inbox, send)
                step_seconds.append(time.perf_counter() - step_started)
            self.log.client.wait_log()
            self.completed = plan.after
        report = {"after": plan.after, "restored_step": restored,
                  "replayed_steps": 0 if first is None else plan.after - first + 1,
                  "replay_seconds": time.perf_counter() - started,
                  "restore_seconds": restore_seconds,
                  "replay_step_seconds": step_seconds, "parallel_steps": parallel_steps}
        self.recoveries.append(report)
        self.links.tell({"event": "ready", **report})
        self._wait_for("go")
        return plan.after

    def _replay(self, step: int, inbox: ReplayInbox, send) -> bool:
        """One step; True when the replay workers did it. They do when every input is in a
        log: with a neighbour replaying the same step live, the microbatches wait on each
        other's tensors in the schedule's order, so the stage's own runner replays it."""
        if self._workers is not None and not (inbox.live(self.stage - 1, step) or
                                              inbox.live(self.stage + 1, step)):
            self._workers.replay(step, inbox.take, send)
            return True
        self._make_runner(inbox, send, NoSnapshots()).run(["m"], first_iteration=step)
        return False

    def _wait_for(self, event: str) -> dict:
        while True:
            message = self.links.control.get()
            if message["event"] == event:
                return message
            if message["event"] == "relay-gone":
                raise SystemExit("the relay is gone: the supervisor stopped")
