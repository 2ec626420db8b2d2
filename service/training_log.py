"""Training logs: per job and rank, one small opaque record per step.

A record says what redoing its step exactly needs (the batch's identity, RNG
keys, a data-loader position); the daemon never reads it. Records live in
the daemon's memory beside the snapshots and are pushed to the same peers
(replicator.py), so after a crash the trainer restores a snapshot and
replays the logged steps after it up to the failure point (TranLogs).
Memory is bounded per rank: the oldest records go first.
"""

import dataclasses
import threading

from bubblesnap.service import layout as layout_lib
from bubblesnap.service.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """Limits of the training log.

    Attributes:
      max_record_bytes: largest record accepted. Default 64 KiB: a record
        names data, it does not carry it.
      max_rank_bytes: records kept per rank; the oldest are dropped beyond
        it. Default 64 MiB (a million steps of 64-byte records).
    """

    max_record_bytes: int = 64 << 10
    max_rank_bytes: int = 64 << 20


class TrainingLogs:
    """Every job's and rank's records, in memory."""

    def __init__(self, options: LogOptions = LogOptions()):
        self.options = options
        self._logs: dict[tuple[str, int], dict[int, bytes]] = {}
        self._bytes: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def append(self, job: str, rank: int, records) -> int:
        """Adds ``(step, payload)`` records (a step logged again is replaced: a replayed
        step logs what it logged before). Returns the newest step held."""
        layout_lib.check_job_name(job)
        layout_lib.check_rank(rank)
        records = list(records)
        for step, payload in records:
            layout_lib.check_step(step)
            if len(payload) > self.options.max_record_bytes:
                raise InvalidArgument(
                    f"the log record of step {step} has {len(payload)} bytes; at most "
                    f"{self.options.max_record_bytes}: log what identifies the data, not the data")
        key = (job, rank)
        with self._lock:
            log = self._logs.setdefault(key, {})
            size = self._bytes.get(key, 0)
            for step, payload in records:
                size += len(payload) - len(log.get(step, b""))
                log[step] = bytes(payload)
            for step in sorted(log):
                if size <= self.options.max_rank_bytes:
                    break
                size -= len(log.pop(step))
            self._bytes[key] = size
            return max(log, default=-1)

    def read(self, job: str, rank: int, after_step: int) -> list[tuple[int, bytes]]:
        """The records of steps after ``after_step``, up to the first missing step."""
        layout_lib.check_job_name(job)
        layout_lib.check_rank(rank)
        if after_step < -1:
            raise InvalidArgument(f"after_step {after_step}: -1 reads the log from step 0")
        with self._lock:
            return contiguous(self._logs.get((job, rank), {}), after_step)

    def forget(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._logs if k[0] == job]:
                del self._logs[key]
                del self._bytes[key]

    def bytes_held(self) -> int:
        with self._lock:
            return sum(self._bytes.values())


def contiguous(records: dict[int, bytes], after_step: int) -> list[tuple[int, bytes]]:
    """``records`` (step -> payload) from ``after_step + 1`` on, stopping at a gap."""
    found, step = [], after_step + 1
    while step in records:
        found.append((step, records[step]))
        step += 1
    return found
