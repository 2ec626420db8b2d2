"""Stage-local recovery (Swift): one pipeline stage fails, only its log group rolls back.

Stage processes train through the relay (relay.py). Each logs, every step,
its data loader's record to its daemon (the training log) and the tensors it
sends across a logged boundary (boundary logs, one stream per kind and
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
     records still on their way;
  4. everybody goes on from M + 1.

Why at most one step behind: within a step every stage needs its
neighbours' tensors, so no survivor finishes a step after one the failed
stage could not have fed. Replays are bit for bit: the same state, inputs
and batch give the same outputs, so a replayed stage's tensors are the ones
its neighbours already consumed.
"""

import dataclasses
import io
import time

import numpy as np

from pipeline.snapshot_modes import NoSnapshots
from pipeline.transport import NeighbourLost

#: How long a replaying stage waits for a boundary record a live neighbour is still sending.
RECORD_WAIT_SECONDS = 120.0


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What the coordinator decided after a failure."""

    after: int                     # M: the step everybody stands after when training goes on
    restore_step: int              # the snapshot the rolled-back stages restore
    rolled_back: tuple[int, ...]   # the failed stage's log group
    replaying: dict[int, int]      # stage -> first step it replays (through ``after``)

    def message(self) -> dict:
        return {"event": "recover", "after": self.after, "restore_step": self.restore_step,
                "rolled_back": list(self.rolled_back),
                "replaying": {str(s): f for s, f in self.replaying.items()}}

    @classmethod
    def from_message(cls, message: dict) -> "Recovery":
        return cls(message["after"], message["restore_step"], tuple(message["rolled_back"]),
                   {int(s): f for s, f in message["replaying"].items()})


def decide(failed: int, completed: dict[int, int], group: tuple[int, ...],
           restore_step: int) -> Recovery:
    """Who replays what, from the steps the survivors finished (pure)."""
    after = max(completed.values())
    behind = {s: c for s, c in completed.items() if s not in group and c < after}
    if any(c < after - 1 for c in behind.values()):
        raise RuntimeError(f"survivors more than one step apart after stage {failed} failed: "
                           f"{completed}")
    if restore_step < 0:
        raise RuntimeError(f"stage {failed} failed before the first snapshot every stage "
                           "holds; nothing to restore it from")
    replaying = {s: restore_step + 1 for s in group}
    replaying.update({s: after for s in behind})
    return Recovery(after, restore_step, tuple(group), replaying)


def stream(key) -> str:
    kind, _, microbatch = key
    return f"{kind}/mb{microbatch}"


class BoundaryLog:
    """The tensors crossing logged boundaries, in the senders' daemons."""

    def __init__(self, client, job: str, stages: int, logged_boundaries, options):
        from bubblesnap.clients import NumpyClient
        self.client = client  # this stage's: it logs what this stage sends
        self.logged_boundaries = frozenset(logged_boundaries)
        self._readers = {s: NumpyClient(job, rank=s, world_size=stages, options=options)
                         for s in range(stages)}
        self.bytes_by_boundary: dict[int, int] = {}  # what this stage logged

    def logged(self, sender: int, receiver: int) -> bool:
        return min(sender, receiver) in self.logged_boundaries

    def write(self, boundary: int, key, value: np.ndarray) -> None:
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        payload = buffer.getvalue()
        self.bytes_by_boundary[boundary] = self.bytes_by_boundary.get(boundary, 0) + len(payload)
        self.client.log(key[1], payload, stream=stream(key))

    def read(self, sender: int, key) -> np.ndarray:
        """The tensor ``sender`` logged under ``key``, waiting while it is on its way."""
        step = key[1]
        deadline = time.monotonic() + RECORD_WAIT_SECONDS
        while True:
            records = self._readers[sender].read_log(step - 1, stream=stream(key))
            if records and records[0][0] == step:
                return np.load(io.BytesIO(records[0][1]), allow_pickle=False)
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {sender} never logged {key}; is boundary "
                                   f"{min(sender, sender + 1)} logged?")
            time.sleep(0.01)


class Logged(NoSnapshots):
    """The mode of a training step: logs the loader's record as the step begins, waits
    for every record of the step (loader and boundary tensors) as it ends, and
    snapshots every ``snapshot_every`` steps. Finished steps are appended to
    ``progress`` (a file), which outlives a killed process."""

    def __init__(self, client, loader, snapshot_every: int, progress: str):
        super().__init__()
        self.client, self.loader, self.every = client, loader, snapshot_every
        self._progress = progress

    def begin_iteration(self, iteration: int) -> None:
        self.client.log(iteration, self.loader.record(iteration))

    def end_iteration(self, iteration: int, state) -> None:
        self.client.wait_log()
        if self.every and iteration % self.every == self.every - 1:
            self.client.snapshot(iteration, state, wait=True)
        with open(self._progress, "a") as f:
            f.write(f"{iteration}\n")


class ReplayInbox:
    """A replaying stage's inputs: live from a neighbour that replays the same step,
    otherwise from the neighbour's boundary log."""

    def __init__(self, inbox, boundary_log: BoundaryLog, replaying: dict[int, int]):
        self._inbox, self._log, self._replaying = inbox, boundary_log, replaying

    def live(self, stage: int, step: int) -> bool:
        return self._replaying.get(stage, step + 1) <= step

    def has(self, key) -> bool:
        return self._inbox.has(key)

    def take(self, key, sender: int):
        if self.live(sender, key[1]):
            return self._inbox.take(key, sender)
        return self._log.read(sender, key), time.perf_counter()


