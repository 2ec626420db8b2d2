"""Where one step's shards go: the daemon's answer to BeginStep, mapped, or on its way."""

import dataclasses
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Staging:
    """The mapped segment of a begun step and (offset, nbytes) per slot, in slot order."""

    step: int
    segment: np.ndarray
    slots: tuple[tuple[int, int], ...]


class PendingStaging:
    """A BeginStep in flight: ``done()`` without blocking, ``()`` waits and maps the segment."""

    def __init__(self, step: int, future, session):
        self.step, self._future, self._session = step, future, session

    def done(self) -> bool:
        """Whether the daemon answered (without waiting)."""
        return self._future.done()

    def ready(self, give_up) -> bool:
        """Waits for the answer until ``give_up()`` turns true; whether it came."""
        while not self._future.done():
            if give_up():
                return False
            time.sleep(2e-4)
        return True

    def __call__(self) -> Staging:
        """The :class:`Staging`, waiting for the answer; raises grpc.RpcError if refused."""
        return self._session.staging_of(self.step, self._future.result())
