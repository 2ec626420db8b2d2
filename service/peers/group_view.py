"""What the peer group holds, as pure functions over every daemon's holdings.

Each daemon reports the committed copies in its memory (``Holdings``); these
functions turn the reports into the job-wide answers: which steps are
committed (every rank with 1 + k copies), which step the whole job can
restore, and which copies need another replica after a peer died. A rank of
a data-parallel replica group has no copies of its own: it holds what its
group's copier holds (each copy names the ranks it stands for). No I/O.
"""

import dataclasses
from collections import defaultdict


@dataclasses.dataclass(frozen=True)
class Holding:
    """One daemon (by ring index) holds a committed copy of (rank, step)."""

    index: int
    rank: int
    step: int
    replica: bool = False
    world_size: int = 0
    group: tuple[int, ...] = ()  # the ranks this copy holds (its replica group)


def holders(holdings) -> dict[tuple[int, int], set[int]]:
    """(rank, step) -> ring indices of the daemons holding a copy."""
    found = defaultdict(set)
    for h in holdings:
        found[(h.rank, h.step)].add(h.index)
    return found


def copiers(holdings) -> dict[int, int]:
    """rank -> the rank whose copies hold its state, for each rank a copy's replica
    group names; a rank not named holds its own copies."""
    return {member: h.rank for h in holdings for member in h.group}


def step_worlds(holdings, world_size: int) -> dict[int, int]:
    """step -> the world size its copies were taken with; copies that disagree, or name
    none (0), count as ``world_size``."""
    seen: dict[int, set[int]] = defaultdict(set)
    for h in holdings:
        seen[h.step].add(h.world_size)
    return {step: worlds.pop() if len(worlds) == 1 and 0 not in worlds else world_size
            for step, worlds in seen.items()}


def _held_whole(world_size: int, holdings, copies_wanted: int) -> list[int]:
    """Steps whose every rank holds ``copies_wanted`` copies. Each step is judged on its
    own copies: the world size and replica groups it was taken with (a job's epochs
    differ in them); copies that disagree on the world size, or name none (0), are
    judged by ``world_size``."""
    by_step = defaultdict(list)
    for h in holdings:
        by_step[h.step].append(h)
    worlds = step_worlds(holdings, world_size)
    whole = []
    for step, copies in sorted(by_step.items()):
        world = worlds[step]
        found, copier = holders(copies), copiers(copies)
        if world and all(len(found.get((copier.get(r, r), step), ())) >= copies_wanted
                         for r in range(world)):
            whole.append(step)
    return whole


def committed_steps(world_size: int, holdings, copies_wanted: int) -> list[int]:
    """Steps every rank holds with at least ``copies_wanted`` copies, oldest first."""
    return _held_whole(world_size, holdings, copies_wanted)


def restorable_steps(world_size: int, holdings, durable_steps=()) -> list[int]:
    """Steps every rank can get back from some peer's memory, or that the durable tier
    holds whole."""
    return sorted(set(_held_whole(world_size, holdings, 1)) | set(durable_steps))


def kept_committed(world_size: int, holdings, copies_wanted: int, summary=None, held=(),
                   rolled_back_to: int | None = None, epoch_whole: bool = True,
                   stale=frozenset()) -> list[int]:
    """The committed steps a daemon takes for a job after gathering ``holdings``.

    ``summary``: (committed, restorable) as etcd's aggregator judged every
    daemon's holdings; None on the static ring, where they are judged here.
    ``rolled_back_to``: the job was rolled back to this step and etcd has not
    judged anew: the summary still counts the dropped steps, which kept as
    committed would make retention free the step restored. ``held``: the
    steps this daemon or a peer (as it answered last) took as committed before; each
    stays committed while the group can still restore it (a host lost before the
    others saw a step whole takes copies away, but a step the trainers were told is
    committed must not become fair game for the cap on uncommitted copies). ``epoch_whole``: False when the current epoch's
    layouts can never cover its job-wide arrays; its steps are not committed.
    ``stale``: daemons whose holdings are what they answered last, not now (silent
    this time): a step is not judged committed on their copies, which may have been
    freed since; they still count for what the group can restore.
    """
    if summary is not None and rolled_back_to is not None:
        summary = tuple([s for s in steps if s <= rolled_back_to] for steps in summary)
    if summary is None:
        fresh = [h for h in holdings if h.index not in stale] if stale else holdings
        summary = (committed_steps(world_size, fresh, copies_wanted),
                   restorable_steps(world_size, holdings))
    committed = sorted(set(summary[0]) | (set(held) & set(summary[1])))
    if not epoch_whole:
        worlds = step_worlds(holdings, world_size)
        committed = [s for s in committed if worlds.get(s) != world_size]
    return committed


def newly_held(before: dict[tuple[int, int], set[int]], holdings) -> set[int]:
    """Steps of which ``holdings`` show a copy that ``before`` (:func:`holders` of an
    earlier gathering) did not: a copy landed since."""
    return {key[1] for key, where in holders(holdings).items()
            if where - before.get(key, set())}


def successors(index: int, ring_size: int, live, count: int) -> list[int]:
    """The next ``count`` live daemons after ``index`` in ring order."""
    ring = [(index + i) % ring_size for i in range(1, ring_size)]
    return [i for i in ring if i in live][:count]


def re_replication(index: int, ring_size: int, live, holdings, copies_wanted: int,
                   floor: int = 0, unpushed=frozenset()) -> list[tuple[int, int, list[int]]]:
    """(rank, step, targets) this daemon should push so every copy it holds of a
    step from ``floor`` on is back at ``copies_wanted`` live copies.

    Steps below ``floor`` are left alone: retention is freeing them on every
    daemon, each at its own moment, and they must not be copied back. So are
    the (rank, step) copies in ``unpushed``: new ones this daemon committed
    and has not pushed, which are the new-copy path's (paced into bubbles,
    coalesced when replication falls behind); pushing them here would send
    every step the coalescing skipped, at once.

    Of the live holders of a copy, the first in ring order (from index 0)
    does the pushing, so two survivors never push the same copy twice.
    Targets are the next live daemons after it that do not hold the copy.
    """
    work = []
    for (rank, step), where in sorted(holders(holdings).items()):
        if step < floor or (rank, step) in unpushed:
            continue
        alive = sorted(where & set(live))
        if index not in alive or alive[0] != index or len(alive) >= copies_wanted:
            continue
        missing = copies_wanted - len(alive)
        targets = [i for i in successors(index, ring_size, live, ring_size) if i not in where]
        if targets[:missing]:
            work.append((rank, step, targets[:missing]))
    return work


def roundest(steps) -> int:
    """The step with the most trailing zero bits (the newest among those; step 0
    counts as the roundest of all).

    Daemons that must skip steps (replication behind training) keep the
    roundest one: one daemon's choice is then among every other's, so the
    group commits common steps however far behind each daemon is.
    """
    return max(steps, key=lambda s: ((s & -s).bit_length() if s else 64, s))
