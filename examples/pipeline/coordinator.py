"""The coordinator of stage-local recovery (Swift): who replays what after a stage fails.

It runs beside the relay (relay.py), in the supervisor. When a stage's
connection drops it silences that stage, then every survivor that stops
(a stage stops only when a tensor it waits for cannot come), and once every
survivor stopped it decides the recovery (:func:`decide`), starts the
replacement, tells everybody, and lets them go on once all are ready. The
stage side is stage_recovery.StageProcess.

Ordering the protocol relies on: a relay thread forwards a stage's tensors
before the control messages that stage sends after them (one connection, in
order), and the coordinator broadcasts "recover" and "go" only after every
stage's "aborted" or "ready" arrived, so no tensor sent before a stage
stopped reaches anybody after those broadcasts; the broadcast holds every
connection, so none sent after it arrives before it.
"""

import dataclasses
import queue
import time


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What the coordinator decided after a failure."""

    after: int                     # M: the step everybody stands after when training goes on
    restore_step: int              # the snapshot the rolled-back stages restore
    rolled_back: tuple[int, ...]   # the failed stage's log group
    replaying: dict[int, int]      # stage -> first step it replays (through ``after``)
    # Some stage keeps its state: the job does not resume from ``restore_step``,
    # so the daemons must keep the later snapshots (RestoreRequest.alone).
    alone: bool

    def message(self) -> dict:
        return {"event": "recover", "after": self.after, "restore_step": self.restore_step,
                "rolled_back": list(self.rolled_back),
                "replaying": {str(s): f for s, f in self.replaying.items()},
                "alone": self.alone}

    @classmethod
    def from_message(cls, message: dict) -> "Recovery":
        return cls(message["after"], message["restore_step"], tuple(message["rolled_back"]),
                   {int(s): f for s, f in message["replaying"].items()}, message["alone"])


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
    alone = any(s not in group for s in completed)
    return Recovery(after, restore_step, tuple(group), replaying, alone)


class Coordinator:
    """The supervisor's side: notices a failure, decides the recovery, starts the
    replacement, and lets everybody go on (see the module docstring)."""

    def __init__(self, relay, stages: int, group_of, latest_snapshot, start_replacement):
        self.relay, self.stages = relay, stages
        self._group_of, self._latest_snapshot = group_of, latest_snapshot
        self._start_replacement = start_replacement
        self.recoveries: list[dict] = []

    def run(self, timeout: float) -> None:
        """Until every stage said it is done. Training starts ("go") once every stage
        said hello: the relay drops tensors for a stage it has no connection to."""
        deadline = time.monotonic() + timeout
        done, silent, completed, failed, noticed = set(), set(), {}, None, 0.0
        hello: set[int] = set()
        while len(done) < self.stages:
            stage, message = self._next(deadline)
            event = message["event"]
            if event == "hello" and len(hello) < self.stages:
                hello.add(stage)
                if len(hello) == self.stages:
                    self.relay.broadcast({"event": "go"})
            elif event == "done":
                if failed is not None:
                    raise RuntimeError(f"stage {stage} finished while stage {failed} was lost: "
                                       "a survivor that finished cannot help replay; fail a "
                                       "step earlier than the last")
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
        try:
            return self.relay.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("the pipeline made no progress before the deadline") from None
