"""Per-job bubble profiles and plans: the daemon's side of the Bubbles stream.

Stages report each bubble's real length when it ends; this keeps a moving
average per (job, rank, position) of its length. A rank
counts as profiled once it has
reported two iterations; the first plan waits for that. Afterwards a report
that moves the rank's profile by more than ``replan_change`` (a stage got
slower, a bubble appeared) marks the job for replanning, done once at the next
bubble start. Answering a start is a lookup. The planning itself is
:mod:`bubblesnap.service.bubbles.planner`, pure functions.
"""

import dataclasses
import math
import random
import threading

from bubblesnap.service.bubbles import planner as planning
from bubblesnap.service.checks import MAX_BYTES, MAX_STEP
from bubblesnap.service.errors import InvalidArgument
from bubblesnap.shared.options import require

#: Positions number the waits of one iteration: 0..MAX_POSITION.
MAX_POSITION = 1 << 16
#: The longest bubble, iteration or fetch a report may state (11 days): longer is
#: a broken clock, and the profiles and plans stay finite.
MAX_SECONDS = 1e6
#: The fastest fetch a report may state (1 PB/s): faster is a broken clock.
MAX_BYTES_PER_SECOND = 1e15
_SWITCH_AHEAD = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class BubbleOptions:
    """How profiles are kept and when the daemon replans.

    Attributes:
      planner: the planner's own options.
      smoothing: weight of a new measurement in the moving averages. Default 0.3.
      replan_change: relative change of any bubble, the iteration length or the
        bandwidth that triggers a new plan. Default 0.25.
      initial_copy_bytes_per_second: fetch bandwidth assumed before one is
        measured; low on purpose, so the first plan does not overrun bubbles.
        Default 1 GB/s.
    """

    planner: planning.PlannerOptions = planning.PlannerOptions()
    smoothing: float = 0.3
    replan_change: float = 0.25
    initial_copy_bytes_per_second: float = 1e9

    def __post_init__(self):
        require(self, "smoothing", 0 < self.smoothing <= 1, "in (0, 1]")
        require(self, "replan_change", self.replan_change > 0, "positive")
        require(self, "initial_copy_bytes_per_second", self.initial_copy_bytes_per_second > 0,
                "positive")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BubbleEvent:
    """One message of a stage's Bubbles stream, as the planner reads it.

    ``start``: the stage is in a bubble (at ``position``, expected to last
    ``expected_seconds``, 0: not said) of ``iteration`` and holds plan
    ``plan_version``. Otherwise a report: the bubbles of ``iteration`` that
    ended, as (position, measured seconds), the iteration's length, and the
    bytes the stage fetched in ``copy_seconds``; ``end``: the report of the one
    bubble that ended just now.
    """

    job: str
    rank: int
    iteration: int
    start: bool = False
    end: bool = False
    position: int = 0
    expected_seconds: float = 0.0
    plan_version: int = 0
    reports: tuple[tuple[int, float], ...] = ()
    iteration_seconds: float = 0.0
    copied_bytes: int = 0
    copy_seconds: float = 0.0

    def __post_init__(self):
        """InvalidArgument unless every number is in its range: the profiles and the
        plans made of them only ever hold finite, bounded numbers."""
        if not 0 <= self.iteration < MAX_STEP:
            raise InvalidArgument(f"bubble event of iteration {self.iteration}: iterations "
                                  f"count from 0 to {MAX_STEP - 1}")
        if self.plan_version < 0:
            raise InvalidArgument(f"bubble event holding plan version {self.plan_version}: "
                                  "send the version of the plan received, 0 for none")
        if len(self.reports) > MAX_POSITION + 1:
            raise InvalidArgument(f"{len(self.reports)} bubble reports in one event; an "
                                  f"iteration has at most {MAX_POSITION + 1} positions")
        for position, measured in ((self.position, self.expected_seconds), *self.reports):
            if not 0 <= position <= MAX_POSITION:
                raise InvalidArgument(f"bubble position {position} is outside "
                                      f"0..{MAX_POSITION}; positions number the waits of "
                                      "one iteration")
            check_seconds("a bubble's measured_seconds or expected_seconds", measured)
        check_seconds("iteration_seconds", self.iteration_seconds)
        _check_bandwidth(self.copied_bytes, self.copy_seconds)


def check_seconds(what: str, value: float) -> None:
    """A duration a client measured: finite, 0 to MAX_SECONDS."""
    if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
        raise InvalidArgument(f"{what} of {value!r} seconds: send a finite number from 0 to "
                              f"{MAX_SECONDS:g}")


