"""Registration: a rank declares its layout and replica group; who holds whose state.

A data-parallel replica group is a set of ranks with identical state; its
lowest rank (the copier) copies it, and the others are held through its
copies. Every member must declare the same group and the same layout.
Called with the store's lock held.
"""

import dataclasses

from bubblesnap.service.errors import AlreadyExists, FailedPrecondition, NotFound
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store import model
from bubblesnap.service.store.layout import Layout
from bubblesnap.service.store.model import Job, Rank, describe_difference, lookup
from bubblesnap.service.store.state import StoreState
from bubblesnap.service.store.views import Registration


def register(state: StoreState, job: str, rank: int, world_size: int, layout: Layout,
             group: tuple[int, ...], others: dict) -> Registration:
    """Declares one rank's layout and replica group (see RegisterRequest). Refused, and
    nothing kept, when the layout conflicts with the other ranks' (here, or ``others``
    registered at peers) or when they would leave part of a job-wide array uncovered."""
    entry = state.jobs.get(job)
    switching = entry is not None and entry.world_size != world_size
    if switching and (entry.resume is None or entry.resume[0] != world_size):
        raise FailedPrecondition(
            f"job {job!r} is registered with world_size {entry.world_size}, not "
            f"{world_size}. To go on under another world size, restore the job first "
            f"from {world_size} processes (each names its world size), which starts a "
            "new epoch; or delete the job's snapshots to start it over")
    registered = registered_layouts(entry) if entry is not None and not switching else {}
    if registered:
        _check_group_agrees(job, entry, rank, group, layout)
    _check_job_wide(job, world_size, {**others, **registered}, rank, group, layout)
    if entry is None:
        entry = state.new_job(job, world_size)
    elif switching:
        _new_epoch(entry, world_size)
    held = entry.ranks.get(rank)
    if held is not None and (held.replica or held.layout is None):
        # A trainer takes over a rank this daemon held replicas of (a replacement
        # host), or the rank joins the job's new epoch: the copies held stay, each
        # with the layout it was taken with.
        held.layout, held.group, held.replica = layout, group, False
        return Registration(False, held.latest_local(), layout.segment_bytes)
    if held is not None:
        if held.layout != layout:
            raise AlreadyExists(
                f"rank {rank} of job {job!r} is already registered with a different "
                f"state layout ({describe_difference(held.layout, layout)}); use a new "
                "job name or delete this job's snapshots first")
        # A restarted trainer: keep what is committed, drop its unfinished copies.
        for step in [s for s, rs in held.steps.items() if not rs.local]:
            state.memory.free(held, step)
        return Registration(True, held.latest_local(), layout.segment_bytes)
    entry.ranks[rank] = Rank(layout, group)
    return Registration(False, -1, layout.segment_bytes)


def _new_epoch(entry: Job, world_size: int) -> None:
    """The job goes on under another world size (it was restored for it): every rank
    registers again; the copies held stay restorable until retention frees them."""
    entry.world_size, entry.resume = world_size, None
    for held in entry.ranks.values():
        if not held.replica:
            held.layout = None


def registered_layouts(entry: Job) -> dict[int, tuple[Layout, tuple[int, ...]]]:
    """rank -> (layout, replica group) of the ranks trainers registered in the current epoch."""
    return {rank: (held.layout, held.group) for rank, held in entry.ranks.items()
            if held.layout is not None and not held.replica}


@dataclasses.dataclass(frozen=True)
class Coverage:
    """How the layouts of a job's ranks cover its job-wide arrays."""

    known: bool              # every rank's layout was seen (through replica groups)
    conflict: str | None     # a job-wide array declared with two dtypes or shapes
    gaps: tuple[str, ...]    # regions no rank copies (judged only when known)

    @property
    def whole(self) -> bool:
        return self.known and self.conflict is None and not self.gaps


