"""Training logs that survive the host: records handed to peers before they are acknowledged.

Training-log records go to this daemon's logs and to the next ``--replicas``
peers before the call answers. Boundary logs stay here: the failed stage's
inputs were logged by its surviving neighbours. A read gathers the
training log from this daemon and every peer (a replacement host starts
empty; records may have gone to different peers while one was down).
Without peers it is this daemon's logs alone.
"""

import logging

import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import logs as logs_lib
from bubblesnap.service.errors import NotFound

log = logging.getLogger("bubblesnap.daemon")


class LogReplication:
    """The trainer's view of the logs: this daemon's, plus the peers' copies (``group``
    None: a lone daemon).

    ``registered(job, rank)`` raises NotFound unless the rank is registered (or
    held) here: records are kept only for those, so invented job names cannot
    fill the logs, and deleting a job frees its records.
    """

    def __init__(self, logs: logs_lib.TrainingLogs, group, registered):
        self._logs = logs
        self._group = group
        self._registered = registered

    def append(self, logs) -> list[tuple[int, int]]:
        """Logs several ``(job, rank, records, stream)`` logs, all or none (a bad record
        anywhere, an unregistered rank, or the log budget refuses them all).
        Returns (newest step held, daemons holding the records) per log."""
        logs = [(job, rank, list(records), stream) for job, rank, records, stream in logs]
        for job, rank, records, stream in logs:  # malformed before unknown
            self._logs.check(job, rank, records, stream)
        for job, rank, _, _ in logs:
            self._check_registered(job, rank)
        lasts = self._logs.append_all(logs)
        return [(last, self._replicate(*entry)) for last, entry in zip(lasts, logs, strict=True)]

    def _check_registered(self, job: str, rank: int) -> None:
        try:
            self._registered(job, rank)
        except NotFound:
            raise NotFound(f"rank {rank} of job {job!r} is not registered with this daemon: "
                           "call Register before logging (a client's first snapshot or its "
                           "register() does); records are kept only for registered "
                           "ranks") from None

    def _replicate(self, job: str, rank: int, records, stream: str) -> int:
        """Hands training-log records to the next peers; the daemons holding them."""
        copies = 1
        if self._group is None or stream != logs_lib.TRAINING:
            return copies
        request = ppb.LogReplicaRequest(job=job, rank=rank, records=[
            pb.LogRecord(step=s, payload=p) for s, p in records])
        for target in self._group.ring_order_live_first():
            if copies > self._group.options.replicas:
                break
            try:
                self._group.call(target, "AppendLogReplica", request)
                copies += 1
            except grpc.RpcError as err:
                log.warning("peer %d did not take log records of rank %d of %s: %s", target,
                            rank, job, err.code().name)
        return copies

    def read(self, job: str, rank: int, after_step: int, stream: str = logs_lib.TRAINING,
             until_step: int | None = None) -> tuple[list, str]:
        """The rank's records after ``after_step`` (through ``until_step``), without
        gaps, and where they came from. A step held in several places is the
        same record: this daemon's copy wins."""
        if self._group is None or stream != logs_lib.TRAINING:
            return self._logs.read(job, rank, after_step, stream=stream,
                                   until_step=until_step), "memory"
        merged, sources = {}, {}
        for index in reversed(self._group.others()):
            try:
                for step, payload in self._peer_records(index, job, rank, after_step,
                                                        until_step):
                    merged[step] = payload
                    sources[step] = f"peer {self._group.address(index)}"
            except grpc.RpcError as err:
                log.warning("peer %d did not answer for the log of rank %d of %s: %s; the "
                            "records it holds are missing from this read", index, rank, job,
                            err.code().name)
        for step, payload in self._logs.held_after(job, rank, after_step, max_bytes=None,
                                                   until_step=until_step):
            merged[step], sources[step] = payload, "memory"
        found = logs_lib.prefix(logs_lib.contiguous(merged, after_step), logs_lib.READ_BYTES)
        used = sorted({sources[step] for step, _ in found}) or ["memory"]
        return found, ", ".join(used)

    def _peer_records(self, index: int, job: str, rank: int, after_step: int,
                      until_step: int | None):
        """Every record a peer holds after ``after_step`` (through ``until_step``), asked
        for a page at a time."""
        while True:
            answer = self._group.call(index, "ReadLogReplica", pb.ReadLogRequest(
                job=job, rank=rank, after_step=after_step, until_step=until_step))
            if not answer.records:
                return
            for r in answer.records:
                yield r.step, r.payload
            after_step = answer.records[-1].step
