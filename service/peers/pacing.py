"""Pure: when a new copy's push may go, so that its bytes cross the network in bubbles (BAFT).

A pipeline stage in a bubble waits for a neighbour's tensor: it sends no
activations or gradients then, so a push in that window does not compete with
the training's own traffic (nor, on a small host, for its cores). The daemon
learns its stages' bubbles from the Bubbles stream: a START arrives as a
bubble begins and says how long the stage expects it to last (else the
profile of that position says), an END (if the stage sends them) closes it,
and the profile's iteration length says when the same bubble comes again.
This host's network is idle while every stage reporting bubbles here is in
one. Times are seconds on the daemon's monotonic clock; nothing here reads it.
"""

import dataclasses
from collections.abc import Sequence

from bubblesnap.shared.options import require

#: A stage whose latest bubble is older than this many of its iterations stopped
#: reporting (it ended, or it left the pipeline): it no longer decides.
STALE_PERIODS = 3
#: ... but never sooner than this: a daemon at low priority on busy cores reads the
#: stream late, and short iterations would make a live stage look gone.
STALE_FLOOR_SECONDS = 1.0
#: The same, in seconds, for a stage whose iteration length is not known yet.
STALE_SECONDS = 5.0
#: Repeats of a bubble predicted at most: a broken period cannot make the work unbounded.
_MAX_REPEATS = 256

Window = tuple[float, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PacingOptions:
    """When this daemon pushes its new copies to peers (``bubblesnap daemon`` flags in brackets).

    Attributes:
      in_bubbles: hold each new copy's push until every stage reporting bubbles
        to this daemon is in one (``--pace-replication``). Default False: the
        push starts at the commit, which makes the step committed (1 + k copies)
        soonest. Pacing pays where the daemons' network also carries the
        pipeline's activations (docs/multihost/peers.md: half the step-time
        cost of unpaced pushes on a 1 Gbit/s link), at up to
        ``max_wait_seconds`` of commit latency and fewer steps replicated; on
        loopback with neighbouring stages as peers it raised step time more
        than unpaced pushes did (the receiver works while its own stage
        computes). Jobs that report no bubbles are never held.
      max_wait_seconds: the longest a committed copy is held back, from its
        commit: its push waits for a window, then each piece of its bytes (a
        copy larger than a bubble spans several) waits for one, until this
        much time passed; the rest goes at once (``--pace-max-wait``). At most
        60 s, well inside the transfer deadline. Default 2 s: longer than the
        iterations pipelines usually run, so windows come first, and short next
        to the snapshot interval a restore loses. The replicator's thread is
        busy meanwhile (its refresh of the group's holdings waits), as it is
        for any push.
    """

    in_bubbles: bool = False
    max_wait_seconds: float = 2.0

    def __post_init__(self):
        require(self, "max_wait_seconds", 0 <= self.max_wait_seconds <= 60,
                "from 0 to 60 seconds", "--pace-max-wait")


@dataclasses.dataclass(frozen=True)
class StageBubbles:
    """What the daemon knows of one stage's bubbles: those seen, as (start, end) oldest
    first (the end as expected when it opened, or as an END closed it), and the stage's
    iteration length (0: not known yet)."""

    seen: tuple[Window, ...]
    period: float = 0.0

    def live(self, now: float) -> bool:
        """Whether the stage still reports bubbles."""
        if not self.seen:
            return False
        age = now - self.seen[-1][0]
        if self.period <= 0:
            return age <= STALE_SECONDS
        return age <= max(STALE_PERIODS * self.period, STALE_FLOOR_SECONDS)

    def windows(self, until: float) -> list[Window]:
        """Its bubbles seen, and the latest one repeated every period up to ``until``."""
        found = list(self.seen)
        if self.period > 0 and found:
            start, end = found[-1]
            for _ in range(_MAX_REPEATS):
                if start + self.period >= until:
                    break
                start, end = start + self.period, end + self.period
                found.append((start, end))
        return found


def intersect(a: Sequence[Window], b: Sequence[Window]) -> list[Window]:
    """The times in both lists of windows (each sorted, not overlapping itself)."""
    found, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            found.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return found


def idle_windows(stages: Sequence[StageBubbles], now: float, until: float) -> list[Window]:
    """When every live stage is in a bubble, seen or predicted up to ``until``; empty
    when no stage is live."""
    live = [s for s in stages if s.live(now)]
    if not live:
        return []
    found = _merged(live[0].windows(until))
    for stage in live[1:]:
        found = intersect(found, _merged(stage.windows(until)))
    return found


def idle_state(stages: Sequence[StageBubbles], now: float, horizon: float
               ) -> tuple[bool, float]:
    """Whether every live stage is in a bubble now, and until when that stays so as far
    as is known: the end of this window, or the start of the next one predicted
    before ``horizon`` (else ``horizon``). A bubble seen meanwhile may change it."""
    for start, end in idle_windows(stages, now, horizon):
        if end > now:
            return (True, end) if start <= now else (False, min(start, horizon))
    return False, max(now, horizon)


def push_at(stages: Sequence[StageBubbles], now: float, deadline: float) -> float:
    """When to push a copy that must go by ``deadline``: ``now`` or earlier to go now,
    else the time to look again (new bubbles seen meanwhile are reason to look sooner).

    Now when no stage reports bubbles (nothing is known of idle times), inside an
    idle window, or once the deadline passed; also now when every stage's period is
    known and no window opens before the deadline (waiting would only delay it).
    Otherwise the next predicted window, or, with a period not known yet, the
    deadline (a START may come first).
    """
    live = [s for s in stages if s.live(now)]
    if not live or now >= deadline:
        return now
    upcoming = [w for w in idle_windows(live, now, deadline) if w[1] > now]
    if upcoming and upcoming[0][0] <= now:
        return now
    if upcoming and upcoming[0][0] < deadline:
        return upcoming[0][0]
    return deadline if any(s.period <= 0 for s in live) else now


def _merged(windows: Sequence[Window]) -> list[Window]:
    """Sorted, overlapping windows joined (a repeat predicted into a later bubble seen)."""
    found: list[Window] = []
    for start, end in sorted(windows):
        if found and start <= found[-1][1]:
            found[-1] = (found[-1][0], max(found[-1][1], end))
        else:
            found.append((start, end))
    return found
