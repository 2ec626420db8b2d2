"""Restore: one rule for which step, and one order for where from (memory -> peer -> durable).

The step: the latest one every rank of the job can get back from some tier
(group_view.restorable_steps over every daemon's holdings and the durable
tier's whole steps), so all ranks restore the same step. A lone daemon's
holdings are its own copies. The bytes: this daemon's memory, else a peer
that holds the copy (pulled over the data channel), else the durable tier.
Every copy is verified against its checksums before it is served; one that
fails is dropped, recorded (status and log) and the next is tried.

With peers or a durable tier, restoring step k resumes the job from k:
later copies belong to an abandoned run and are dropped everywhere first,
unless the rank goes back alone (a stage replaying from boundary logs). A
lone daemon keeps them.
"""

import collections
import contextlib
import dataclasses
import logging
import threading
import time

import grpc

from bubblesnap.service import checks, phases
from bubblesnap.service.errors import (
    DaemonError,
    DataLoss,
    FailedPrecondition,
    NotFound,
    Unavailable,
    reason,
)
from bubblesnap.service.peers import group_view
from bubblesnap.service.progress import Progress
from bubblesnap.service.restore import assembly, region_plan, step_choice
from bubblesnap.service.restore.resumes import Resumes
from bubblesnap.service.rollback import Rollbacks
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store.views import Restorable

log = logging.getLogger("bubblesnap.daemon")

_CORRUPT_KEPT = 64


@dataclasses.dataclass(frozen=True)
class Restored:
    found: Restorable
    source: str    # "memory", "peer" or "durable"
    detail: str
    phases: tuple[tuple[str, float], ...] = ()  # (name, seconds): where the daemon's time went


@dataclasses.dataclass(frozen=True)
class CorruptCopy:
    job: str
    rank: int
    step: int
    source: str
    detail: str
    unix_time: float


