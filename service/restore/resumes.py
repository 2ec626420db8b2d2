"""One resume, one step: the step a restore without a step resumes a job from.

Every rank of a resume asks the resume's decider (peers/resume_rule.py: this daemon,
or the lowest peer not dead) and takes the step it answers; the decider chooses from a
view every live peer answered and remembers its choice (rollback.py tells every daemon).
"""

import threading
import time

import grpc

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.errors import NotFound, Unavailable
from bubblesnap.service.peers import resume_rule

#: How long a restore without a step waits for the decider of the job's resume to answer
#: (it is asked again and again meanwhile; a dead one is passed over once found dead).
_DECIDER_WAIT_SECONDS, _DECIDER_RETRY_SECONDS = 60.0, 0.2


class Resumes:
    """Asks the decider, or decides: ``restorable(job, world)`` gives this daemon's
    answered view, ``(world, steps every rank can restore)``, raising NotFound (saying
    why) when nothing restores; ``rollbacks`` remembers the job's resume."""

    def __init__(self, group, rollbacks, restorable):
        self._group = group
        self._rollbacks = rollbacks
        self._restorable = restorable
        self._lock = threading.Lock()  # one decision of a resume at a time

    def step(self, job: str, world: int, rank: int) -> int:
        """The step ``rank`` resumes ``job`` from, asked of the decider until it answers
        or is found dead. NotFound (the decider's) when nothing can be restored."""
        deadline = time.monotonic() + _DECIDER_WAIT_SECONDS
        while True:
            if self._group is None:  # a lone daemon decides for its job's ranks
                return self.decide(job, world, rank)
            decider = resume_rule.decider(self._group.index, self._group.not_dead())
            if decider == self._group.index:
                return self.decide(job, world, rank)
            try:
                return self._group.call(decider, "ResumeStep", ppb.ResumeStepRequest(
                    job=job, world_size=world, rank=rank)).step
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    raise NotFound(err.details()) from None
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"the step job {job!r} resumes from is chosen by daemon {decider} "
                        f"(the lowest ring position not dead), which did not answer: "
                        f"{err.code().name}; a restore without a step waits for it (or name "
                        "the step)") from None
                time.sleep(_DECIDER_RETRY_SECONDS)

    def decide(self, job: str, world: int, rank: int) -> int:
        """As the decider: the step ``rank`` resumes the job from (the resume in progress,
        while it lasts, else the newest step every rank can restore), remembered."""
        with self._lock:
            world, restorable = self._restorable(job, world)
            resume = resume_rule.resume_step(self._rollbacks.resumed(job), restorable, rank,
                                             world)
            self._rollbacks.remember(job, resume)
            return resume.step  # (the asker's own view checks it restores)
