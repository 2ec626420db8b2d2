"""Training logs and boundary logs: per job, rank and stream, one opaque record per step.

The training log (stream "") says what redoing a step exactly needs (the
batch's identity, RNG keys, a data-loader position); the daemon never reads
it. Its records live in the daemon's memory beside the snapshots and are
handed to the same peers before a record is acknowledged (peers/log_replication.py), so
after a crash the trainer restores a snapshot and replays the logged steps
after it up to the failure point (TranLogs).

Boundary logs (any other stream name) hold the tensors a pipeline stage sent
to a neighbour, one stream per kind and microbatch (Swift): when one stage
fails, it alone restores and replays with its inputs read from here. They
are larger and stay on the sender's host: the failed stage's inputs were
logged by its surviving neighbours.

Memory is bounded per job and rank: the oldest records go first. Boundary
records of the oldest snapshot kept in memory and older are dropped too: no
stage replaying alone starts before it.
"""

import dataclasses
import heapq
import logging
import re
import threading

from bubblesnap.options import require
from bubblesnap.service.errors import InvalidArgument
from bubblesnap.service.store import layout as layout_lib

log = logging.getLogger("bubblesnap.daemon")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogOptions:
    """Limits of the training and boundary logs (``bubblesnap daemon
    --training-log-budget/--boundary-log-budget``).

    Attributes:
      max_record_bytes: largest record accepted. Default 64 KiB: a record
        names data, it does not carry it.
      max_rank_bytes: training-log records kept per rank; the oldest are
        dropped beyond it (each record is charged its payload plus 64 bytes).
        Default 64 MiB.
      max_boundary_record_bytes: largest record of a boundary stream (one
        microbatch's activation or gradient). Default 16 MiB.
      max_boundary_rank_bytes: records kept in all of a rank's boundary
        streams together (a client names its streams: their number must not
        decide the memory used); the oldest step goes first. Default 1 GiB:
        replay needs only the steps since the oldest kept snapshot, and older
        records are dropped anyway (:meth:`TrainingLogs.drop_boundary_through`).
    """

    max_record_bytes: int = 64 << 10
    max_rank_bytes: int = 64 << 20
    max_boundary_record_bytes: int = 16 << 20
    max_boundary_rank_bytes: int = 1 << 30

    def __post_init__(self):
        for name, flag in (("max_rank_bytes", "--training-log-budget"),
                           ("max_boundary_rank_bytes", "--boundary-log-budget")):
            require(self, name, getattr(self, name) >= MIN_BUDGET,
                    f"at least 1.0 KiB ({MIN_BUDGET} bytes, to hold a record)", flag)
        for name in ("max_record_bytes", "max_boundary_record_bytes"):
            require(self, name, getattr(self, name) >= 1, "at least 1 byte")


#: The smallest log budget (per job and rank) the daemon accepts.
MIN_BUDGET = 1 << 10


#: The training log's stream name; every other name is a boundary log.
TRAINING = ""

_STREAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,63}")


#: Bytes of records one ReadLog answer carries at most; readers ask again after
#: the last step they got (gRPC messages are capped).
READ_BYTES = 8 << 20


