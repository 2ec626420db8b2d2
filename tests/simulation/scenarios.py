"""Histories the simulation replays on purpose: a failure injected where an example injects it.

:class:`AfterCommitFailure` is ``examples/lossless.py --fail-point after-commit``
(one training process, its three stages' ranks on daemon 0, daemon 1 holding the
replicas): every rank begins snapshotting when it adopts the daemon's first plan,
which each stage hears at its own moment, and stage 0, which ends each iteration
last, is SIGKILLed (the whole job with it) at the end of the first iteration from
``fail_at`` on whose predecessor's commit it saw acknowledged. The job then
resumes from the newest step every rank can restore.

``fixed=False`` is the rule as it was: stage 0's acknowledgement alone. The job
may then fail before any step is whole anywhere: a resume finds nothing to
restore, and no contract was broken (nothing had been committed). ``fixed=True``
is the rule now: the failure also waits for the job's first committed step
(waiting for it once every rank holds a copy of one step).
"""

from tests.simulation.engine import Faults
from tests.simulation.group import Config, Group


class AfterCommitFailure(Group):
    def __init__(self, seed: int, fixed: bool, fail_at: int = 6):
        cfg = Config(daemons=2, world=3, placement=(0, 0, 0), first_step_after=(5, 7),
                     step_seconds=(0.08, 0.3), transfer_seconds=(0.002, 0.02),
                     host_loss_every=0, daemon_restart_every=0, job_failure_every=0,
                     faults=Faults(slow=0.0, drop=0.0))  # one machine's loopback
        self.fixed, self.fail_at = fixed, fail_at
        self.acknowledged: list[int] = []  # stage 0's commits
        self.failed_at: int | None = None
        super().__init__(seed, cfg)

    def commit_delay(self, rank: int) -> float:
        # stage 0 ends each iteration last and fetches its snapshot after that
        lag = self.cfg.step_seconds[1]
        return self.rng.uniform(lag, 2 * lag) if rank == 0 else self.rng.uniform(0.0, lag)

    def committed_by_trainer(self, rank: int, step: int) -> None:
        if rank == 0:
            self.acknowledged.append(step)

    def step_ended(self, step: int) -> None:
        if self.failed_at is None and self.run == 0 and step >= self.fail_at:
            # stage 0 ends the iteration a moment after the others
            self.sim.at(self.rng.uniform(0.0, self.cfg.step_seconds[1]),
                        lambda: self._maybe_fail(step))

    def _maybe_fail(self, step: int, waited: float = 0.0) -> None:
        if self.failed_at is not None or not self.training:
            return
        if self.fixed and self.newest_committed < 0:
            if not self._one_step_everywhere() or waited > 60:
                return  # the next iteration tries again
            self.sim.at(0.05, lambda: self._maybe_fail(step, waited + 0.05))
            return
        if self.acknowledged and self.acknowledged[-1] >= step - 1:
            self.failed_at = step
            self._fail_job()

    def _one_step_everywhere(self) -> bool:
        daemon = self.daemons[0]
        steps = {s for _, s in daemon.copies}
        return any(all((r, s) in daemon.copies for r in range(self.world)) for s in steps)

    def resumed(self) -> bool:
        return bool(self.restores)