def _check_bandwidth(copied_bytes: int, copy_seconds: float) -> None:
    if not 0 <= copied_bytes <= MAX_BYTES:
        raise InvalidArgument(f"bubble report with copied_bytes {copied_bytes}: send 0 to "
                              f"{MAX_BYTES}")
    check_seconds("copy_seconds", copy_seconds)
    if copied_bytes and copy_seconds and copied_bytes / copy_seconds > MAX_BYTES_PER_SECOND:
        raise InvalidArgument(f"bubble report of {copied_bytes} bytes fetched in "
                              f"{copy_seconds!r} seconds, faster than "
                              f"{MAX_BYTES_PER_SECOND:g} bytes per second: a broken clock?")


@dataclasses.dataclass(frozen=True)
class RankAssignments:
    """One rank's plan as the client executes it."""

    interval: int
    version: int
    first_step: int  # the plan chooses steps from this one on
    # (offset, position) -> ((tensor, shard, start, stop), ...), and the commit point
    chunks: dict[tuple[int, int], tuple[tuple[int, int, int, int], ...]]
    commit_at: tuple[int, int] | None


@dataclasses.dataclass
class _Profile:
    bubbles: dict[int, float] = dataclasses.field(default_factory=dict)
    iteration_seconds: float = 0.0
    copy_bytes_per_second: float = 0.0
    iterations: set = dataclasses.field(default_factory=set)  # seen, up to two

    @property
    def ready(self) -> bool:
        return len(self.iterations) >= 2


@dataclasses.dataclass
class _JobPlans:
    profiles: dict[int, _Profile] = dataclasses.field(default_factory=dict)
    planned: dict[int, planning.RankProfile] = dataclasses.field(default_factory=dict)
    plan: planning.Plan | None = None
    slots: dict[int, tuple[tuple[int, int, int], ...]] = dataclasses.field(default_factory=dict)
    version: int = 0
    dirty: bool = False
    latest_iteration: int = -1  # the furthest any rank has reported
    first_step: int = 0


def _ema(old: float, new: float, weight: float) -> float:
    return new if old <= 0 else (1 - weight) * old + weight * new


def _moved(old: float, new: float, threshold: float) -> bool:
    return abs(new - old) > threshold * max(abs(old), 1e-9)


