"""Which steps the local tier (steps held in the daemons' memory) saves and keeps: Orbax's
own save-decision and preservation policies, built from the local options as Orbax's
emergency manager builds its local manager's (``LocalCheckpointOptions``).

Pure: steps in, decisions out (no daemon, no folder).
"""

import dataclasses
import datetime

from orbax.checkpoint import checkpoint_manager as orbax_manager
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as preservation_lib
from orbax.checkpoint._src.checkpoint_managers import save_decision_policy as decision_lib
from orbax.checkpoint._src.metadata.checkpoint_info import CheckpointInfo


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalPolicy:
    """The local tier's policies.

    ``decision``: an Orbax ``SaveDecisionPolicy`` (which steps are saved);
    ``preservation``: an Orbax ``PreservationPolicy`` (which saved steps are kept).
    """

    decision: decision_lib.SaveDecisionPolicy
    preservation: preservation_lib.PreservationPolicy

    @classmethod
    def every(cls, interval: int, keep: int) -> "LocalPolicy":
        """Every ``interval``-th step, the newest ``keep`` kept (``memory_interval_steps``)."""
        return cls(decision=decision_lib.FixedIntervalPolicy(interval),
                   preservation=preservation_lib.LatestN(n=keep))

    @classmethod
    def of(cls, local) -> "LocalPolicy":
        """From Orbax's ``LocalCheckpointOptions`` (save_interval_steps, should_save_fn,
        save_decision_policy, max_to_keep, preservation_policy), as Orbax's emergency
        manager turns them into its local manager's policies."""
        options = orbax_manager.CheckpointManagerOptions(
            save_interval_steps=local.save_interval_steps,
            max_to_keep=local.max_to_keep,
            should_save_fn=local.should_save_fn,
            save_decision_policy=local.save_decision_policy,
            preservation_policy=local.preservation_policy)
        return cls(
            decision=local.save_decision_policy or
            orbax_manager._get_default_save_decision_policy(options),
            preservation=local.preservation_policy or
            orbax_manager._get_default_preservation_policy(options))

    def due(self, step: int, saved: list[tuple[int, float]],
            reached_preemption: bool = False) -> bool:
        """Whether ``step`` is saved, after the steps ``saved`` ((step, unix time), oldest
        first; none at or after ``step``, as Orbax's own should_save rules out), and
        whether the job reached a preemption sync point at it."""
        if saved and saved[-1][0] >= step:
            return False
        context = decision_lib.DecisionContext(
            is_saving_in_progress=False, reached_preemption=reached_preemption,
            multiprocessing_options=orbax_manager.MultiprocessingOptions())
        return bool(self.decision.should_save(_info(step, _now()),
                                              previous_steps=[_info(*s) for s in saved],
                                              context=context))

    def kept(self, saved: list[tuple[int, float]]) -> list[int]:
        """Which of the steps ``saved`` ((step, unix time), oldest first) are kept."""
        keep = self.preservation.should_preserve(
            [_info(*s) for s in saved], context=preservation_lib.PreservationContext())
        return [step for (step, _), kept in zip(saved, keep, strict=True) if kept]


def _info(step: int, when: float) -> CheckpointInfo:
    return CheckpointInfo(step=step, metrics=None,
                          time=datetime.datetime.fromtimestamp(when, datetime.timezone.utc))


def _now() -> float:
    return datetime.datetime.now(datetime.timezone.utc).timestamp()
