"""The bubbles this daemon's stages are in, and how its pushes fell into them.

The Bubbles stream tells :class:`IdleWindows` when each stage's bubble opens
(START) and closes (END, or the length expected); the replicator's thread asks
it to wait for the next idle window before a push, up to the bound, the
data channel's sending threads ask a :class:`PushGate` before each piece of
the push's bytes, and the replicator hands back how each push went, which
Status shows. The decisions are
:mod:`bubblesnap.service.peers.pacing`'s; this keeps the state under a lock.
"""

import collections
import dataclasses
import threading
import time

from bubblesnap.service.peers import pacing

#: Bubbles kept per stage: enough to judge a push that spans several iterations.
_SEEN = 64
#: Pushes kept per job for Status.
_KEPT = 64
#: A wait looks at the stop flag at least this often.
_POLL_SECONDS = 0.25
#: How far ahead a judgement of idleness is kept at most (stages go stale with time).
_STATE_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class Replication:
    """How one new copy held here went to the peers.

    ``waited_seconds``: held back for an idle window before the push began;
    ``push_seconds``: pushing to the peers (pieces held back included);
    ``idle_bytes``: of ``nbytes``, those sent while every stage reporting
    bubbles here was in one; ``copies_seconds``: from its commit here until
    the peers that took it acknowledged (1 + ``peers`` copies).
    """

    rank: int
    step: int
    nbytes: int
    paced: bool
    peers: int
    waited_seconds: float
    push_seconds: float
    idle_bytes: int
    copies_seconds: float


class PushGate:
    """One push's pieces: each waits for an idle window (pacing on) until the copy's
    deadline, and is counted as sent inside one or not. Called on sending threads,
    once per piece: the state found is kept until it may change (the window's end,
    the next one's start, a bubble seen), so a piece costs a lookup, not a judgement.

    ``holds_back``: whether pieces may be held back (pacing on); the data channel
    then keeps its send buffer to a piece, so the bytes let go are those that cross
    the link in the window, not a buffer's worth more after it.
    """

    def __init__(self, windows: "IdleWindows", since: float, stopping: threading.Event):
        self._windows, self._since, self._stopping = windows, since, stopping
        self.holds_back = windows.options.in_bubbles
        # after this the pieces go at once (pacing off: from the start)
        self._deadline = since + windows.options.max_wait_seconds if self.holds_back else 0.0
        self._lock = threading.Lock()
        self._idle, self._until, self._generation = False, 0.0, -1
        self.idle_bytes = 0

    def __call__(self, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            known = now < self._until and self._generation == self._windows.generation
            if known and (self._idle or now >= self._deadline):
                self.idle_bytes += nbytes if self._idle else 0
                return
        self._windows.wait(self._since, self._stopping)
        idle, until, generation = self._windows.state()
        with self._lock:
            self._idle, self._until, self._generation = idle, until, generation
            self.idle_bytes += nbytes if idle else 0


class IdleWindows:
    """Every stage's recent bubbles (fed by the Bubbles stream) and the pushes' record."""

    def __init__(self, options: pacing.PacingOptions = pacing.PacingOptions()):
        self.options = options
        self._seen: dict[tuple[str, int], collections.deque] = {}
        self._periods: dict[tuple[str, int], float] = {}
        self._pushes: dict[str, collections.deque] = {}
        self._changed = threading.Condition()
        self.generation = 0  # moves on with each bubble seen: a state judged before is old

    def observe(self, job: str, rank: int, opened: bool, seconds: float, period: float) -> None:
        """A bubble of ``rank`` opened now (``opened``), expected to last ``seconds`` (0:
        not known: it is used once it closes), or the one open closed now; ``period``:
        the rank's iteration length as profiled (0: not yet)."""
        now = time.monotonic()
        key = (job, rank)
        with self._changed:
            seen = self._seen.setdefault(key, collections.deque(maxlen=_SEEN))
            if period > 0:
                self._periods[key] = period
            if opened:
                seen.append((now, now + seconds))
            elif seen and seen[-1][0] <= now:
                seen[-1] = (seen[-1][0], now)
            self.generation += 1
            self._changed.notify_all()

    def wait(self, since: float, stopping: threading.Event) -> float:
        """Returns when a copy committed at ``since`` may be pushed (an idle window, no
        stage reporting bubbles, none due before ``max_wait_seconds`` after ``since``,
        or that bound reached); the seconds it waited. At once when pacing is off."""
        started = time.monotonic()
        if not self.options.in_bubbles:
            return 0.0
        deadline = since + self.options.max_wait_seconds
        with self._changed:
            while not stopping.is_set():
                now = time.monotonic()
                at = pacing.push_at(self._stages(), now, deadline)
                if at <= now:
                    break
                self._changed.wait(min(at - now, _POLL_SECONDS))
        return time.monotonic() - started

    def state(self) -> tuple[bool, float, int]:
        """Whether every stage reporting bubbles is in one now (False: none reports), until
        when that stays so (at most ``_STATE_SECONDS`` ahead: a stage may go stale), and
        the generation it was judged in (:attr:`generation` moves on with each bubble
        seen)."""
        with self._changed:
            now = time.monotonic()
            return (*pacing.idle_state(self._stages(), now, now + _STATE_SECONDS),
                    self.generation)

    def gate(self, since: float, stopping: threading.Event) -> PushGate:
        """The gate of the pieces of a push of a copy committed at ``since``."""
        return PushGate(self, since, stopping)

    def record(self, job: str, push: Replication) -> None:
        """Keeps how a push of ``job`` went (the latest few) for Status."""
        with self._changed:
            self._pushes.setdefault(job, collections.deque(maxlen=_KEPT)).append(push)

    def replications(self, job: str) -> list[Replication]:
        """The latest pushes of ``job``'s new copies, oldest first."""
        with self._changed:
            return list(self._pushes.get(job, ()))

    def forget(self, job: str) -> None:
        """``job`` was deleted: its stages and record go."""
        with self._changed:
            self._pushes.pop(job, None)
            for key in [k for k in self._seen if k[0] == job]:
                del self._seen[key]
                self._periods.pop(key, None)

    def _stages(self) -> list[pacing.StageBubbles]:
        # Bubbles of unknown length are left out until an END closes them.
        return [pacing.StageBubbles(tuple(w for w in seen if w[1] > w[0]),
                                    self._periods.get(key, 0.0))
                for key, seen in self._seen.items()]
