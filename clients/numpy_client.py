"""A client without JAX: numpy arrays in, numpy arrays out, same protocol.

Proof that the daemon is framework-neutral, and the smallest example of the
protocol to copy for another framework.
"""

import numpy as np

from bubblesnap.clients._shared_memory import as_bytes
from bubblesnap.clients.daemon_client import DaemonClient
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import SnapshotResult
from bubblesnap.protos import daemon_pb2 as pb

try:  # bfloat16 and float8 names, when ml_dtypes is installed (it comes with JAX)
    import ml_dtypes  # noqa: F401
except ImportError:
    pass


def _spec(name: str, array: np.ndarray) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=array.dtype.name, global_shape=array.shape, shards=[
        pb.ShardSpec(index=[pb.Slice(start=0, stop=d) for d in array.shape],
                     nbytes=array.nbytes, device="host")])


class NumpyClient(DaemonClient):
    """Snapshots a flat ``{name: ndarray}`` dict; each array is one unsharded tensor.

    ``replica_group``: the ranks holding the same arrays as this one (data
    parallel); only the lowest of them copies, as in :class:`DaemonClient`.
    The training log, ``wait``, ``status`` and ``close`` are DaemonClient's.
    """

    def __init__(self, job: str, rank: int = 0, world_size: int = 1,
                 options: ClientOptions = ClientOptions(), replica_group=()):
        super().__init__(job, rank, world_size, options, replica_group)
        self.last_restore_source = ""

    def register(self, arrays: dict[str, np.ndarray]) -> None:
        """Registers the layout of ``arrays`` with the daemon, as :meth:`snapshot` does,
        without copying them: a rank must be registered before it logs. Raises
        :class:`LogError` when the daemon refuses."""
        self._declare([_spec(name, np.asarray(arrays[name])) for name in sorted(arrays)])

    def snapshot(self, step: int, arrays: dict[str, np.ndarray],
                 wait: bool | str = True) -> SnapshotResult:
        """Copies ``arrays`` (step ``step``) into the daemon's memory. Never raises for
        daemon trouble.

        ``wait``: True (the default) or ``"rank"`` waits until the daemon checked
        and kept this rank's copy; ``"job"`` until the whole job committed the
        step (at most ``ClientOptions.commit_timeout_seconds``); False not at
        all. ``SnapshotResult.waited_for`` says which one ``committed`` reports.
        """
        names = sorted(arrays)
        specs = [_spec(name, np.asarray(arrays[name])) for name in names]
        return self._session.snapshot(
            step, specs, lambda: [as_bytes(np.asarray(arrays[n])) for n in names], wait=wait)

    def restore(self, step: int | None = None,
                alone: bool = False) -> tuple[int, dict[str, np.ndarray]]:
        """The latest committed step (or ``step``) as ``(step, {name: array})``: this
        rank's own copy, as it was registered; ``alone``: see SnapshotClient.restore.

        The arrays are private, writable copies. :attr:`last_restore_source`
        says where the daemon found them (memory, peer, durable).
        """
        raw = self._session.restore(step, alone)
        self.last_restore_source = raw.source
        return raw.step, {
            t.name: raw.shards[(i, 0)].view(np.dtype(t.dtype)).reshape(tuple(t.global_shape)).copy()
            for i, t in enumerate(raw.tensors)}
