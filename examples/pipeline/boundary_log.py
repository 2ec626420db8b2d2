"""Boundary logs: the tensors a pipeline stage sends across a logged boundary, in its daemon.

Each (kind, microbatch) is one stream of the sender's rank, one record per
step (``.npy`` bytes); a replaying neighbour reads them back (Swift).
"""

import io
import time

import numpy as np

#: How long a replaying stage waits for a boundary record a live neighbour is still sending.
RECORD_WAIT_SECONDS = 120.0


def stream(key) -> str:
    kind, _, microbatch = key
    return f"{kind}/mb{microbatch}"


class BoundaryLog:
    """The tensors crossing logged boundaries, in the senders' daemons."""

    def __init__(self, client, job: str, stages: int, logged_boundaries, options_of):
        """``options_of(stage)``: the ClientOptions that reach that stage's daemon."""
        self.client = client  # this stage's: it logs what this stage sends
        self.logged_boundaries = frozenset(logged_boundaries)
        self._job, self._stages, self._options_of = job, stages, options_of
        self._readers: dict = {}  # sender -> a client reading that rank's streams
        self.bytes_by_boundary: dict[int, int] = {}  # what this stage logged

    def close(self) -> None:
        """Closes the clients that read neighbours' logs (not this stage's own)."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def logged(self, sender: int, receiver: int) -> bool:
        return min(sender, receiver) in self.logged_boundaries

    def write(self, boundary: int, key, value: np.ndarray) -> None:
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        payload = buffer.getvalue()
        self.bytes_by_boundary[boundary] = self.bytes_by_boundary.get(boundary, 0) + len(payload)
        self.client.log(key[1], payload, stream=stream(key))

    def read(self, sender: int, receiver: int, key) -> np.ndarray:
        """The tensor ``sender`` logged under ``key``, waiting while it is on its way."""
        from bubblesnap.clients import NumpyClient
        if sender not in self._readers:
            self._readers[sender] = NumpyClient(self._job, rank=sender, world_size=self._stages,
                                                options=self._options_of(sender))
        step = key[1]
        deadline = time.monotonic() + RECORD_WAIT_SECONDS
        while True:
            records = self._readers[sender].read_log(step - 1, stream=stream(key),
                                                     until_step=step)
            if records and records[0][0] == step:
                return np.load(io.BytesIO(records[0][1]), allow_pickle=False)
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {sender} never logged {key}; is boundary "
                                   f"{min(sender, receiver)} logged?")
            time.sleep(0.01)