def judge(world_size: int, ranks: dict[int, tuple[Layout, tuple[int, ...]]]) -> Coverage:
    """How ``ranks`` (rank -> (layout, replica group)) cover the job-wide arrays."""
    layouts = tuple(layout for _, (layout, _) in sorted(ranks.items()))
    held = {member for rank, (_, group) in ranks.items() for member in (rank, *group)}
    known = held >= set(range(world_size))
    return Coverage(known, model.conflict(layouts), model.uncovered(layouts) if known else ())


def _check_job_wide(job: str, world_size: int, registered: dict, rank: int,
                    group: tuple[int, ...], layout: Layout) -> None:
    coverage = judge(world_size, {**registered, rank: (layout, group)})
    if coverage.conflict:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} cannot register: {coverage.conflict}; every rank "
            "must declare a job-wide array with the same dtype and global shape")
    if coverage.gaps:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} cannot register: with it every rank has "
            f"registered, and no rank copies {', '.join(coverage.gaps)}, so no step could "
            "ever be whole. Each region of a job-wide array must be copied by the process "
            "whose device holds it with replica id 0")


def agreed_group(job: str, entry: Job | None, rank: int,
                 asked: tuple[int, ...]) -> tuple[int, ...]:
    """The replica group of ``rank``: as declared here, else ``asked``, else alone."""
    known = entry.group_of(rank) if entry is not None else None
    if known and asked and known != asked:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} is asked for with replica group {list(asked)}, but it "
            f"was registered with {list(known)}; pass the group the trainers register")
    return known or asked or (rank,)


def copier(state: StoreState, job: str, rank: int,
           asked: tuple[int, ...] = ()) -> tuple[Job, Rank]:
    """The job and the held rank whose copies serve ``rank`` (itself, or the copier of
    its replica group, which must have the layout ``rank`` registered here).
    ``asked``: the caller's replica group (validated), for a rank not registered here."""
    entry = state.jobs.get(job)
    if entry is None:
        raise NotFound(f"no job {job!r} is registered with this daemon; call Register first")
    group = agreed_group(job, entry, rank, asked)
    if group[0] == rank:
        return lookup(state.jobs, job, rank)
    held = entry.ranks.get(group[0])
    if held is None:
        raise NotFound(f"rank {rank} of job {job!r} is held through rank {group[0]}'s copies "
                       f"(replica group {list(group)}), and this daemon holds no copy of "
                       f"rank {group[0]}; registered ranks: {sorted(entry.ranks)}")
    layout_lib.check_held_for(job, rank, group[0], held.group)
    own = entry.ranks.get(rank)
    if own is not None and None not in (own.layout, held.layout) and own.layout != held.layout:
        raise FailedPrecondition(
            f"rank {rank} of job {job!r} registered a layout that differs from the copy of "
            f"rank {group[0]} it is held through ({describe_difference(held.layout, own.layout)})"
            "; replicas hold identical state: check the replica group or the shardings")
    return entry, held


def _check_group_agrees(job: str, entry: Job, rank: int, group: tuple[int, ...],
                        layout: Layout) -> None:
    """Ranks registered here that share a replica group with ``rank`` (itself
    included) declared the same group and, being replicas, the same layout."""
    for other, held in sorted(entry.ranks.items()):
        if held.replica or held.layout is None or not set(held.group) & set(group):
            continue
        if held.group != group:
            who = "it was" if other == rank else f"rank {other} was"
            raise FailedPrecondition(
                f"rank {rank} of job {job!r} declares replica group {list(group)}, but {who} "
                f"registered with replica group {list(held.group)}; every member of a "
                "data-parallel group must declare the same ranks. Fix the groups, or delete "
                "the job's snapshots to change them")
        if other != rank and held.layout is not None and held.layout != layout:
            raise FailedPrecondition(
                f"rank {rank} of job {job!r} declares rank {other} a replica (group "
                f"{list(group)}), but their state layouts differ "
                f"({describe_difference(held.layout, layout)}); replicas hold identical "
                "state: check the replica group or the shardings")
