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
stage replaying alone starts before it. All records together are bounded
once more (``--log-budget``): like ``--memory-budget``, records that would
pass it are refused (RESOURCE_EXHAUSTED) and everything held is kept, so one
job's records never push out another's.
"""

import dataclasses
import heapq
import logging
import re
import threading

from bubblesnap.service import checks
from bubblesnap.service.errors import InvalidArgument, ResourceExhausted, shown
from bubblesnap.shared.options import require

log = logging.getLogger("bubblesnap.daemon")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogOptions:
    """Limits of the training and boundary logs (``bubblesnap daemon
    --training-log-budget/--boundary-log-budget/--log-budget``).

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
      max_total_bytes: records of every job, rank and stream together, held
        apart from the memory budget (``--log-budget``). Records that would
        pass it are refused with RESOURCE_EXHAUSTED and what is held is kept
        (a rank's own budgets drop its oldest records first, and their drops
        count). Default 8 GiB.
    """

    max_record_bytes: int = 64 << 10
    max_rank_bytes: int = 64 << 20
    max_boundary_record_bytes: int = 16 << 20
    max_boundary_rank_bytes: int = 1 << 30
    max_total_bytes: int = 8 << 30

    def __post_init__(self):
        for name, flag in (("max_rank_bytes", "--training-log-budget"),
                           ("max_boundary_rank_bytes", "--boundary-log-budget"),
                           ("max_total_bytes", "--log-budget")):
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
        # (job, rank, training log or not) -> bytes: what each per-rank budget bounds
        self._rank_bytes: dict[tuple[str, int, bool], int] = {}
        self._total = 0
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
        if o.max_total_bytes < budget:
            budget, flag = o.max_total_bytes, "--log-budget"
        limit = min(record, budget - _cost(b""))
        for step, payload in records:
            checks.check_step(step)
            if len(payload) > limit:
                raise InvalidArgument(
                    f"the record of step {step} in log {stream or 'training'!r} has "
                    f"{len(payload)} bytes; at most {limit}: " + (
                        hint if limit == record else f"the daemon's {flag} is too small"))

    def append(self, job: str, rank: int, records, stream: str = TRAINING) -> int:
        """Adds ``(step, payload)`` records (a step logged again is replaced: a replayed
        step logs what it logged before). Returns the newest step held."""
        return self.append_all([(job, rank, records, stream)])[0]

    def append_all(self, logs) -> list[int]:
        """Adds the records of several ``(job, rank, records, stream)`` logs, all or none:
        InvalidArgument for a bad record anywhere, ResourceExhausted when they would
        pass ``max_total_bytes``. Returns the newest step held, per log."""
        logs = [(job, rank, list(records), stream) for job, rank, records, stream in logs]
        for job, rank, records, stream in logs:
            self.check(job, rank, records, stream)
        with self._lock:
            growth = self._growth(logs)
            if growth > 0 and self._total + growth > self.options.max_total_bytes:
                raise ResourceExhausted(
                    f"{growth} more bytes of log records would pass the daemon's log budget "
                    f"(--log-budget {self.options.max_total_bytes} bytes; "
                    f"{self._total} held): nothing was logged. Raise --log-budget, lower the "
                    "per-rank --training-log-budget/--boundary-log-budget, or delete the "
                    "snapshots (and logs) of finished jobs")
            return [self._add(*entry) for entry in logs]

    def _growth(self, logs) -> int:
        """How much the records held grow when ``logs`` are added, at most: a rank's
        own budgets drop its oldest records, so its bytes end at its budget at most."""
        grown: dict[tuple[str, int, bool], int] = {}
        costs: dict[tuple[tuple[str, int, str], int], int] = {}  # what a step costs by now
        for job, rank, records, stream in logs:
            key, held = (job, rank, stream), self._logs.get((job, rank, stream), {})
            group = (job, rank, stream == TRAINING)
            for step, payload in records:
                before = costs.get((key, step), _cost(held[step]) if step in held else 0)
                costs[(key, step)] = _cost(payload)
                grown[group] = grown.get(group, 0) + _cost(payload) - before
        growth = 0
        for group, more in grown.items():
            now = self._rank_bytes.get(group, 0)
            budget = self.options.max_rank_bytes if group[2] else \
                self.options.max_boundary_rank_bytes
            growth += min(now + more, budget) - now
        return growth

    def _add(self, job: str, rank: int, records, stream: str) -> int:
        key = (job, rank, stream)
        if not records:
            return max(self._logs.get(key, ()), default=-1)
        log = self._logs.setdefault(key, {})
        order = self._order.setdefault(key, [])
        self._bytes.setdefault(key, 0)
        for step, payload in records:
            if step in log:
                self._charge(key, -_cost(log[step]))
            log[step] = bytes(payload)
            self._charge(key, _cost(payload))
            heapq.heappush(order, step)
        if stream == TRAINING:
            while key in self._logs and self._bytes[key] > self.options.max_rank_bytes:
                self._drop_oldest(key)
        else:
            self._bound_boundary_logs(job, rank)
        return max(self._logs.get(key, ()), default=-1)

    def _charge(self, key: tuple[str, int, str], nbytes: int) -> None:
        group = (key[0], key[1], key[2] == TRAINING)
        self._bytes[key] += nbytes
        self._rank_bytes[group] = self._rank_bytes.get(group, 0) + nbytes
        if not self._rank_bytes[group]:
            del self._rank_bytes[group]
        self._total += nbytes

    def _bound_boundary_logs(self, job: str, rank: int) -> None:
        """Drops the oldest boundary records of a rank, whichever streams hold them,
        while its streams together pass ``max_boundary_rank_bytes``."""
        streams = [k for k in self._logs if k[:2] == (job, rank) and k[2] != TRAINING]
        while self._rank_bytes.get((job, rank, False), 0) > \
                self.options.max_boundary_rank_bytes:
            oldest = min((k for k in streams if k in self._logs),
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
        """Drops the oldest record of a log; a log left empty goes whole (stream names
        are the client's: empty ones must not pile up)."""
        oldest = heapq.heappop(self._order[key])
        log = self._logs[key]
        if oldest in log:  # a step logged twice sits in the heap twice
            self._charge(key, -_cost(log.pop(oldest)))
        if not log:
            del self._logs[key], self._bytes[key], self._order[key]

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
                while key in self._logs and self._order[key][0] <= step:
                    self._drop_oldest(key)

    def bytes_held(self) -> int:
        """What every record held is charged (payloads plus bookkeeping)."""
        with self._lock:
            return self._total

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

    def forget(self, job: str) -> bool:
        """Drops every record of ``job``; whether there were any (a store listener: a
        deleted job's logs go with it)."""
        with self._lock:
            keys = [k for k in self._logs if k[0] == job]
            for key in keys:
                self._charge(key, -self._bytes[key])
                del self._logs[key], self._bytes[key], self._order[key]
            self._oldest_kept.pop(job, None)
            self._warned = {w for w in self._warned if w[0] != job}
            return bool(keys)

    def _copy(self, job: str, rank: int, after_step: int, stream: str,
              until_step: int | None) -> dict[int, bytes]:
        key = _key(job, rank, stream)
        last = until_step if until_step is not None else float("inf")
        with self._lock:
            return {s: p for s, p in self._logs.get(key, {}).items() if after_step < s <= last}


def _key(job: str, rank: int, stream: str) -> tuple[str, int, str]:
    if stream != TRAINING and not _STREAM_NAME.fullmatch(stream):
        raise InvalidArgument(
            f"log stream {shown(stream)} is not allowed: use 1-64 characters from "
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
