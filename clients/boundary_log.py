"""Boundary logs (Swift): the tensors a pipeline stage sends across a logged boundary.

A stage logs every tensor it sends across a logged boundary (see
:func:`~bubblesnap.clients.plan_log_groups` for which) to its own daemon,
one stream per (kind, microbatch) and one ``.npy`` record per step; when a
neighbour fails, its replacement reads its inputs back from the senders'
daemons and replays alone while the others keep their state.
"""

import io
import threading
import time

import numpy as np

from bubblesnap.clients.numpy_client import NumpyClient

#: How long a replaying stage waits for a boundary record a live neighbour is still sending.
RECORD_WAIT_SECONDS = 120.0


def _stream(key) -> str:
    kind, _, microbatch = key
    return f"{kind}/mb{microbatch}"


class BoundaryLog:
    """The tensors crossing logged boundaries, kept in the senders' daemons.

    ``client`` is this stage's (its rank is the stage): it logs what this
    stage sends. ``logged_boundaries``: the boundaries b (between stage b and
    b + 1) that are logged. ``options_of(stage)``: the ClientOptions that
    reach that stage's daemon, to read what it logged. A tensor is named by
    its key ``(kind, step, microbatch)``, e.g. ``("act", 9, 0)``.

    Attributes:
      client: this stage's client.
      logged_boundaries: as given, a frozenset.
      bytes_by_boundary: bytes this stage logged, by boundary.
    """

    def __init__(self, client, logged_boundaries, options_of):
        self.client = client
        self.logged_boundaries = frozenset(logged_boundaries)
        self._options_of = options_of
        self._readers: dict = {}  # sender -> a client reading that rank's streams
        self._readers_lock = threading.Lock()  # replay workers read from several threads
        self.bytes_by_boundary: dict[int, int] = {}

    def logged(self, sender: int, receiver: int) -> bool:
        """Whether what ``sender`` sends to its neighbour ``receiver`` is logged."""
        return min(sender, receiver) in self.logged_boundaries

    def write(self, boundary: int, key, value: np.ndarray) -> None:
        """Logs ``value`` sent across ``boundary`` under ``key``; it goes to the daemon with
        the client's next ``wait_log`` (or once 8 MiB wait)."""
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        payload = buffer.getvalue()
        self.bytes_by_boundary[boundary] = self.bytes_by_boundary.get(boundary, 0) + len(payload)
        self.client.log(key[1], payload, stream=_stream(key))

    def read(self, sender: int, receiver: int, key,
             wait_seconds: float = RECORD_WAIT_SECONDS) -> np.ndarray:
        """The tensor ``sender`` logged under ``key``, waiting up to ``wait_seconds`` while
        it is on its way; TimeoutError after that. Safe to call from several threads."""
        with self._readers_lock:
            if sender not in self._readers:
                self._readers[sender] = NumpyClient(self.client.job, rank=sender,
                                                    world_size=self.client.world_size,
                                                    options=self._options_of(sender))
            reader = self._readers[sender]
        step = key[1]
        deadline = time.monotonic() + wait_seconds
        while True:
            records = reader.read_log(step - 1, stream=_stream(key), until_step=step)
            if records and records[0][0] == step:
                return np.load(io.BytesIO(records[0][1]), allow_pickle=False)
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {sender} never logged {key}; is boundary "
                                   f"{min(sender, receiver)} logged?")
            time.sleep(0.01)

    def close(self) -> None:
        """Closes the clients that read neighbours' logs (not this stage's own)."""
        with self._readers_lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
