"""What every client of the local daemon shares, whatever arrays it snapshots.

A framework's client (``SnapshotClient`` for JAX, :class:`NumpyClient`)
subclasses :class:`DaemonClient` and adds ``snapshot`` and ``restore`` for
its arrays, built on :attr:`DaemonClient.session`; the training log,
waiting, status and closing are the same for all of them and live here.
"""

import grpc

from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import LogError, SnapshotResult
from bubblesnap.clients.session import Session


class DaemonClient:
    """One rank of one job, talking to its local daemon.

    ``replica_group``: the ranks whose state equals this rank's (its
    data-parallel replicas, itself included); only the group's lowest rank
    copies, the others' snapshots are held through its copy.
    """

    def __init__(self, job: str, rank: int = 0, world_size: int = 1,
                 options: ClientOptions = ClientOptions(), replica_group=()):
        self._session = Session(job, rank, world_size, options, replica_group)

    @property
    def session(self) -> Session:
        """The :class:`Session` under this client: registration, staging and committing a
        step in pieces, the bubble stream. For code that stages steps itself (as
        ``BubbleSnapshotter`` does, over several bubbles); a training loop needs
        only the client's own methods."""
        return self._session

    @property
    def job(self) -> str:
        """The job's name."""
        return self._session.job

    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self._session.rank

    @property
    def world_size(self) -> int:
        """How many ranks the job has."""
        return self._session.world_size

    def wait(self) -> SnapshotResult | None:
        """Waits for the commits in flight (this rank's copies checked and kept by its
        daemon); returns the newest one's outcome (``waited_for == "rank"``; None if
        none was pending)."""
        return self._session.wait()

    def _declare(self, tensors) -> None:
        """Registers the layout ``tensors`` (the ``register`` of a subclass)."""
        try:
            self._session.ensure_registered(tensors)
        except grpc.RpcError as err:
            raise LogError(f"daemon {self._session.options.daemon} did not register rank "
                           f"{self.rank} of {self.job!r}: {err.code().name}: "
                           f"{err.details()}") from None

    def log(self, step: int, payload: bytes, stream: str = "") -> None:
        """Records what redoing ``step`` needs (batch identity, RNG key, data-loader
        position; a few bytes, at most 64 KiB). Call it as the step begins.

        The daemon keeps records only of a registered rank: a rank that logs
        before its first ``snapshot`` calls ``register`` first (or restores
        from the daemon that holds its registration).

        Returns at once; the local daemon stores the record and hands it to
        its ``--replicas`` peers while the step computes. Call
        :meth:`wait_log` when the step ends: a step counts as done only once
        its record is held, since a step that is not logged cannot be replayed.

        A named ``stream`` is a boundary log instead: a tensor this pipeline
        stage sent to a neighbour (one stream per kind and microbatch, up to
        16 MiB a record), kept by the local daemon only, so that a failed
        neighbour can replay alone with its inputs read back from here. These
        records wait in the client and go in one call at :meth:`wait_log`
        (or once 8 MiB are waiting).
        """
        self._session.log(step, payload, stream)

    def wait_log(self) -> int:
        """Waits for every record sent so far; returns the fewest daemons holding one of
        the training-log records (0: none was pending). Raises :class:`LogError`
        when the daemon refused one or could not be reached."""
        return self._session.wait_log()

    def read_log(self, after_step: int, stream: str = "",
                 until_step: int | None = None) -> list[tuple[int, bytes]]:
        """The logged ``(step, payload)`` records after ``after_step`` (the restored
        step), in order and without gaps: the steps to replay after a restore.
        ``until_step``: none after it (one step's record: ``until_step=after_step+1``)."""
        return self._session.read_log(after_step, stream, until_step)[0]

    def status(self):
        """This job's status as the daemon reports it (a ``JobStatus`` message)."""
        return self._session.status()

    def close(self) -> None:
        """Waits for the commits and log records in flight, then lets go of the daemon."""
        self._session.close()
