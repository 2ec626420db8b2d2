"""Which pipeline boundaries to log (Swift's selective logging): pure functions.

Logging every tensor that crosses a stage boundary lets one failed stage
replay alone, but the log grows by every activation and gradient of every
microbatch, each step. Swift groups adjacent stages and logs only the
boundaries between groups: a failure rolls back the failed stage's whole
group (its stages restore and replay together, exchanging live inside the
group and reading the group's edges from the log), and the others keep
their state.

:func:`plan_log_groups` starts from one group per stage and greedily merges
the adjacent pair that adds the least expected replay time per logged byte
saved, until the log fits the budget. :func:`trade_off` lists every plan
along that path, from "log everything" to "log nothing" (one group: the
whole pipeline rolls back, as with no boundary log at all).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LogPlan:
    """Stage groups and what logging their edges costs.

    Attributes:
      groups: consecutive stage indices, e.g. ((0,), (1, 2)).
      logged_boundaries: boundary b (between stage b and b + 1) is logged.
      log_bytes_per_step: bytes those boundaries add to the log each step.
      expected_replay_seconds_per_step: replay time per step to redo after a
        failure, averaged over which stage fails (each equally likely).
    """

    groups: tuple[tuple[int, ...], ...]
    logged_boundaries: tuple[int, ...]
    log_bytes_per_step: int
    expected_replay_seconds_per_step: float

    def group_of(self, stage: int) -> tuple[int, ...]:
        """The stages that roll back when ``stage`` fails."""
        for group in self.groups:
            if stage in group:
                return group
        raise ValueError(f"stage {stage} is not one of the plan's {len(self.groups)} groups' "
                         f"stages {[s for g in self.groups for s in g]}")


def plan_log_groups(boundary_bytes, stage_seconds, budget_bytes: int,
                    microbatches: int = 1) -> LogPlan:
    """The plan with the fewest merges whose log fits ``budget_bytes`` per step.

    ``boundary_bytes[b]``: bytes crossing boundary b each step (activations
    forward plus gradients back); ``stage_seconds[s]``: stage s's compute per
    step. A group replays as a small pipeline: its slowest stage's time plus
    the others' over ``microbatches`` (the fill and drain).
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes {budget_bytes} is negative; 0 logs no boundary")
    return _merges(boundary_bytes, stage_seconds, microbatches, budget_bytes)[-1]


def trade_off(boundary_bytes, stage_seconds, microbatches: int = 1) -> list[LogPlan]:
    """Every plan the greedy merging passes through, most log first."""
    return _merges(boundary_bytes, stage_seconds, microbatches, budget_bytes=-1)


def _merges(boundary_bytes, stage_seconds, microbatches: int, budget_bytes: int):
    stages = len(stage_seconds)
    if len(boundary_bytes) != stages - 1:
        raise ValueError(f"{stages} stages have {stages - 1} boundaries; "
                         f"got {len(boundary_bytes)} boundary sizes")
    if microbatches < 1 or any(b < 0 for b in boundary_bytes) or any(
            t < 0 for t in stage_seconds):
        raise ValueError("sizes, times and microbatches must not be negative "
                         "(microbatches at least 1)")
    groups = [(s,) for s in range(stages)]
    plans = [_plan(groups, boundary_bytes, stage_seconds, microbatches)]
    while plans[-1].log_bytes_per_step > budget_bytes and len(groups) > 1:
        now = plans[-1].expected_replay_seconds_per_step
        # the merge adding the least replay time per byte no longer logged
        i = min(range(len(groups) - 1), key=lambda i, groups=groups: (
            _expected(_merge(groups, i), stage_seconds, microbatches) - now)
            / max(boundary_bytes[groups[i][-1]], 1))
        groups = _merge(groups, i)
        plans.append(_plan(groups, boundary_bytes, stage_seconds, microbatches))
    return plans


def _merge(groups, i: int) -> list[tuple[int, ...]]:
    """``groups`` with group i and i + 1 made one."""
    return [*groups[:i], groups[i] + groups[i + 1], *groups[i + 2:]]


def _plan(groups, boundary_bytes, stage_seconds, microbatches: int) -> LogPlan:
    logged = tuple(g[-1] for g in groups[:-1])
    return LogPlan(tuple(groups), logged, sum(boundary_bytes[b] for b in logged),
                   _expected(groups, stage_seconds, microbatches))


def _expected(groups, stage_seconds, microbatches: int) -> float:
    stages = len(stage_seconds)
    total = 0.0
    for g in groups:
        times = [stage_seconds[s] for s in g]
        replay = max(times) + (sum(times) - max(times)) / microbatches
        total += len(g) / stages * replay
    return total
