"""Parallel replay (Swift): a replacement stage replays its lost steps with several workers.

A stage that replays alone reads every input of a step from its
neighbours' boundary logs, so the step's microbatches need each other only
where their gradients are summed. :class:`ReplayWorkers` runs one thread
per worker, each on its own device (on CPU, one of the host platform's
forced devices), with a copy of the stage's parameters: each takes its
share of the microbatches (``bubblesnap.clients.replay_shares``) and
returns one gradient per microbatch; the owner sums them in the order the
original step did (``combine_in_order``), applies the one optimizer update
and hands the new parameters to the workers with the next step. The
tensors the stage sends leave in the order the step sent them.

Every worker compiles its device's programs (XLA compiles per device) from
the moment the replacement starts, while it waits for the coordinator and
restores: the stage's own device first (the first step waits for it; the
others' compiles would only slow it down on a busy CPU), then the others.
A step is shared among the workers whose programs are ready, so a slow
compile elsewhere costs the replay nothing but CPU: which device computes a
microbatch does not change its gradient's bits, and the sum's order is the
step's whatever the shares. Each worker reads its own share's inputs from
the logs, so the reads overlap too.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from bubblesnap.clients import combine_in_order, replay_shares


class ReplayWorkers:
    """One worker thread per device in ``devices`` (the first is the stage's own), replaying
    steps of ``program`` (a StageProgram) under ``schedule`` (its ("F"|"B", microbatch)
    actions); ``batch(step, microbatch)`` gives (tokens, targets).

    Attributes:
      workers_by_step: how many workers shared each replayed step.
      step_seconds: how long each replayed step took.
      waited_for_warm_up: how long the first replayed step waited for the stage's own
        device's compile.
    """

    def __init__(self, program, schedule, stage: int, stages: int, batch, devices):
        self.program, self.schedule, self.stage = program, list(schedule), stage
        self._first, self._last = stage == 0, stage == stages - 1
        self._batch, self.devices = batch, list(devices)
        self._order = tuple(mb for op, mb in self.schedule if op == "B")
        self.workers_by_step: list[int] = []
        self.step_seconds: list[float] = []
        self.waited_for_warm_up = 0.0
        self._pool = ThreadPoolExecutor(len(self.devices), thread_name_prefix="replay-worker")
        started = time.perf_counter()
        own = self._pool.submit(self._warm_up, self.devices[0], started)
        self._warming = [own, *(self._pool.submit(self._warm_up, device, started, own)
                                for device in self.devices[1:])]

    def replay(self, step: int, take, send) -> None:
        """Replays ``step``: inputs from ``take(key, sender)`` ((value, arrival time), as an
        inbox), outputs to ``send(to, key, value)``; the program's state moves on one step."""
        started = time.perf_counter()
        if not self.step_seconds:
            self._warming[0].result()
            self.waited_for_warm_up = time.perf_counter() - started
        ready = [d for d, future in zip(self.devices, self._warming, strict=True)
                 if future.done()]
        self.workers_by_step.append(len(ready))
        params = self.program.state["params"]
        results = {}
        shares = replay_shares(len(self._order), len(ready))
        for future in [self._pool.submit(self._replay_share, device, params, share, step, take)
                       for device, share in zip(ready, shares, strict=True)]:
            results.update(future.result())
        for op, mb in self.schedule:
            if op == "F" and not self._last:
                send(self.stage + 1, ("act", step, mb), results[mb][0])
            elif op == "B" and not self._first:
                send(self.stage - 1, ("grad", step, mb), results[mb][2])
        grads = combine_in_order({mb: self.program.place(r[1]) for mb, r in results.items()},
                                 self._order, self.program.accumulate)
        self.program.update(grads)
        jax.block_until_ready(self.program.state)
        self.step_seconds.append(time.perf_counter() - started)

    @property
    def warm_up_seconds(self) -> list[float | None]:
        """How long each device's compile took from the start (None: still running)."""
        return [future.result() if future.done() else None for future in self._warming]

    def close(self) -> None:
        """Stops the worker threads (after any compile still running)."""
        self._pool.shutdown()

    def _replay_share(self, device, params, share, step: int, take) -> dict:
        return self._share(device, params, share,
                           {mb: self._inputs(step, mb, take) for mb in share})

    def _inputs(self, step: int, mb: int, take):
        """(the microbatch's input, the gradient flowing into its output) as the step had them."""
        tokens, targets = self._batch(step, mb)
        x = tokens if self._first else take(("act", step, mb), self.stage - 1)[0]
        upstream = targets if self._last else take(("grad", step, mb), self.stage + 1)[0]
        return x, upstream

    def _share(self, device, params, share, inputs) -> dict:
        """(output, param grads, input grads) of each microbatch of ``share``, on ``device``."""
        params = jax.device_put(params, device)
        results = {}
        for mb in share:
            x, upstream = jax.device_put(inputs[mb], device)
            # The last stage's forward is only its loss, which a replay does not report.
            y = None if self._last else self.program.forward(x, params=params)
            g, gx = self.program.backward(x, upstream, params=params)
            results[mb] = jax.block_until_ready((y, g, gx))
        return results

    def _warm_up(self, device, started: float, after=None) -> float:
        """Compiles what a step runs on ``device`` on zeros shaped like a microbatch (not the
        loader's batch: asking it for a step draws that step's samples), once ``after``
        (a future) is done."""
        if after is not None:
            after.result()
        c = self.program.config
        shape = (c.microbatch_size, c.seq_len)
        activation = jnp.zeros((*shape, c.d_model), jnp.float32)
        x = jnp.zeros(shape, jnp.int32) if self._first else activation
        upstream = jnp.zeros(shape, jnp.int32) if self._last else activation
        [(_, g, _)] = self._share(device, self.program.state["params"], [0],
                                  {0: (x, upstream)}).values()
        if device == self.devices[0]:  # the owner sums and updates on the stage's device
            g = self.program.place(g)
            total = self.program.accumulate(self.program.accumulate(g, g), g)
            jax.block_until_ready(self.program.updated(total))
        return time.perf_counter() - started