class Restorer:
    """Finds the step to restore and serves it from the fastest tier that holds it intact."""

    def __init__(self, store, group=None, replicator=None, transfers=None,
                 durable_reader=None, durable_writer=None, *, on_corrupt,
                 progress: Progress | None = None):
        self._store = store
        self._progress = progress or Progress()  # a restore's bytes, as they land
        self._on_corrupt = on_corrupt  # counts a corrupt copy by its source (metrics)
        self._group = group
        self._replicator = replicator
        self._transfers = transfers
        self._durable = durable_reader
        self._writer = durable_writer
        self._corrupt: collections.deque = collections.deque(maxlen=_CORRUPT_KEPT)
        self._lock = threading.Lock()
        self._assembler = assembly.Assembler(store, transfers, durable_reader, self._record)
        #: Dropping an abandoned run's copies (rollback.py).
        self.rollbacks = Rollbacks(store, group, replicator, durable_writer)
        #: The step a restore without a step resumes the job from (resumes.py).
        self.resumes = Resumes(group, self.rollbacks, self._restorable)

    @property
    def resumes_job(self) -> bool:
        """Whether a restore resumes the whole job (drops later copies everywhere)."""
        return self._group is not None or self._durable is not None

    def restore(self, job: str, rank: int, step: int | None = None, replica_group=(),
                alone: bool = False, world_size: int = 0, asked=(),
                answer: region_plan.AnswerForm = region_plan.AnswerForm()) -> Restored:
        """The rank's state at ``step`` (default: the latest the whole job can restore).

        ``asked`` (region_plan.Asked per tensor): the regions the caller's
        devices need, gathered from every rank's copy that holds them, so a
        job restores onto another mesh or number of processes
        (``world_size``, the caller's; 0: not said). Without ``asked``: the
        rank's own copy as it was taken, which only a caller of the same world
        size gets. A member of a replica group gets its copier's copy. With
        peers or a durable tier the rank need not be registered here: a
        replacement host's trainer restores first, naming its
        ``replica_group``, and registers after. ``answer``: how the caller reads the
        answer of a restore by regions (several segments; its checksums or not).
        """
        with phases.record() as spent, (self._durable.one_view() if self._durable is not None
                                        else contextlib.nullcontext()):
            restored = self._restore(job, rank, step, replica_group, alone, world_size, asked,
                                     answer)
        return dataclasses.replace(restored, phases=tuple(spent.items()))

    def _restore(self, job: str, rank: int, step: int | None, replica_group, alone: bool,
                 world_size: int, asked, answer: region_plan.AnswerForm) -> Restored:
        with phases.timed("holdings"):
            holdings = self.holdings(job, answered=True)
            # a durable tier that does not answer fails the restore (Unavailable): taken
            # for empty, an older step would be chosen and the newer ones dropped
            durable = self._durable.steps(job) if self._durable is not None else []
        world = world_size or self._world_size(job, holdings)
        checks.check_rank(rank, world)
        group_asked = checks.check_replica_group(rank, world, replica_group) \
            if replica_group else ()
        copier, group = self._store.copier_of(job, rank, group_asked)
        if copier != rank:  # the copier's word, not the caller's, says whom its copies hold
            for declared in {h.group for h in holdings if h.rank == copier and h.group}:
                layout_lib.check_held_for(job, rank, copier, declared)
        resume = step is None and not alone
        if resume:  # one step for every rank of the resume: the decider's
            step = self.resumes.step(job, world, rank)
        step = step_choice.chosen(job, world, holdings, group_view.restorable_steps(world, holdings,
                                                                          durable), step)
        step_world = self._step_world(job, step, holdings, durable, world)
        if asked:
            with phases.timed("plan"):
                sources = self._sources(job, step, holdings, durable)
                plan = region_plan.plan(list(asked), {r: s.layout for r, s in sources.items()},
                                        step_world, copier, world_size)
        elif world_size and world_size != step_world:
            raise FailedPrecondition(
                f"step {step} of job {job!r} was taken by {step_world} ranks; rank {rank}'s own "
                f"copy restores only into {step_world}, not {world_size}. Ask for the regions "
                "the target shardings need (the JAX client does) to restore onto another "
                "number of processes")
        if not alone:  # its ranks may register under the caller's world size (a new epoch)
            self._store.resume(job, world_size or step_world, step)
        if self.resumes_job and not alone:
            with phases.timed("rollback"):
                self._roll_back(job, step, holdings, durable, world_size or step_world,
                                resume)
        with self._progress.track("restore", job, rank, step):
            if not asked:
                return self._fetch(job, world, rank, copier, step, group, holdings, durable)
            return self._fetch_regions(job, step, step_world, copier, list(asked), plan,
                                       sources, answer)

    def _fetch_regions(self, job: str, step: int, world: int, copier: int, asked, plan,
                       sources, answer: region_plan.AnswerForm) -> Restored:
        exact = plan.exact_copy()
        places = dict(sources[exact].places) if exact is not None else {}
        if "memory" in places or "peer" in places:  # one copy holds it all: no bytes move
            if "memory" not in places:
                peers = [i for kind, i in sources[exact].places if kind == "peer"]
                self._transfers.fetch(self._peer_attempts(peers)[0], job, world, exact, step,
                                      sources[exact].group, lambda i, detail: self._record(
                                          job, exact, step, f"peer {self._group.address(i)}",
                                          detail))
            found = assembly.exact_answer(self._store.serve_copy(job, exact, step), plan, asked)
            return Restored(found, "memory" if "memory" in places else "peer", "")
        if "durable" in places:  # one written copy holds it all: read into what is served
            found = self._assembler.read_durable(job, step, world, copier, plan, asked, exact,
                                                 sources[exact])
            return Restored(found, "durable", "")
        found, used = self._assembler.assemble(job, step, world, copier, plan, asked, sources,
                                               answer)
        return Restored(found, used, "")

    def _sources(self, job: str, step: int, holdings, durable) -> dict[int, assembly.Source]:
        """Every rank whose copy of ``step`` exists (a replica group by its copier): its
        layout and the places that hold it, fastest first."""
        here = self._group.index if self._group is not None else 0
        places: dict[int, list] = {}
        groups: dict[int, tuple[int, ...]] = {}
        for h in sorted(holdings, key=lambda h: (h.index != here, h.index)):
            if h.step == step:
                places.setdefault(h.rank, []).append(
                    ("memory", None) if h.index == here else ("peer", h.index))
                groups[h.rank] = h.group or (h.rank,)
        written = self._durable.step_layouts(job, step) if step in durable else {}
        for rank, copy in written.items():
            places.setdefault(rank, []).append(("durable", None))
            groups.setdefault(rank, copy.group)
        return {rank: assembly.Source(self._layout_of(job, step, rank, where, written),
                                      tuple(where), groups[rank])
                for rank, where in places.items()}

    def _layout_of(self, job: str, step: int, rank: int, places, written):
        for kind, index in places:
            try:
                if kind == "memory":
                    return self._store.describe(job, rank, step).layout
                if kind == "peer":
                    return self._transfers.describe(index, job, rank, step).layout
                return written[rank].layout
            except (DaemonError, grpc.RpcError, OSError):
                continue
        raise Unavailable(f"no daemon holding step {step} of rank {rank} of job {job!r} "
                          "answered; try again")

    def _step_world(self, job: str, step: int, holdings, durable, world: int) -> int:
        """The world size ``step`` was taken with (``world`` when nothing says)."""
        held = group_view.step_worlds(holdings, 0).get(step, 0)
        if held:
            return held
        if step in durable:
            return self._durable.world_size(job, step) or world
        return world

    def holdings(self, job: str, answered: bool = False) -> list[group_view.Holding]:
        """The committed copies of ``job`` in the group (this daemon's alone, without peers);
        ``answered``: once every live peer answered (see ``Replicator.view``)."""
        if self._replicator is not None:
            return self._replicator.view(job, answered)
        return [group_view.Holding(0, h.rank, h.step, h.replica, h.world_size, h.group)
                for h in self._store.holdings(job)]

    @property
    def durable_directory(self) -> str:
        """The durable tier's directory; empty without one."""
        return self._durable.directory if self._durable is not None else ""

    def durable_steps(self, job: str) -> list[int]:
        """The steps the durable tier holds whole, of every epoch of the job, as Status
        shows them (none while it does not answer: the writer's failure says why)."""
        try:
            return self._durable.steps(job) if self._durable is not None else []
        except Unavailable:
            return []

    def corrupt_copies(self, job: str) -> list[CorruptCopy]:
        with self._lock:
            return [c for c in reversed(self._corrupt) if c.job == job]

    def _fetch(self, job: str, world: int, rank: int, copier: int, step: int,
               group: tuple[int, ...], holdings, durable) -> Restored:
        tried, corrupt = [], False

        def served():
            return self._store.serve(job, rank, step, group)

        try:
            return Restored(served(), "memory", "")
        except DataLoss as err:
            self._record(job, copier, step, "memory", str(err))
            tried.append(f"memory: {err}")
            corrupt = True
        except NotFound:
            pass

        def spoiled(index: int, detail: str) -> None:  # a holder of a spread pull
            nonlocal corrupt
            self._record(job, copier, step, f"peer {self._group.address(index)}", detail)
            corrupt = True

        for indices in self._peer_attempts(group_view.holders(holdings).get((copier, step), ())):
            address = ", ".join(self._group.address(i) for i in indices)
            try:
                used = self._transfers.fetch(indices, job, world, copier, step, group, spoiled)
                return Restored(served(), "peer", ", ".join(self._group.address(i) for i in used))
            except DataLoss as err:
                self._record(job, copier, step, f"peer {address}", str(err))
                tried.append(f"peer {address}: {err}")
                corrupt = True
            except (DaemonError, grpc.RpcError, OSError) as err:
                tried.append(f"peer {address}: {reason(err)}")
        if step in durable:
            try:
                self._load_durable(job, world, rank, step, group)
                return Restored(served(), "durable", self._durable.directory)
            except DataLoss as err:
                self._record(job, copier, step, "durable", str(err))
                tried.append(f"durable: {err}")
                corrupt = True
        if corrupt:
            raise DataLoss(f"no intact copy of step {step} of rank {rank} of job {job!r}; "
                           f"tried: {'; '.join(tried)}")
        if tried:
            raise Unavailable(f"the copies of step {step} of rank {rank} of job {job!r} could "
                              f"not be fetched now; tried: {'; '.join(tried)}. Try again")
        raise NotFound(f"step {step} of rank {rank} of job {job!r} is held nowhere")

    def _peer_attempts(self, holders) -> list[list[int]]:
        """The peers to pull a copy ``holders`` (ring indices) hold from, in the order to
        try: every live one at once when there are several, then each other on its own."""
        if self._group is None:
            return []
        held = sorted(set(holders) - {self._group.index})
        live = [i for i in held if i in self._group.live()]
        if len(live) < 2 or not self._group.options.spread_restores:
            return [[i] for i in held]
        return [live] + [[i] for i in held if i not in live]

    def _roll_back(self, job: str, step: int, holdings, durable, world_size: int,
                   resume: bool) -> None:
        """Restoring ``step`` resumes the job from it, under ``world_size`` ranks (a new
        epoch when the job ran with another number): later copies, here, at every peer
        and in the durable tier, belong to an abandoned run. Dropped before anything
        is installed, so a resumed run never mixes with them. ``resume``: a restore
        without a step chose it: every daemon is told (the other ranks take it too)."""
        later = any(h.step > step for h in holdings) or any(s > step for s in durable)
        if not later and not resume and world_size == self._current_world(job, world_size):
            return
        log.info("job %s resumes from step %d under %d ranks: dropping later copies in the "
                 "group", job, step, world_size)
        self.rollbacks.everywhere(job, step, world_size, resume)

    def _restorable(self, job: str, world: int) -> tuple[int, list[int]]:
        """The world size and the steps every rank of ``job`` can restore, on a view every
        live peer answered (resumes.py decides on it); NotFound, saying why, if none."""
        holdings = self.holdings(job, answered=True)
        durable = self._durable.steps(job) if self._durable is not None else []
        world = world or self._world_size(job, holdings)
        restorable = group_view.restorable_steps(world, holdings, durable)
        step_choice.chosen(job, world, holdings, restorable, None)
        return world, restorable

    def _load_durable(self, job: str, world: int, rank: int, step: int,
                      group: tuple[int, ...]) -> None:
        """Installs the copy of ``rank`` (its group's copier's, ``group[0]``) from disk,
        cut into the layout the copier registered here (whole tensors if none did),
        once the copier's written group names ``rank``."""
        copier = group[0]
        if copier != rank:
            layout_lib.check_held_for(job, rank, copier,
                                      self._durable.replica_group(job, copier, step))
        try:
            layout = self._store.layout_of(job, copier)
        except NotFound:  # not registered here yet: whole tensors, the client reshards
            layout = self._durable.whole_layout(job, copier, step)
        fill, checksums = self._durable.load(job, copier, step, layout)
        self._store.install(job, world, copier, step, layout, checksums, fill, for_restore=True,
                            group=group)

    def _current_world(self, job: str, default: int) -> int:
        try:
            return self._store.world_size(job)
        except NotFound:
            return default

    def _world_size(self, job: str, holdings) -> int:
        try:
            return self._store.world_size(job)
        except NotFound:
            pass
        sizes = {h.world_size for h in holdings if h.world_size}
        if self._durable is not None and not sizes:
            sizes = {self._durable.world_size(job)} - {0}
        if len(sizes) != 1:
            raise NotFound(f"no job {job!r} is registered with this daemon, and no peer or "
                           "durable checkpoint knows it" if not sizes else
                           f"peers disagree on the world size of job {job!r}: {sorted(sizes)}")
        return sizes.pop()

    def _record(self, job: str, rank: int, step: int, source: str, detail: str) -> None:
        log.warning("corrupt copy skipped: step %d of rank %d of %s from %s: %s", step, rank,
                    job, source, detail)
        with self._lock:
            self._corrupt.append(CorruptCopy(job, rank, step, source, detail, time.time()))
        self._on_corrupt(source)

