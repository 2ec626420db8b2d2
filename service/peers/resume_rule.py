"""Pure: the step a restore without a step resumes a job from, one for every rank.

Each rank's daemon sees the group at its own moment: copies land and are freed, a
replacement daemon starts empty, the durable tier publishes a step a little later than
the copies in memory were dropped. Chosen by each daemon from what it sees, two ranks of
one resume could take two steps (a mixed state; a pipeline that waits forever for a
neighbour's activations). So one daemon of the group, the decider (the lowest ring
position not dead), chooses, and remembers its choice as the job's *resume*; every
daemon is told it with the rollback that follows, and a step-less restore of any rank
takes it while the resume lasts: until every rank of the job took it, or the job can
restore a step after it (the resumed run moved on: the rollback dropped every later copy,
in memory and on the durable tier, and fenced the durable writers, which publish no later
step of the abandoned run after it), or its step no longer restores (copies lost since:
the ranks that took it are failing anyway). The decider judges on a view every live peer
answered.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Resume:
    """A job's resume: the step it went back to, and the ranks that took it."""

    step: int
    ranks: frozenset = frozenset()


def resume_step(resume: Resume | None, restorable: list[int], rank: int,
                world: int) -> Resume | None:
    """The resume ``rank`` (of ``world`` ranks) restores from: ``resume`` (the one in
    progress, None: none) while it lasts, else a new one at the newest of ``restorable``
    (the steps every rank can get back from the group's memory or the durable tier);
    None when there is nothing to restore."""
    if resume is not None and len(resume.ranks) < world and resume.step in restorable and \
            not any(step > resume.step for step in restorable):
        return dataclasses.replace(resume, ranks=resume.ranks | {rank})
    return Resume(restorable[-1], frozenset({rank})) if restorable else None


def decider(index: int, not_dead) -> int:
    """The daemon that chooses (ring position): the lowest one not dead, this one among
    them (``index``; -1: this daemon holds none, with etcd)."""
    return min({i for i in (index, *not_dead) if i >= 0}, default=index)
