"""One pipeline stage's training loop: compute, wait for neighbours, call the snapshot hooks.

Every wait for a neighbour's tensor is a bubble; the active snapshot mode (a
``bubblesnap.clients.PipelineHooks``) gets it (bubblesnap fetches chunks
there). Each piece of work is recorded as (label, start, stop) on the
perf_counter clock, which is system-wide monotonic on Linux, so stage
processes can be drawn on one timeline.
"""

import resource
import time

import jax

from bubblesnap.clients import PipelineHooks
from pipeline import model as model_lib


class StageRunner:
    """Runs iterations of one stage; ``modes`` maps a mode name to its hooks."""

    def __init__(self, program: model_lib.StageProgram, schedule, stage: int, stages: int,
                 inbox, send, modes: dict[str, PipelineHooks], keep_states: int = 0,
                 batch=None):
        self.program, self.schedule = program, schedule
        self.stage, self.stages = stage, stages
        self.inbox, self.send = inbox, send
        self.modes = modes
        self.events: list[tuple[str, float, float]] = []
        self.iterations: list[dict] = []
        self.kept_states: dict[int, object] = {}
        self._keep = keep_states
        # (iteration, microbatch) -> (tokens, targets); default: a pure function of both
        self._batch = batch or (lambda it, mb: model_lib.batch(program.config, it, mb))

    def run(self, plan: list[str], first_iteration: int = 0, after_iteration=None) -> None:
        """Runs one iteration per entry of ``plan`` (the snapshot mode of that iteration).

        Iterations are numbered from ``first_iteration`` (a run resumed after
        step k starts at k + 1); ``after_iteration(iteration, state)`` is
        called once each is done.
        """
        active = None
        for iteration, mode_name in enumerate(plan, start=first_iteration):
            mode = self.modes[mode_name]
            if active is not None and mode is not active:
                active.flush()  # finish the last mode's work before the next one starts timing
            active = mode
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            mode.begin_iteration(iteration)
            loss = self._iteration(iteration, mode)
            hold = time.perf_counter()
            mode.end_iteration(iteration, self.program.state)
            stopped = time.perf_counter()
            self.events.append(("hook", hold, stopped))
            self.iterations.append({
                "iteration": iteration, "mode": mode_name, "start": started,
                "seconds": stopped - started, "loss": loss,
                "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
            if self._keep:
                self.kept_states[iteration] = self.program.state
                self.kept_states.pop(iteration - self._keep, None)
            if after_iteration is not None:
                after_iteration(iteration, self.program.state)
        if active is not None:
            active.flush()

    def _iteration(self, iteration: int, mode: PipelineHooks) -> float | None:
        program, first, last = self.program, self.stage == 0, self.stage == self.stages - 1
        inputs, grads, losses = {}, None, []
        for position, (op, mb) in enumerate(self.schedule):
            tokens, targets = self._batch(iteration, mb)
            if op == "F":
                x = program.place(tokens) if first else self._receive(
                    mode, position, ("act", iteration, mb), self.stage - 1)
                started = time.perf_counter()
                y = jax.block_until_ready(program.forward(x, program.place(targets) if last
                                                          else None))
                self.events.append(("F", started, time.perf_counter()))
                inputs[mb] = x
                if last:
                    losses.append(float(y))
                else:
                    self.send(self.stage + 1, ("act", iteration, mb), y)
            else:
                upstream = program.place(targets) if last else self._receive(
                    mode, position, ("grad", iteration, mb), self.stage + 1)
                started = time.perf_counter()
                g, gx = jax.block_until_ready(program.backward(inputs.pop(mb), upstream))
                grads = program.accumulate(grads, g)
                self.events.append(("B", started, time.perf_counter()))
                if not first:
                    self.send(self.stage - 1, ("grad", iteration, mb), gx)
        started = time.perf_counter()
        program.update(grads)
        jax.block_until_ready(program.state)
        self.events.append(("U", started, time.perf_counter()))
        return sum(losses) / len(losses) if losses else None

    def _receive(self, mode: PipelineHooks, position: int, key, sender: int):
        if self.inbox.has(key):
            mode.no_bubble(position)
            value, _ = self.inbox.take(key, sender)
        else:
            started = time.perf_counter()
            value = mode.bubble(position, lambda: self.inbox.take(key, sender),
                                lambda: self.inbox.has(key))
            self.events.append(("wait", started, time.perf_counter()))
        return self.program.place(value)
