"""Adoption: a restarted daemon takes over the copies a killed one left in its --shm-dir.

At start, before it serves anything, the store claims every directory a dead
daemon left (segments.py) and, for each segment in it that has a record
(persistence.py), reads the record, maps the segment and verifies every slot
against the recorded checksums. A copy that passes becomes a LOCAL copy of
this daemon, counted in its budget, freed by its retention and pinned like any
other; its segment is marked handed out (a trainer may still map it: a copy it
restored), so it is never recycled, only unlinked when freed.

Dropped, and unlinked: segments without a record (being staged or arriving
when the daemon died, pooled, or assembled for a restore; a trainer that
maps one keeps its mapping), records cut short (``.tmp``: the daemon died
writing one) or without a segment, copies whose record cannot be read or
does not fit the segment, copies that fail their checksums, a second copy of
the same (job, rank, step), and, oldest steps first, copies beyond the memory
budget. Kept as they are, and reported: records of a newer format version
with their segments, and files this daemon does not know.

Registrations are not files: each adopted rank gets the layout and replica
group of its newest copy (none when that copy is of an earlier epoch), so a
trainer re-registering the same layout reattaches to its copies, and a
restore before any registration finds them as a replacement host's does.
"""

import collections
import dataclasses
import logging
import os
import time

from bubblesnap.protos.checksum import checksum
from bubblesnap.service.store import persistence, segments
from bubblesnap.service.store.model import CopyState, Rank, RankStep, mismatches
from bubblesnap.service.store.persistence import CopyRecord
from bubblesnap.service.store.segments import Segment
from bubblesnap.service.store.state import StoreState

log = logging.getLogger("bubblesnap.daemon")

#: Examples of each reason a log line names (the whole list is in Status).
_LOGGED_EXAMPLES = 3


@dataclasses.dataclass(frozen=True)
class AdoptedCopy:
    """A copy a killed daemon committed, verified and now held here."""

    job: str
    rank: int
    step: int
    nbytes: int
    replica: bool


@dataclasses.dataclass(frozen=True)
class LeftFile:
    """A file of a dead daemon's directory that was not adopted, and why."""

    path: str
    reason: str
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class Adoption:
    """What a daemon took over when it started (nothing: no dead daemon's directory)."""

    directories: tuple[str, ...] = ()  # the dead daemons' directories, as renamed on claim
    adopted: tuple[AdoptedCopy, ...] = ()
    dropped: tuple[LeftFile, ...] = ()  # removed
    kept: tuple[LeftFile, ...] = ()     # left on disk untouched
    seconds: float = 0.0

    @property
    def adopted_bytes(self) -> int:
        return sum(c.nbytes for c in self.adopted)

    @property
    def dropped_bytes(self) -> int:
        return sum(f.nbytes for f in self.dropped)


@dataclasses.dataclass
class _Found:
    """A verified copy waiting to be adopted."""

    record: CopyRecord
    segment: Segment


class _Scan:
    """The files of the claimed directories, sorted into adopted, dropped and kept."""

    def __init__(self, state: StoreState):
        self._state = state
        self._recorded: list[tuple[str, CopyRecord]] = []  # segments with a record
        self.found: list[_Found] = []  # verified
        self.dropped: list[LeftFile] = []
        self.kept: list[LeftFile] = []

    def directory(self, directory: str) -> None:
        names = set(os.listdir(directory)) - {segments.LOCK_NAME}
        for name in sorted(names):
            path = os.path.join(directory, name)
            if name.endswith(persistence.TEMP_SUFFIX):
                self.drop(path, "a record cut short (the daemon died writing it)")
            elif name.endswith(persistence.SUFFIX):
                if name[:-len(persistence.SUFFIX)] not in names:
                    self._stray(path)
            elif not _is_segment(name):
                self._keep("not a file of this daemon's format", path)
            elif name + persistence.SUFFIX not in names:
                self.drop(path, "no record: being written or arriving when the daemon died, "
                          "pooled, or a restore's")
            else:
                self._record(path)

    def drop(self, path: str, reason: str, segment: Segment | None = None) -> None:
        """Removes a segment (or stray file) and its record."""
        self.dropped.append(LeftFile(path, reason, segment.nbytes if segment else _size(path)))
        if segment is not None:
            segment.destroy()
        else:
            segments.unlink(path)
        persistence.remove(path)

    def verify(self) -> None:
        """Maps the recorded segments and checks them against their records, several at
        once on the store's hashers (mapping a segment costs more than hashing it)."""
        outcomes = self._state.hashers.map(_verified, self._recorded)
        for (path, record), (segment, problem) in zip(self._recorded, outcomes, strict=True):
            if problem:
                self.drop(path, problem, segment)
            else:
                self.found.append(_Found(record, segment))

    def _stray(self, path: str) -> None:
        """A record without its segment: dropped, unless a newer daemon wrote it."""
        try:
            persistence.read(path)
        except persistence.NewerVersion as err:
            self._keep(f"a record of {err}", path)
            return
        except persistence.Unreadable:
            pass
        self.drop(path, "a record without its segment")

    def _record(self, path: str) -> None:
        meta = persistence.path_of(path)
        try:
            self._recorded.append((path, persistence.read(meta)))
        except persistence.NewerVersion as err:
            self._keep(f"a record of {err}", path, meta)
        except persistence.Unreadable as err:
            self.drop(path, str(err))

    def _keep(self, reason: str, *paths: str) -> None:
        """Files this daemon cannot read (a newer daemon's): left on disk as they are,
        even at this one's stop; reported as the first of them."""
        for path in paths:
            self._state.memory.pool.keep(path)
        self.kept.append(LeftFile(paths[0], reason, _size(paths[0])))


