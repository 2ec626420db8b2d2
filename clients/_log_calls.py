"""The training and boundary logs' calls to the daemon, on a session's channel.

Training-log records go out one call each as a step begins and are awaited
as it ends; boundary records (one per microbatch and tensor kind) wait in
the client and go in one call, so the call costs less than the bytes.
"""

import threading

import grpc

from bubblesnap.clients.results import LogError
from bubblesnap.protos import daemon_pb2 as pb

#: Kept boundary records are sent once they reach this many bytes, even before wait_log.
LOG_BATCH_BYTES = 8 << 20


class LogCalls:
    """One rank's log records on their way to its daemon (``Session`` delegates here)."""

    def __init__(self, job: str, rank: int, stub, options):
        self.job, self.rank, self._stub, self.options = job, rank, stub, options
        self._log_pending: list = []  # (what, future, is training log) not awaited
        self._log_kept: dict[str, list] = {}  # boundary records not sent yet, by stream
        self._log_kept_bytes = 0
        self._log_lock = threading.Lock()

    def log(self, step: int, payload: bytes, stream: str = "") -> None:
        """Sends one record to the training log (""), or keeps one for a boundary
        ``stream`` until :meth:`wait_log` sends the kept ones in one call (a
        stage sends a tensor per microbatch: one call each would cost more than
        the bytes). :meth:`wait_log` collects the answers. Thread-safe."""
        record = pb.LogRecord(step=step, payload=payload)
        if stream:
            with self._log_lock:
                self._log_kept.setdefault(stream, []).append(record)
                self._log_kept_bytes += len(payload)
                full = self._log_kept_bytes >= LOG_BATCH_BYTES
            if full:
                self._send_kept()
            return
        request = pb.AppendLogRequest(job=self.job, rank=self.rank, records=[record])
        future = self._stub.AppendLog.future(request, timeout=self.options.rpc_timeout_seconds)
        with self._log_lock:
            self._log_pending.append((f"step {step}", future, True))

    def _send_kept(self) -> None:
        with self._log_lock:
            kept, self._log_kept, self._log_kept_bytes = self._log_kept, {}, 0
            if not kept:
                return
            request = pb.AppendLogsRequest(logs=[
                pb.AppendLogRequest(job=self.job, rank=self.rank, stream=stream, records=records)
                for stream, records in kept.items()])
            future = self._stub.AppendLogs.future(request,
                                                  timeout=self.options.rpc_timeout_seconds)
            self._log_pending.append((
                "boundary records of steps " + ", ".join(sorted(
                    {str(r.step) for records in kept.values() for r in records})),
                future, False))

    def wait_log(self) -> int:
        """Sends the kept boundary records, waits for every record sent so far; returns
        the fewest daemons holding one of the training-log records (0: none
        pending; boundary records are held by this host's daemon alone). Raises
        LogError if one was not stored."""
        self._send_kept()
        with self._log_lock:
            pending, self._log_pending = self._log_pending, []
        copies, failed = [], []
        for what, future, training in pending:
            try:
                answer = future.result()
                if training:
                    copies.append(answer.copies)
            except grpc.RpcError as err:
                failed.append(f"{what}: {err.code().name}: {err.details()}")
        if failed:
            raise LogError(f"not logged by daemon {self.options.daemon}: {'; '.join(failed)}")
        return min(copies, default=0)

    def read_log(self, after_step: int, stream: str = "",
                 until_step: int | None = None) -> tuple[list[tuple[int, bytes]], str]:
        """(step, payload) records after ``after_step`` (through ``until_step``) without
        gaps, and their sources (the daemon answers a page at a time)."""
        records, sources = [], set()
        while True:
            try:
                answer = self._stub.ReadLog(pb.ReadLogRequest(job=self.job, rank=self.rank,
                                                              after_step=after_step,
                                                              stream=stream,
                                                              until_step=until_step),
                                            timeout=self.options.restore_timeout_seconds)
            except grpc.RpcError as err:
                raise LogError(f"daemon {self.options.daemon}: {err.code().name}: "
                               f"{err.details()}") from None
            if answer.records:
                records += [(r.step, r.payload) for r in answer.records]
                sources.add(answer.source)
            if not answer.records or (until_step is not None and records[-1][0] >= until_step):
                return records, ", ".join(sorted(sources)) or "memory"
            after_step = records[-1][0]
