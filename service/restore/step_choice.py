"""Pure: the step a restore takes: the one asked, or the newest every rank can restore;
refused, saying what is missing, when it cannot be restored for every rank."""

from bubblesnap.service.errors import FailedPrecondition, NotFound
from bubblesnap.service.peers import group_view


def chosen(job: str, world: int, holdings, steps: list[int], asked: int | None) -> int:
    """The step to restore: ``asked``, or the latest restorable one; refused with what
    is missing when it cannot be restored for every rank."""
    if asked is None:
        if not steps:
            raise NotFound(f"job {job!r} has no committed step that every rank can restore "
                           f"yet: {_describe(holdings, world)}")
        return steps[-1]
    if asked in steps:
        return asked
    restorable = f"restorable steps: {steps[-20:] or 'none'}"
    if any(h.step == asked for h in holdings):
        found, copier = group_view.holders(holdings), group_view.copiers(holdings)
        waiting = [r for r in range(world) if (copier.get(r, r), asked) not in found]
        raise FailedPrecondition(f"step {asked} of job {job!r} is not committed: ranks "
                                 f"{waiting[:16]}{' ...' if len(waiting) > 16 else ''} have not "
                                 f"finished it; {restorable}")
    raise NotFound(f"job {job!r} holds no step {asked}; {restorable}")


def _describe(holdings, world: int) -> str:
    """Which ranks hold nothing (themselves or through their replica group's copier),
    and what the others hold; bounded for huge jobs."""
    per_rank: dict[int, list[int]] = {}
    for rank, step in group_view.holders(holdings):
        per_rank.setdefault(rank, []).append(step)
    copier = group_view.copiers(holdings)
    empty = [r for r in range(min(world, 1 << 16)) if copier.get(r, r) not in per_rank]
    held = {r: sorted(per_rank[r])[-4:] for r in sorted(per_rank)[:8]}
    return (f"{len(empty)} of {world} ranks hold no copy (e.g. {empty[:10]}); newest steps "
            f"held: {held}{' ...' if len(per_rank) > 8 else ''}")