class BubblePlans:
    """Profiles and plans of every job that sends bubble events."""

    def __init__(self, slot_bytes, options: BubbleOptions = BubbleOptions()):
        """``slot_bytes(job, rank)`` returns (tensor, shard, nbytes) per slot."""
        self._slot_bytes = slot_bytes
        self.options = options
        self._jobs: dict[str, _JobPlans] = {}
        self._lock = threading.Lock()
        # Plan versions start at a random point, so a client of a restarted daemon
        # never mistakes a new plan for the one it holds.
        self._first_version = random.getrandbits(40) << 16
        self._on_bubble = []

    def listen(self, on_bubble) -> None:
        """``on_bubble(job, rank, opened, seconds, period)`` as a bubble opens (``opened``:
        expected to last ``seconds``, as the stage said or else as profiled; 0: not
        known) or closes (an END); ``period``: the rank's profiled iteration length (0:
        not yet). Called on the stream's thread, without the lock: it must be quick."""
        self._on_bubble.append(on_bubble)

    def handle(self, event: BubbleEvent) -> RankAssignments | None:
        """Folds a report into the rank's profile, or answers a start with the rank's plan
        if it holds an older one (None: nothing to send). The rank must be registered."""
        self._slot_bytes(event.job, event.rank)
        if self._on_bubble and (event.start or event.end):
            self._tell(event)
        if event.start:
            return self.answer_start(event.job, event.rank, event.plan_version, event.iteration)
        for position, measured in event.reports:
            self._record_end(event.job, event.rank, event.iteration, position, measured,
                             event.iteration_seconds)
        self._record_bandwidth(event.job, event.rank, event.copied_bytes, event.copy_seconds)
        return None

    def _tell(self, event: BubbleEvent) -> None:
        with self._lock:
            entry = self._jobs.get(event.job)
            profile = entry.profiles.get(event.rank) if entry else None
            expected = event.expected_seconds or (profile.bubbles.get(event.position, 0.0)
                                                  if profile else 0.0)
            period = profile.iteration_seconds if profile else 0.0
        for listener in self._on_bubble:
            listener(event.job, event.rank, event.start, expected, period)

    def record_end(self, job: str, rank: int, iteration: int, position: int,
                   measured_seconds: float, iteration_seconds: float) -> None:
        """Folds one finished bubble into the rank's profile (InvalidArgument for numbers
        out of range, as for a :class:`BubbleEvent`)."""
        BubbleEvent(job=job, rank=rank, iteration=iteration,
                    reports=((position, measured_seconds),),
                    iteration_seconds=iteration_seconds)
        self._record_end(job, rank, iteration, position, measured_seconds, iteration_seconds)

    def _record_bandwidth(self, job: str, rank: int, copied_bytes: int,
                          copy_seconds: float) -> None:
        if copied_bytes < self.options.planner.min_chunk_bytes or copy_seconds <= 0:
            return
        with self._lock:
            entry = self._job(job)
            profile = entry.profiles.setdefault(rank, _Profile())
            profile.copy_bytes_per_second = _ema(profile.copy_bytes_per_second,
                                                 copied_bytes / copy_seconds,
                                                 self.options.smoothing)
            self._mark_if_changed(job, entry, rank)

    def _record_end(self, job: str, rank: int, iteration: int, position: int,
                    measured_seconds: float, iteration_seconds: float) -> None:
        weight = self.options.smoothing
        with self._lock:
            entry = self._job(job)
            profile = entry.profiles.setdefault(rank, _Profile())
            if len(profile.iterations) < 2:
                profile.iterations.add(iteration)
            entry.latest_iteration = max(entry.latest_iteration, iteration)
            profile.bubbles[position] = _ema(profile.bubbles.get(position, 0.0),
                                             measured_seconds, weight)
            if iteration_seconds > 0:
                profile.iteration_seconds = _ema(profile.iteration_seconds, iteration_seconds,
                                                 weight)
            self._mark_if_changed(job, entry, rank)

    def answer_start(self, job: str, rank: int, known_version: int,
                     iteration: int = -1) -> RankAssignments | None:
        """The rank's current plan if it holds an older one (else None: nothing to send)."""
        with self._lock:
            entry = self._job(job)
            entry.latest_iteration = max(entry.latest_iteration, iteration)
            if entry.dirty:
                self._replan(job, entry)
            if entry.plan is None or known_version == entry.version:
                return None
            rank_plan = entry.plan.ranks.get(rank)
            if rank_plan is None:
                return RankAssignments(entry.plan.interval, entry.version, entry.first_step, {},
                                       None)
            slots = entry.slots[rank]
            chunks = {key: tuple((slots[c.slot][0], slots[c.slot][1], c.start, c.stop)
                                 for c in assigned)
                      for key, assigned in rank_plan.assignments.items()}
            return RankAssignments(entry.plan.interval, entry.version, entry.first_step, chunks,
                                   rank_plan.commit_at)

    def plan_of(self, job: str) -> tuple[planning.Plan | None, dict, int]:
        """The current plan, the profiles it was made from, and its version."""
        with self._lock:
            entry = self._jobs.get(job)
            if entry is None:
                return None, {}, 0
            return entry.plan, dict(entry.planned), entry.version

    def forget(self, job: str) -> bool:
        """Drops the job's profiles and plan; whether there were any."""
        with self._lock:
            return self._jobs.pop(job, None) is not None

    def _job(self, job: str) -> _JobPlans:
        entry = self._jobs.get(job)
        if entry is None:
            entry = self._jobs[job] = _JobPlans(version=self._first_version)
        return entry

    def _rank_profile(self, job: str, entry: _JobPlans, rank: int) -> planning.RankProfile:
        if rank not in entry.slots:
            entry.slots[rank] = self._slot_bytes(job, rank)
        p = entry.profiles[rank]
        return planning.RankProfile(
            bubbles=tuple(sorted(p.bubbles.items())), iteration_seconds=p.iteration_seconds,
            copy_bytes_per_second=p.copy_bytes_per_second
            or self.options.initial_copy_bytes_per_second,
            slot_bytes=tuple(n for _, _, n in entry.slots[rank]))

    def _replan(self, job: str, entry: _JobPlans) -> None:
        """Plans every profiled rank of the job again (they share one interval)."""
        entry.dirty = False
        current = {rank: self._rank_profile(job, entry, rank)
                   for rank, p in entry.profiles.items() if p.ready}
        entry.plan = planning.plan(current, self.options.planner)
        entry.planned = current
        entry.version += 1
        # Far enough ahead that every rank has the plan before it applies (pipeline
        # stages run at most a couple of iterations apart).
        entry.first_step = entry.latest_iteration + _SWITCH_AHEAD

    def _mark_if_changed(self, job: str, entry: _JobPlans, rank: int) -> None:
        """Marks the job for replanning if this rank's profile moved (lock held)."""
        if entry.profiles[rank].ready and not entry.dirty:
            planned = entry.planned.get(rank)
            entry.dirty = planned is None or self._changed(
                planned, self._rank_profile(job, entry, rank))

    def _changed(self, old: planning.RankProfile, new: planning.RankProfile) -> bool:
        threshold = self.options.replan_change
        old_bubbles, new_bubbles = dict(old.bubbles), dict(new.bubbles)
        if old_bubbles.keys() != new_bubbles.keys() or old.slot_bytes != new.slot_bytes:
            return True
        return (any(_moved(old_bubbles[k], new_bubbles[k], threshold) for k in new_bubbles)
                or _moved(old.iteration_seconds, new.iteration_seconds, threshold)
                or _moved(old.copy_bytes_per_second, new.copy_bytes_per_second, threshold))
