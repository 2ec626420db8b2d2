"""Retention: which of a rank's copies to free, as pure functions of what is held.

The store keeps the newest ``keep_steps`` committed steps of a job. Below
the oldest of them every copy goes, unfinished ones included. With peers a
rank also caps the copies the group has not committed yet (see
:func:`beyond_cap`), so memory cannot grow while the group commits nothing.
No I/O, no locks: the store applies the answer.
"""

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class HeldStep:
    """What retention needs of one copy (the store's own copies have the same fields):
    ``local_since`` is when it became LOCAL, ``group_changed`` when a copy of its step
    last appeared in the group's holdings as this daemon gathered them (monotonic
    seconds)."""

    local: bool
    replicated: bool = False
    local_since: float = 0.0
    group_changed: float = 0.0


def oldest_kept(committed: Sequence[int], keep_steps: int) -> int:
    """The oldest committed step retention keeps; -1 when none is committed."""
    kept = committed[-keep_steps:]
    return kept[0] if kept else -1


def steps_to_free(steps: Mapping[int, HeldStep], committed: Sequence[int], keep_steps: int,
                  capped: bool, now: float = 0.0, grace_seconds: float = 0.0) -> set[int]:
    """The steps of one rank's copies ``steps`` to free, given the job's ``committed``
    steps (oldest first); ``capped``: the group, not this daemon, decides what is
    committed, so uncommitted copies are capped too, but only once they have been
    LOCAL, and the group's copies of their step unchanged, for ``grace_seconds`` at
    ``now``: the group may be committing a step this daemon has not seen committed yet
    (its view lags), and another daemon may already have reported it committed to a
    trainer. A step becomes whole when its last copy lands, maybe long after this
    copy did (replication behind); from then, this daemon sees it whole at its next
    gathering unless a copy went first, and the first copy to go is freed by a
    daemon that waited the grace after it saw that last copy land: it saw the step
    whole, and keeps it committed."""
    floor = oldest_kept(committed, keep_steps)
    drop = {s for s in steps if s < floor}
    if capped:
        settled = {s for s in beyond_cap(steps, keep_steps)
                   if now - max(steps[s].local_since, steps[s].group_changed) >= grace_seconds}
        drop |= settled - set(committed[-keep_steps:])
    return drop


def beyond_cap(steps: Mapping[int, HeldStep], keep_steps: int) -> set[int]:
    """LOCAL steps past what a rank keeps while the group has not committed them.

    Memory must not grow without bound when the group commits nothing (peers
    down, or replication behind training). A rank keeps its newest
    ``keep_steps + 2`` copies, and also its newest ``keep_steps`` replicated
    ones: under load, replication takes a few chosen steps (replicator.py),
    which stand a chance to be committed once the other ranks' copies of
    them are replicated too. (The group's kept committed steps are never
    freed by this cap: see :func:`steps_to_free`.)
    """
    local = sorted(s for s, held in steps.items() if held.local)
    replicated = [s for s in local if steps[s].replicated]
    return set(local[:-(keep_steps + 2)]) - set(replicated[-keep_steps:])