class TrainingLogs:
    """Every job's and rank's records, in memory."""

    def __init__(self, options: LogOptions = LogOptions()):
        self.options = options
        self._logs: dict[tuple[str, int, str], dict[int, bytes]] = {}
        self._bytes: dict[tuple[str, int, str], int] = {}
        self._order: dict[tuple[str, int, str], list[int]] = {}  # steps, a heap, oldest first
        self._oldest_kept: dict[str, int] = {}  # job -> its oldest kept snapshot
        self._warned: set[tuple[str, int]] = set()  # (job, rank) told its budget is short
        self._lock = threading.Lock()

    def check(self, job: str, rank: int, records, stream: str = TRAINING) -> None:
        """Raises InvalidArgument for records :meth:`append` would refuse."""
        _key(job, rank, stream)
        o = self.options
        record, budget, flag, hint = (
            (o.max_record_bytes, o.max_rank_bytes, "--training-log-budget",
             "log what identifies the data, not the data") if stream == TRAINING else
            (o.max_boundary_record_bytes, o.max_boundary_rank_bytes, "--boundary-log-budget",
             "split the tensor over several streams"))
        # A record the rank's whole budget cannot hold would be dropped as it lands.
        limit = min(record, budget - _cost(b""))
        for step, payload in records:
            layout_lib.check_step(step)
            if len(payload) > limit:
                raise InvalidArgument(
                    f"the record of step {step} in log {stream or 'training'!r} has "
                    f"{len(payload)} bytes; at most {limit}: " + (
                        hint if limit == record else f"the daemon's {flag} is too small"))

    def append(self, job: str, rank: int, records, stream: str = TRAINING) -> int:
        """Adds ``(step, payload)`` records (a step logged again is replaced: a replayed
        step logs what it logged before). Returns the newest step held."""
        records = list(records)
        self.check(job, rank, records, stream)
        key = (job, rank, stream)
        with self._lock:
            log = self._logs.setdefault(key, {})
            order = self._order.setdefault(key, [])
            self._bytes.setdefault(key, 0)
            for step, payload in records:
                if step in log:
                    self._bytes[key] -= _cost(log[step])
                log[step] = bytes(payload)
                self._bytes[key] += _cost(payload)
                heapq.heappush(order, step)
            if stream == TRAINING:
                while self._bytes[key] > self.options.max_rank_bytes and order:
                    self._drop_oldest(key)
            else:
                self._bound_boundary_logs(job, rank)
            return max(log, default=-1)

    def _bound_boundary_logs(self, job: str, rank: int) -> None:
        """Drops the oldest boundary records of a rank, whichever streams hold them,
        while its streams together pass ``max_boundary_rank_bytes``."""
        streams = [k for k in self._logs if k[:2] == (job, rank) and k[2] != TRAINING]
        while sum(self._bytes[k] for k in streams) > self.options.max_boundary_rank_bytes:
            oldest = min((k for k in streams if self._order[k]),
                         key=lambda k: self._order[k][0])
            dropped = self._order[oldest][0]
            if dropped > self._oldest_kept.get(job, dropped) and (job, rank) not in self._warned:
                self._warned.add((job, rank))
                log.warning(
                    "rank %d of %s: the boundary-log budget dropped step %d, after the oldest "
                    "kept snapshot (step %d); a stage restored from that snapshot cannot replay "
                    "alone. Raise --boundary-log-budget above the bytes a rank logs between "
                    "its oldest kept snapshot and now", rank, job, dropped,
                    self._oldest_kept[job])
            self._drop_oldest(oldest)

    def _drop_oldest(self, key) -> None:
        oldest = heapq.heappop(self._order[key])
        log = self._logs[key]
        if oldest in log:  # a step logged twice sits in the heap twice
            self._bytes[key] -= _cost(log.pop(oldest))

    def drop_boundary_through(self, job: str, step: int) -> None:
        """Drops the job's boundary records of ``step`` and older: ``step`` is the
        job's oldest snapshot kept in memory (here and, with peers, in the group),
        and a stage replaying alone restores one of those and replays only what
        came after it. (A restore from the durable tier resumes the whole job.)"""
        with self._lock:
            if self._oldest_kept.get(job) == step:  # every commit asks; most move nothing
                return
            self._oldest_kept[job] = step
            for key in [k for k in self._logs if k[0] == job and k[2] != TRAINING]:
                while self._order[key] and self._order[key][0] <= step:
                    self._drop_oldest(key)

    def bytes_held(self) -> int:
        """What every record held is charged (payloads plus bookkeeping)."""
        with self._lock:
            return sum(self._bytes.values())

    def read(self, job: str, rank: int, after_step: int, max_bytes: int = READ_BYTES,
             stream: str = TRAINING, until_step: int | None = None) -> list[tuple[int, bytes]]:
        """The records of steps after ``after_step`` (through ``until_step``), up to the
        first missing step, at most about ``max_bytes`` of them (read again after the
        last one for more)."""
        return prefix(contiguous(self._copy(job, rank, after_step, stream, until_step),
                                 after_step), max_bytes)

    def held_after(self, job: str, rank: int, after_step: int,
                   max_bytes: int | None = READ_BYTES,
                   until_step: int | None = None) -> list[tuple[int, bytes]]:
        """Every training-log record of a step after ``after_step`` (through
        ``until_step``), gaps and all, oldest first (what a peer answers: the reader
        merges several peers' records before it looks for gaps); ``max_bytes=None``:
        all of them."""
        held = self._copy(job, rank, after_step, TRAINING, until_step)
        return prefix(sorted(held.items()), max_bytes)

    def forget(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._logs if k[0] == job]:
                del self._logs[key], self._bytes[key], self._order[key]
            self._oldest_kept.pop(job, None)
            self._warned = {w for w in self._warned if w[0] != job}

    def _copy(self, job: str, rank: int, after_step: int, stream: str,
              until_step: int | None) -> dict[int, bytes]:
        key = _key(job, rank, stream)
        if after_step < -1:
            raise InvalidArgument(f"after_step {after_step}: -1 reads the log from step 0")
        if until_step is not None and until_step <= after_step:
            raise InvalidArgument(f"until_step {until_step} must come after after_step "
                                  f"{after_step}: the read is of steps after_step+1..until_step")
        last = until_step if until_step is not None else float("inf")
        with self._lock:
            return {s: p for s, p in self._logs.get(key, {}).items() if after_step < s <= last}


def _key(job: str, rank: int, stream: str) -> tuple[str, int, str]:
    if stream != TRAINING and not _STREAM_NAME.fullmatch(stream):
        raise InvalidArgument(
            f"log stream {stream!r} is not allowed: use 1-64 characters from "
            "A-Z a-z 0-9 . _ / - starting with a letter or digit (\"\" is the training log)")
    return job, rank, stream


def _cost(payload: bytes) -> int:
    """Bytes a record is charged: its payload and a fixed share for the bookkeeping, so
    empty records are bounded too."""
    return len(payload) + 64


def prefix(records, max_bytes: int | None) -> list[tuple[int, bytes]]:
    """The first records that fit ``max_bytes`` (at least one); None: all."""
    if max_bytes is None:
        return list(records)
    found, total = [], 0
    for step, payload in records:
        total += _cost(payload)
        if found and total > max_bytes:
            break
        found.append((step, payload))
    return found


def contiguous(records: dict[int, bytes], after_step: int) -> list[tuple[int, bytes]]:
    """``records`` (step -> payload) from ``after_step + 1`` on, stopping at a gap."""
    found, step = [], after_step + 1
    while step in records:
        found.append((step, records[step]))
        step += 1
    return found