class StageProcess:
    """One stage's training, surviving neighbours' failures (see the module docstring).

    ``make_runner(inbox, send, mode)`` builds a StageRunner on the stage's
    program; ``restore(step)`` replaces the program's state with a snapshot.
    """

    def __init__(self, stage: int, links, boundary_log: BoundaryLog, mode: Logged,
                 make_runner, restore, die=None):
        self.stage, self.links, self.log, self.mode = stage, links, boundary_log, mode
        self._make_runner, self._restore, self._die = make_runner, restore, die
        self.completed = -1
        self.recoveries: list[dict] = []
        self.runners: list = []  # every runner used, training and replay, for their timings

    def train(self, steps: int, replacement: bool = False) -> None:
        first = 0
        if replacement:
            first = self._recover(self._wait_for("recover")) + 1
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

    def _send(self, to: int, key, value) -> None:
        value = np.asarray(value)
        if self.log.logged(self.stage, to):
            self.log.write(min(self.stage, to), key, value)
        self.links.send(to, key, value)
        if self._die is not None:
            self._die(key)

    def _recover(self, message: dict) -> int:
        plan = Recovery.from_message(message)
        started = time.perf_counter()
        first = plan.replaying.get(self.stage)
        restored = None
        if first is not None:
            if self.stage in plan.rolled_back:
                restored = self._restore(plan.restore_step)
            inbox = ReplayInbox(self.links.inbox, self.log, plan.replaying)

            def send(to: int, key, value) -> None:
                value = np.asarray(value)
                if self.log.logged(self.stage, to):
                    self.log.write(min(self.stage, to), key, value)
                if inbox.live(to, key[1]):
                    self.links.send(to, key, value)

            runner = self._make_runner(inbox, send, NoSnapshots())
            runner.run(["m"] * (plan.after - first + 1), first_iteration=first)
            self.log.client.wait_log()
            self.completed = plan.after
        report = {"after": plan.after, "restored_step": restored,
                  "replayed_steps": 0 if first is None else plan.after - first + 1,
                  "replay_seconds": time.perf_counter() - started}
        self.recoveries.append(report)
        self.links.tell({"event": "ready", **report})
        self._wait_for("go")
        return plan.after

    def _wait_for(self, event: str) -> dict:
        while True:
            message = self.links.control.get()
            if message["event"] == event:
                return message
            if message["event"] == "relay-gone":
                raise SystemExit("the relay is gone: the supervisor stopped")


class Coordinator:
    """The supervisor's side: notices a failure, decides the recovery, starts the
    replacement, and lets everybody go on (see the module docstring)."""

    def __init__(self, relay, stages: int, group_of, latest_snapshot, start_replacement):
        self.relay, self.stages = relay, stages
        self._group_of, self._latest_snapshot = group_of, latest_snapshot
        self._start_replacement = start_replacement
        self.recoveries: list[dict] = []

    def run(self, timeout: float) -> None:
        """Until every stage said it is done."""
        deadline = time.monotonic() + timeout
        done, silent, completed, failed, noticed = set(), set(), {}, None, 0.0
        while len(done) < self.stages:
            stage, message = self._next(deadline)
            event = message["event"]
            if event == "done":
                done.add(stage)
            elif event == "disconnected" and stage not in done:
                if failed is not None:
                    raise RuntimeError(f"stage {stage} failed while stage {failed} was "
                                       "being recovered")
                failed, noticed = stage, time.perf_counter()
                silent.add(stage)
                self.relay.broadcast({"event": "lost", "stages": sorted(silent)})
            elif event == "aborted":
                completed[stage] = message["completed"]
                silent.add(stage)
                self.relay.broadcast({"event": "lost", "stages": sorted(silent)})
            if failed is not None and len(completed) == self.stages - 1:
                self._recover(failed, completed, noticed, deadline)
                silent, completed, failed = set(), {}, None

    def _recover(self, failed: int, completed: dict, noticed: float, deadline: float) -> None:
        plan = decide(failed, completed, self._group_of(failed), self._latest_snapshot())
        self._start_replacement(failed)
        while True:
            stage, message = self._next(deadline)
            if stage == failed and message["event"] == "hello":
                break
        self.relay.broadcast(plan.message())
        ready = {}
        while len(ready) < self.stages:
            stage, message = self._next(deadline)
            if message["event"] == "ready":
                ready[stage] = message
            elif message["event"] == "disconnected":
                raise RuntimeError(f"stage {stage} failed during the recovery")
        self.relay.broadcast({"event": "go"})
        self.recoveries.append({
            "failed_stage": failed, "resumed_after": plan.after,
            "restored_step": plan.restore_step,
            "rolled_back": sorted(s for s, r in ready.items() if r["restored_step"] is not None),
            "replayed_steps": {s: ready[s]["replayed_steps"] for s in sorted(ready)},
            "replay_seconds": max(r["replay_seconds"] for r in ready.values()),
            "recovery_seconds": time.perf_counter() - noticed,
            "survivors_finished": completed})

    def _next(self, deadline: float):
        import queue
        try:
            return self.relay.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("the pipeline made no progress before the deadline") from None
