"""Shuffling data loaders whose position can be logged and replayed (TranLogs)."""

import json
import threading

import numpy as np


class SampleOrder:
    """Which samples each step reads, drawn by a seeded RNG; its position is that RNG's state.

    A step's sample indices are drawn once, by whichever of ``record(step)``
    and ``indices(step)`` asks first (every stage reads the batch, one logs
    it; steps are asked for in order); ``record`` returns what redoing the
    step needs: those indices and the RNG's state after drawing them.
    Replaying logged steps takes the logged indices; after the last one the
    order continues from the logged state, exactly where the failed run was.
    Thread-safe: pipeline stages in one process share one order.
    """

    def __init__(self, samples: int, per_step: int, seed: int = 0):
        self._samples, self._per_step = samples, per_step
        self._rng = np.random.default_rng(seed)
        self._drawn: dict[int, list[int]] = {}
        self._state_after: dict[int, dict] = {}  # the RNG's state after drawing a step
        self._lock = threading.Lock()

    def record(self, step: int) -> bytes:
        """The step's log record, drawing its indices if nobody has yet."""
        with self._lock:
            self._draw(step)
            return json.dumps({"step": step, "indices": self._drawn[step],
                               "loader_state": self._state_after[step]}).encode()

    def _draw(self, step: int) -> None:  # under the lock
        if step not in self._drawn:
            self._drawn[step] = self._rng.choice(self._samples, self._per_step,
                                                 replace=False).tolist()
            self._state_after[step] = self._rng.bit_generator.state

    def replay(self, records) -> None:
        """Takes the logged steps' indices, and the RNG's state after the last one."""
        with self._lock:
            for step, payload in records:
                row = json.loads(payload)
                self._drawn[step] = row["indices"]
                self._state_after[step] = row["loader_state"]
                self._rng.bit_generator.state = row["loader_state"]

    def indices(self, step: int) -> list[int]:
        """The samples of a step, replayed or drawn (now, if nobody has yet)."""
        with self._lock:
            self._draw(step)
            return self._drawn[step]


class DataLoader(SampleOrder):
    """Token batches for the GPT pipeline: a step's samples split into microbatches."""

    def __init__(self, config, microbatches: int, seed: int = 0, samples: int = 4096):
        super().__init__(samples, microbatches * config.microbatch_size, seed)
        self._tokens = np.random.default_rng(12345).integers(
            0, config.vocab, (samples, config.seq_len + 1), dtype=np.int32)
        self._mb = config.microbatch_size

    def batch(self, step: int, microbatch: int):
        rows = self._tokens[self.indices(step)[microbatch * self._mb:
                                               (microbatch + 1) * self._mb]]
        return rows[:, :-1], rows[:, 1:]
