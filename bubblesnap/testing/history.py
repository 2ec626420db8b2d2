"""What a fault test saw, and whether it keeps the contract: a pure checker.

A test records, as they happen, the steps the job was told are committed
(with each rank's digest), the faults it made (and what the failure model
says survives each), the steps seen whole on the durable tier, every
restore (each rank's step and digest) and which daemon published under
which ring index when. :func:`violations` then says what broke the
contract, one line each:

- a restore returns a committed step, the same one for every rank (never a
  mixed step), each rank's bytes those committed (never a torn step); the ranks of
  one resume may be recorded one by one as each restores (:meth:`History.rank_restored`,
  grouped by the resume's name): every rank of one resume restored the same step;
- it is at least as new as the newest step that a fault before it keeps:
  the newest committed before that fault (``keeps="committed"``: one host
  lost, a partition, a frozen daemon), the newest durable one before it
  (``keeps="durable"``: every copy in memory of a step may be gone);
- no two daemons publish under one ring index at once.

    history = History()
    history.committed("job", 7, {0: digest0, 1: digest1})
    history.fault("host 1 killed", keeps="committed")
    history.restored("job", {0: 7, 1: 7}, {0: digest0, 1: digest1})
    assert not violations(history), violations(history)

Times are ``time.monotonic()`` unless given: record them from one process.
"""

import threading
import time
from dataclasses import dataclass, field

#: What a fault keeps, by the failure model: the newest committed step, the newest
#: durable one, or nothing (a restore may return any committed step, or none).
KEEPS = ("committed", "durable", "nothing")


@dataclass(frozen=True)
class Commit:
    job: str
    step: int
    digests: dict[int, str]  # rank -> digest of its state at the step
    at: float


@dataclass(frozen=True)
class Fault:
    what: str
    keeps: str
    at: float


@dataclass(frozen=True)
class Durable:
    job: str
    step: int
    at: float


@dataclass(frozen=True)
class Restore:
    job: str
    steps: dict[int, int]  # rank -> the step it got
    digests: dict[int, str]
    at: float


@dataclass(frozen=True)
class RankRestore:
    job: str
    resume: str  # which resume the rank's restore belongs to
    rank: int
    step: int
    digest: str
    at: float


@dataclass(frozen=True)
class Publication:
    index: int
    daemon: str  # who published (its address, its pid: anything that tells daemons apart)
    start: float
    end: float | None  # None: still publishing when the history was checked


@dataclass
class History:
    """Records of one test, appended from any thread."""

    commits: list[Commit] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    durables: list[Durable] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    rank_restores: list["RankRestore"] = field(default_factory=list)
    publications: list[Publication] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def committed(self, job: str, step: int, digests: dict[int, str],
                  at: float | None = None) -> None:
        """The job was told ``step`` is committed; ``digests``: each rank's state then."""
        self._add(self.commits, Commit(job, step, dict(digests), _now(at)))

    def fault(self, what: str, keeps: str = "committed", at: float | None = None) -> None:
        """A fault was made (or training stopped): what the failure model says survives."""
        if keeps not in KEEPS:
            raise ValueError(f"keeps={keeps!r}: one of {', '.join(KEEPS)}")
        self._add(self.faults, Fault(what, keeps, _now(at)))

    def durable(self, job: str, step: int, at: float | None = None) -> None:
        """``step`` of ``job`` was seen whole on the durable tier."""
        self._add(self.durables, Durable(job, step, _now(at)))

    def restored(self, job: str, steps: dict[int, int], digests: dict[int, str],
                 at: float | None = None) -> None:
        """A restore of the job gave each rank ``steps[rank]`` with ``digests[rank]``."""
        self._add(self.restores, Restore(job, dict(steps), dict(digests), _now(at)))

    def rank_restored(self, job: str, resume: str, rank: int, step: int, digest: str,
                      at: float | None = None) -> None:
        """One rank of the resume named ``resume`` restored ``step`` (``digest``): judged
        with the resume's other ranks as one restore (at the last rank's time)."""
        self._add(self.rank_restores, RankRestore(job, resume, rank, step, digest, _now(at)))

    def published(self, index: int, daemon: str, start: float,
                  end: float | None = None) -> None:
        """``daemon`` published under ring ``index`` from ``start`` to ``end``."""
        self._add(self.publications, Publication(index, daemon, start, end))

    def _add(self, records: list, record) -> None:
        with self._lock:
            records.append(record)


def _now(at: float | None) -> float:
    return time.monotonic() if at is None else at


def violations(history: History) -> list[str]:
    """Every way ``history`` breaks the contract, one line each; empty when it keeps it."""
    with history._lock:
        commits, faults = list(history.commits), list(history.faults)
        durables, restores = list(history.durables), list(history.restores)
        publications = list(history.publications)
        restores += _resumes(list(history.rank_restores))
    found = []
    for restore in restores:
        found += _restore_violations(restore, commits, faults, durables)
    found += _publication_violations(publications)
    return found


def _resumes(ranks: list[RankRestore]) -> list[Restore]:
    """The ranks recorded one by one, as one restore per resume."""
    grouped: dict[tuple[str, str], list[RankRestore]] = {}
    for one in ranks:
        grouped.setdefault((one.job, one.resume), []).append(one)
    return [Restore(job, {r.rank: r.step for r in rows}, {r.rank: r.digest for r in rows},
                    max(r.at for r in rows)) for (job, _), rows in sorted(grouped.items())]


def _restore_violations(restore: Restore, commits: list[Commit], faults: list[Fault],
                        durables: list[Durable]) -> list[str]:
    job = restore.job
    steps = set(restore.steps.values())
    if len(steps) > 1:
        return [f"{job}: a mixed restore (the ranks of one resume restored different steps): "
                f"ranks got steps {dict(sorted(restore.steps.items()))}"]
    if not steps:
        return []
    step = steps.pop()
    by_step = {c.step: c for c in commits if c.job == job and c.at <= restore.at}
    found = []
    if step not in by_step:
        found.append(f"{job}: restored step {step}, which was never committed before it")
    else:
        torn = sorted(r for r, d in restore.digests.items() if by_step[step].digests.get(r) != d)
        if torn:
            found.append(f"{job}: restored step {step} with bytes that are not those committed "
                         f"(ranks {torn})")
    floor, why = _floor(job, restore.at, commits, faults, durables)
    if step < floor:
        found.append(f"{job}: restored step {step}, older than step {floor}, which {why}")
    return found


def _floor(job: str, at: float, commits, faults, durables) -> tuple[int, str]:
    """The oldest step a restore at ``at`` may return, and why."""
    floor, why = -1, ""
    for fault in (f for f in faults if f.at <= at and f.keeps != "nothing"):
        kept = commits if fault.keeps == "committed" else durables
        newest = max((k.step for k in kept if k.job == job and k.at <= fault.at), default=-1)
        if newest > floor:
            floor, why = newest, f"was {fault.keeps} before '{fault.what}' (which keeps it)"
    return floor, why


def _publication_violations(publications: list[Publication]) -> list[str]:
    found = []
    ordered = sorted(publications, key=lambda p: (p.index, p.start))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b.index != a.index:
                break
            if b.daemon != a.daemon and (a.end is None or b.start < a.end):
                found.append(f"ring index {a.index}: {a.daemon} and {b.daemon} published under "
                             f"it at once (from {max(a.start, b.start):.3f})")
    return found
