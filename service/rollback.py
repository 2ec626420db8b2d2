"""An abandoned run's copies dropped: here, at every peer, and from the durable tier.

A job that goes back to a step (a restore that resumes it, a CheckpointManager that
saves a step anew after a restart: the DropAfter call) makes every copy of a later step
an abandoned run's: kept, it could be served as this run's, or mixed with this run's
copies of the same step. They are dropped before the job goes on.
"""

import logging
import threading

import grpc

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.checks import is_folder_job
from bubblesnap.service.peers import resume_rule

log = logging.getLogger("bubblesnap.daemon")


class Rollbacks:
    """Drops a job's later copies; ``replicator``, ``writer`` and ``group`` may be None.
    Remembers the step each job's last resume (a restore without a step) went back to:
    the other ranks of that resume take it (peers/resume_rule.py)."""

    def __init__(self, store, group=None, replicator=None, writer=None):
        self._store, self._group = store, group
        self._replicator, self._writer = replicator, writer
        self._resumed: dict[str, resume_rule.Resume] = {}
        self._lock = threading.Lock()

    def resumed(self, job: str) -> resume_rule.Resume | None:
        """The job's last resume (None: none known here)."""
        with self._lock:
            return self._resumed.get(job)

    def remember(self, job: str, resume: resume_rule.Resume) -> None:
        """``resume`` is the job's (its decider chose it, and who took it)."""
        with self._lock:
            self._resumed[job] = resume

    def here(self, job: str, step: int, resume: bool = False) -> int:
        """Drops this daemon's copies of ``job`` after ``step``, and queued work on them;
        the copies dropped. ``resume``: ``step`` is the job's resume."""
        if resume:
            with self._lock:  # (a resume already known keeps who took it)
                if getattr(self._resumed.get(job), "step", None) != step:
                    self._resumed[job] = resume_rule.Resume(step)
        if self._replicator is not None:
            self._replicator.forget_after(job, step)
        if self._writer is not None:
            self._writer.forget_after(job, step)
        dropped = self._store.rollback(job, step)
        if self._replicator is not None:
            self._replicator.rolled_back(job)
        return dropped

    def everywhere(self, job: str, step: int, world_size: int = 0,
                   resume: bool = False) -> int:
        """Drops ``job``'s copies after ``step`` here, the durable tier's later steps of the
        daemon's own policy, and asks every peer to drop theirs (the job resumes under
        ``world_size`` ranks, 0: not said; ``resume``: from the step a restore without a
        step chose, which every daemon remembers); the copies dropped here."""
        dropped = self.here(job, step, resume)
        if self._group is not None:
            request = ppb.RollbackRequest(job=job, step=step, world_size=world_size,
                                          resume=resume)
            for index in self._group.others():
                try:
                    self._group.call(index, "Rollback", request)
                except grpc.RpcError as err:
                    log.warning("peer %d did not drop the copies of %s after step %d: %s; a "
                                "copy of a later step it holds may be from an abandoned run",
                                index, job, step, err.code().name)
        # last: every daemon's writer is fenced by now, so no later step is published
        # after this deletes them (one published before the fence is deleted here)
        if self._writer is not None and not is_folder_job(job):
            self._writer.discard_after(job, step)
        return dropped