def _verified(recorded: tuple[str, CopyRecord]) -> tuple[Segment | None, str]:
    """The segment of a record, mapped, and what is wrong with it ("": nothing)."""
    path, record = recorded
    try:
        segment = Segment.existing(path)
    except (OSError, ValueError) as err:
        return None, f"the segment cannot be mapped: {err}"
    what = f"step {record.step} of rank {record.rank} of job {record.job!r}"
    if segment.nbytes != record.layout.segment_bytes:
        return segment, (f"{what}: a segment of {segment.nbytes} bytes, its record says "
                         f"{record.layout.segment_bytes}")
    computed = [checksum(segment.view[o:o + n]) for _, _, o, n in record.layout.slots()]
    bad = mismatches(record.checksums, computed)
    if bad:
        named = RankStep(segment, CopyState.LOCAL, record.layout, record.world_size,
                         record.group).slot_names(bad[:4])
        return segment, f"{what} failed its checksum on {named}"
    return segment, ""


def adopt(state: StoreState) -> Adoption:
    """Takes over what dead daemons left in the store's shm dir (see the module
    docstring). Runs before the store serves anything."""
    started = time.monotonic()
    directories = state.memory.pool.claim_dead()
    scan = _Scan(state)
    for directory in directories:
        scan.directory(directory)
    scan.verify()
    adopted = _install(state, _fitting(state, scan))
    state.memory.pool.prune()
    adoption = Adoption(tuple(directories), tuple(adopted), tuple(scan.dropped),
                        tuple(scan.kept), time.monotonic() - started)
    if directories:
        _log(adoption)
    return adoption


def _fitting(state: StoreState, scan: _Scan) -> list[_Found]:
    """The verified copies to adopt: one per (job, rank, step), newest steps first while
    the budget has room; the others are dropped."""
    chosen, seen, room = [], set(), state.memory.budget_bytes - state.memory.used_bytes
    for found in sorted(scan.found, key=lambda f: (-f.record.step, f.segment.path)):
        record, path = found.record, found.segment.path
        key = (record.job, record.rank, record.step)
        what = f"step {record.step} of rank {record.rank} of job {record.job!r}"
        if key in seen:
            scan.drop(path, f"a second copy of {what}", found.segment)
        elif found.segment.nbytes > room:
            scan.drop(path, f"{what} does not fit the memory budget", found.segment)
        else:
            seen.add(key)
            room -= found.segment.nbytes
            chosen.append(found)
    return chosen


def _install(state: StoreState, chosen: list[_Found]) -> list[AdoptedCopy]:
    """Makes the chosen copies this daemon's, oldest first, so each job's and rank's
    newest copy has the last word on its world size, layout and group."""
    adopted = []
    for found in sorted(chosen, key=lambda f: f.record.step):
        record = found.record
        entry = state.jobs.get(record.job) or state.new_job(record.job, record.job_world_size)
        entry.world_size = record.job_world_size
        entry.awaiting_group = state.grouped
        held = entry.ranks.setdefault(record.rank, Rank(None, record.group))
        current = record.replica or record.world_size == record.job_world_size
        held.layout = record.layout if current else None
        held.group, held.replica = record.group, record.replica
        held.steps[record.step] = RankStep(found.segment, CopyState.LOCAL, record.layout,
                                           record.world_size, record.group, record.checksums,
                                           replicated=record.replicated)
        state.memory.adopt(found.segment)
        adopted.append(AdoptedCopy(record.job, record.rank, record.step, found.segment.nbytes,
                                   record.replica))
    return adopted


def _log(adoption: Adoption) -> None:
    jobs = sorted({c.job for c in adoption.adopted})
    log.info("adopted %d copies (%.1f MiB) of jobs %s from %s, left by a killed daemon, in "
             "%.3f s", len(adoption.adopted), adoption.adopted_bytes / 2**20, jobs,
             ", ".join(adoption.directories), adoption.seconds)
    by_reason = collections.defaultdict(list)
    for left in adoption.dropped:
        by_reason[left.reason].append(os.path.basename(left.path))
    for reason, names in sorted(by_reason.items()):
        log.warning("dropped %d file(s) (%s%s): %s", len(names),
                    ", ".join(names[:_LOGGED_EXAMPLES]),
                    " ..." if len(names) > _LOGGED_EXAMPLES else "", reason)
    for left in adoption.kept:
        log.warning("left %s untouched: %s", left.path, left.reason)


def _is_segment(name: str) -> bool:
    return name.startswith("seg-") and name[4:].isdigit()


def _size(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0
