"""Daemons of a static ring, their trainers, failures, and the contract after every event.

Each simulated daemon keeps what the store keeps (its copies, the group's
committed steps as it took them) and runs the replicator's loop as a
coroutine: a batch pushes the roundest waiting step of each rank to the next
``replicas`` daemons that answer (probing one believed dead), then gathers
the group's holdings; every ``refresh_seconds`` it announces itself to silent
peers, gathers, takes the committed steps (``group_view.kept_committed``),
frees what ``retention.steps_to_free`` lets go and re-replicates
(``group_view.re_replication``, not while a peer that is not dead never
answered; a daemon's own copies never pushed are left to the new-copy path,
but the last one a push left short of peers). A peer that misses a call counts
with what it answered last.

Failures, within the failure model (at most ``replicas`` hosts lost at once,
the next only once the newest committed step has 1 + k copies again): a host
lost (its daemon, its memory and its trainers; the job stops, a replacement
daemon joins empty, the job resumes), a daemon restarted on its shared memory
(it adopts its copies and waits for the group's committed steps before
freeing any), the job failing alone. A resume restores the newest step every
rank can restore (from every live daemon's memory), rolls every later copy
back (the Rollback calls may be lost too) and trains on as a new run. With
``per_rank_resume`` each rank restores on its own daemon at its own moment, the step
asked of the resume's decider (peers/resume_rule.py), or, with ``one_decider``
off, chosen from what its daemon knows: every rank of one resume must take the same
step.

The contract, checked after every event: the newest step any daemon reported
committed in the current run is restorable whole with the current run's
bytes (every rank has a live copy whose content is the one this run's
history gave that step); a resume never goes back past it, and every copy
it could serve of the step it chose holds that content.
"""

import dataclasses

from bubblesnap.service.peers import group_view, resume_rule
from bubblesnap.service.peers.group_view import Holding
from bubblesnap.service.store import retention
from tests.simulation.engine import Call, Faults, Gather, Sim, Sleep, Wait


@dataclasses.dataclass
class Config:
    """The group and how often things go wrong (seconds are virtual)."""

    daemons: int = 3
    replicas: int = 1
    world: int = 3
    placement: tuple[int, ...] = ()         # rank -> host; default rank % daemons
    keep_steps: int = 2
    grace_seconds: float = 3.0
    refresh_seconds: float = 1.0
    dead_after_seconds: float = 5.0
    call_timeout: float = 2.0
    transfer_timeout: float = 10.0
    transfer_seconds: tuple[float, float] = (0.002, 0.3)
    step_seconds: tuple[float, float] = (0.05, 0.6)
    first_step_after: tuple[int, int] = (0, 3)  # a run's ranks start snapshotting this late
    host_loss_every: float = 40.0            # mean seconds between failures of each kind
    daemon_restart_every: float = 40.0
    job_failure_every: float = 30.0
    down_seconds: tuple[float, float] = (0.5, 6.0)
    grace_from_group: bool = True  # False: the cap's grace as it was before (a test shows why)
    fresh_judgement: bool = True  # False: a silent peer's last answer counts toward committed
    # A rollback is not atomic across the group: a Rollback call lost, or a push of the
    # abandoned run still in flight when the job resumes, leaves that run's bytes where
    # the new run counts them (an open issue: see tests/test_simulation.py). True keeps
    # those two out: Rollback calls are not lost, and a resume waits for pushes in flight.
    atomic_rollback: bool = True
    # A Holdings answer carries the steps the peer took as committed, which the gatherer
    # keeps committed while the group can restore them. False: as before, each daemon
    # took a step committed on its own gathering alone, and one that saw a step whole
    # reported it while the others, its host lost before they saw it whole, freed their
    # copies of it with the cap on uncommitted copies (a test shows it).
    peers_vouch: bool = True
    # Re-replication leaves a daemon's unpushed new copies to their push (the coalescing
    # skips some), but the last one a push left short. False: every copy short of 1 + k
    # is re-replicated, as before (the histories the older seeds below were found in).
    leave_unpushed: bool = True
    # Each rank restores on its own daemon at its own moment (within resume_spread
    # seconds), as the ranks of a real job do; False: one decision for every rank (the
    # histories the older seeds below were found in). ``one_decider``: the step comes from
    # the decider of the resume (peers/resume_rule.py); False: each rank's daemon
    # chooses from its own view, as before (a test shows the mixed restores it allows).
    per_rank_resume: bool = False
    one_decider: bool = True
    resume_spread: float = 2.0
    faults: Faults = dataclasses.field(default_factory=Faults)

    def host_of(self, rank: int) -> int:
        return self.placement[rank] if self.placement else rank % self.daemons


@dataclasses.dataclass
class Copy:
    run: int             # the run whose trainer wrote these bytes
    replica: bool
    local_since: float
    replicated: bool = False
    group_changed: float = 0.0


class Violation(AssertionError):
    pass


class Daemon:
    """One daemon: its store's copies and committed steps, its view of its peers, its
    replicator's queue; ``handle`` answers its peer calls."""

    def __init__(self, group: "Group", index: int):
        self.group, self.index = group, index
        self.alive, self.incarnation = True, 0
        self.copies: dict[tuple[int, int], Copy] = {}
        self.resumed: resume_rule.Resume | None = None  # the job's, as told it
        self._fresh_view()

    def _fresh_view(self) -> None:
        cfg = self.group.cfg
        self.committed: list[int] = []
        self.awaiting = bool(self.copies)   # adopted copies wait for the group's committed
        self.live = set(range(cfg.daemons))
        self.silent: dict[int, float] = {}
        self.last: dict[int, list[Holding]] = {}
        self.vouched: dict[int, list[int]] = {}  # peer -> its committed steps, answered last
        self.answered: set[int] = set()  # the peers that answered the last gathering
        self.replaced = False  # a new incarnation of a peer joined since the last gathering
        self.spared: set[int] = set()  # steps kept from the cap since a peer was lost
        self.work: dict[int, list[int]] = {}
        # rank -> the step its last new-copy push left short of replicas (or adopted
        # unpushed): re-replication pushes it; the other unpushed copies are the new-copy
        # path's (the replicator's _short)
        self.short: dict[int, int] = {}
        for (r, s), c in sorted(self.copies.items()):
            if not c.replica and not c.replicated:
                self.short[r] = s
        self.probed: dict[int, float] = {}
        self.joining: set[int] = set()
        self.seen: dict = {}  # holders() of the last gathering
        self.known: dict[int, int] = {}  # peer -> the incarnation that joined last
        self.gathered_at = float("-inf")  # when the last completed gathering began

    @property
    def now(self) -> float:
        return self.group.sim.now

    # -- the store ---------------------------------------------------------------------

    def holdings(self) -> list[Holding]:
        world = self.group.world
        return [Holding(self.index, r, s, c.replica, world, (r,))
                for (r, s), c in sorted(self.copies.items())]

    def commit(self, rank: int, step: int, run: int) -> bool:
        """A trainer commits (rank, step) here; False: refused (no snapshot this step)."""
        cfg = self.group.cfg
        kept = self.committed[-cfg.keep_steps:]
        if len(kept) == cfg.keep_steps and step < kept[0]:
            return False  # older than every step retention keeps
        if (rank, step) in self.copies and step in self.committed:
            return False  # already committed: snapshot a later step
        self.copies[(rank, step)] = Copy(run, False, self.now)
        self.retain()
        self.work.setdefault(rank, []).append(step)
        self.group.sim.notify(self)
        return True

    def install(self, rank: int, step: int, run: int) -> None:
        if (rank, step) not in self.copies:
            self.copies[(rank, step)] = Copy(run, True, self.now)
            self.retain()

    def set_committed(self, steps, changed=(), gathered_at: float | None = None) -> None:
        gathered_at = self.now if gathered_at is None else gathered_at
        for (_, step), copy in self.copies.items():
            if step in changed:
                copy.group_changed = gathered_at
        if self.group.cfg.grace_from_group:
            self.gathered_at = max(self.gathered_at, gathered_at)
        self.committed, self.awaiting = sorted(steps), False
        self.retain()
        self.group.reported(self)

    def retain(self) -> None:
        if self.awaiting:
            return
        cfg = self.group.cfg
        by_rank: dict[int, dict[int, retention.HeldStep]] = {}
        for (r, s), c in self.copies.items():
            by_rank.setdefault(r, {})[s] = retention.HeldStep(True, c.replicated, c.local_since,
                                                              c.group_changed)
        now = self.gathered_at if cfg.grace_from_group else self.now
        for rank, held in sorted(by_rank.items()):
            for step in retention.steps_to_free(held, self.committed, cfg.keep_steps, True,
                                                now, cfg.grace_seconds):
                del self.copies[(rank, step)]

    def view(self) -> list[Holding]:
        """The group's copies as this daemon knows them now: its own, and each peer's last
        answer (a gathering ago)."""
        return self.holdings() + [h for p in self.others() for h in self.last.get(p, [])]

    def resume_step(self, rank: int) -> int | None:
        """As the resume's decider: the step ``rank`` restores (resume_rule), remembered;
        on what every live daemon holds now (a restore's view waits for every live peer's
        answer)."""
        self.resumed = resume_rule.resume_step(self.resumed, group_view.restorable_steps(
            self.group.world, self.group._live_holdings()), rank, self.group.world)
        return None if self.resumed is None else self.resumed.step

    def roll_back(self, step: int, resume: bool = False) -> None:
        if resume and getattr(self.resumed, "step", None) != step:
            self.resumed = resume_rule.Resume(step)
        for key in [k for k in self.copies if k[1] > step]:
            del self.copies[key]
        self.short = {r: s for r, s in self.short.items() if s <= step}
        self.committed = [s for s in self.committed if s <= step]
        self.work = {r: [s for s in steps if s <= step] for r, steps in self.work.items()}
        self.work = {r: steps for r, steps in self.work.items() if steps}
        self.last.clear()
        self.vouched.clear()
        self.spared.clear()
        self.seen = {}

    # -- the peer service -----------------------------------------------------------------

    def handle(self, source: int, method: str, payload):
        if method == "Holdings":
            return 0.0, lambda: ("ok", (self.holdings(), list(self.committed)))
        if method == "Join":
            return 0.0, lambda: self._joined(source, payload)
        if method == "Rollback":
            return 0.0, lambda: (self.roll_back(*payload), ("ok", None))[1]
        if method == "ResumeStep":
            return 0.0, lambda: ("ok", self.resume_step(payload))
        if method == "Replicate":
            # the holder pinned the copy for the pull: retention there cannot free it
            rank, step, run, incarnation = payload
            seconds = self.group.sim.rng.uniform(*self.group.cfg.transfer_seconds)
            return seconds, lambda: self._pulled(source, rank, step, run, incarnation)
        raise ValueError(method)

    def _joined(self, source: int, incarnation: int):
        if self.known.get(source, incarnation) != incarnation:
            self.last.pop(source, None)  # a new daemon there (a new address): it starts empty
            self.vouched.pop(source, None)
            self.replaced = True
        self.known[source] = incarnation
        self.mark(source, ("ok", None))
        return "ok", None

    def _pulled(self, source: int, rank: int, step: int, run: int, incarnation: int):
        holder = self.group.daemons[source]
        if not holder.alive or holder.incarnation != incarnation:
            return "error", "UNAVAILABLE"  # its bytes went with it: the pull broke off
        self.install(rank, step, run)
        return "ok", None

    # -- liveness -------------------------------------------------------------------------

    def mark(self, peer: int, result) -> None:
        if result[0] == "ok":
            self.live.add(peer)
            self.silent.pop(peer, None)
        elif peer in self.live:
            self.live.discard(peer)
            self.silent[peer] = self.now

    def not_dead(self) -> set[int]:
        limit = self.now - self.group.cfg.dead_after_seconds
        return self.live | {i for i, t in self.silent.items() if t > limit}

    def others(self) -> list[int]:
        return [i for i in range(self.group.cfg.daemons) if i != self.index]

    # -- the replicator ---------------------------------------------------------------------

    def replicator(self):
        cfg = self.group.cfg
        next_tick = self.now
        while True:
            if not self.work and self.now < next_tick:
                yield Wait(next_tick - self.now)
            if self.work:
                batch, self.work = self.work, {}
                for rank in sorted(batch):
                    yield from self._replicate_new(rank, group_view.roundest(batch[rank]))
                yield from self._refresh(only_commits=True)
            if self.now >= next_tick:
                for peer in sorted(set(self.others()) - self.live - self.joining):
                    self.joining.add(peer)
                    self.group.sim.spawn(self, self._join(peer))
                yield from self._refresh(only_commits=False)
                next_tick = self.now + cfg.refresh_seconds

    def _join(self, peer: int):
        self.mark(peer, (yield Call(peer, "Join", self.incarnation, self.group.cfg.call_timeout)))
        self.joining.discard(peer)

    def _replicate_new(self, rank: int, step: int):
        cfg = self.group.cfg
        acked = 0
        for target in group_view.successors(self.index, cfg.daemons, set(range(cfg.daemons)),
                                            cfg.daemons):
            if acked == cfg.replicas:
                break
            if target not in self.live and not (yield from self._probe(target)):
                continue
            acked += bool((yield from self._push(rank, step, target)))
        if acked < cfg.replicas:
            self.short[rank] = step
        else:
            self.short.pop(rank, None)

    def _probe(self, target: int):
        if self.now - self.probed.get(target, float("-inf")) < self.group.cfg.refresh_seconds:
            return False
        self.probed[target] = self.now
        result = yield Call(target, "Holdings", None, self.group.cfg.call_timeout)
        self.mark(target, result)
        return result[0] == "ok"

    def _push(self, rank: int, step: int, target: int):
        copy = self.copies.get((rank, step))
        if copy is None:
            return False  # freed meanwhile: a newer step replaced it
        result = yield Call(target, "Replicate", (rank, step, copy.run, self.incarnation),
                            self.group.cfg.transfer_timeout)
        self.mark(target, result)
        if result[0] != "ok":
            return False
        if (rank, step) in self.copies:
            self.copies[(rank, step)].replicated = True
        return True

    def _refresh(self, only_commits: bool):
        cfg = self.group.cfg
        if not self.copies and not self.committed and not self.group.registered(self):
            return  # no job here yet
        started, others = self.now, self.others()
        results = yield Gather(tuple(Call(i, "Holdings", None, cfg.call_timeout)
                                     for i in others))
        # its own copies as held now: the cap may have freed one while the peers answered,
        # and a step judged whole on it would be reported with a copy already gone
        holdings, silent = self.holdings(), set()
        for peer, result in zip(others, results, strict=True):
            self.mark(peer, result)
            if result[0] == "ok":
                self.last[peer], self.vouched[peer] = result[1]
                holdings += result[1][0]
            elif peer in self.not_dead():
                silent.add(peer)
                holdings += self.last.get(peer, [])
        changed = ({s for _, s in group_view.holders(holdings)} if silent
                   else group_view.newly_held(self.seen, holdings))
        if self.group.cfg.grace_from_group:
            self.seen = group_view.holders(holdings)
        else:  # as before the fix: the grace counts from the copy's own landing alone
            changed = set()
        stale = silent if self.group.cfg.fresh_judgement else set()
        held = set(self.committed)
        answered = {p for p, r in zip(others, results, strict=True) if r[0] == "ok"}
        lost, self.answered, self.replaced = self.answered - answered or self.replaced, \
            answered, False
        if cfg.peers_vouch:
            held |= {s for p in self.others() for s in self.vouched.get(p, ())}
            newest = self.committed[-1] if self.committed else -1
            if lost:
                self.spared |= {s for _, s in self.copies if s > newest}
            changed |= self.spared
        self.set_committed(group_view.kept_committed(self.group.world, holdings,
                                                     1 + cfg.replicas, None, held,
                                                     stale=stale),
                           changed, started)
        if self.committed:
            self.spared = {s for s in self.spared if s > self.committed[-1]}
        if only_commits or {p for p in silent if p not in self.last}:
            return
        kept = self.committed[-cfg.keep_steps:]
        unpushed = {(r, s) for (r, s), c in self.copies.items()
                    if not c.replica and not c.replicated}
        short = {(r, s) for r, s in self.short.items() if r not in self.work}
        if not cfg.leave_unpushed:
            unpushed = set()
        for rank, step, targets in group_view.re_replication(
                self.index, cfg.daemons, self.not_dead(), holdings, 1 + cfg.replicas,
                floor=kept[0] if kept else 0, unpushed=unpushed - short):
            for target in targets:
                yield from self._push(rank, step, target)


class Group:
    """The ring, the job's trainers and runs, the failures, and the checker."""

    def __init__(self, seed: int, cfg: Config | None = None):
        self.cfg = cfg or Config()
        self.sim = Sim(seed, self.cfg.faults)
        self.rng = self.sim.rng
        self.world = self.cfg.world
        self.daemons = [Daemon(self, i) for i in range(self.cfg.daemons)]
        self.sim.hosts = dict(enumerate(self.daemons))
        # runs: run -> (parent run, the step it resumed after); the first has none
        self.runs: dict[int, tuple[int | None, int]] = {0: (None, -1)}
        self.run = 0
        self.newest_committed = -1   # the newest step reported committed in this run
        self.training = False
        self.down: set[int] = set()  # hosts lost and not replaced yet
        self.resuming = False
        self.restores: list[dict] = []
        self.checked = 0
        for daemon in self.daemons:
            self.sim.spawn(daemon, daemon.replicator())
        self._start_run(first=0)
        for kind, every in (("host", self.cfg.host_loss_every),
                            ("restart", self.cfg.daemon_restart_every),
                            ("job", self.cfg.job_failure_every)):
            if every:
                self._schedule_failure(kind, every)

    # -- trainers -------------------------------------------------------------------------------

    def registered(self, daemon: Daemon) -> bool:
        return any(self.cfg.host_of(r) == daemon.index for r in range(self.world))

    def _start_run(self, first: int) -> None:
        self.training = True
        lo, hi = self.cfg.first_step_after
        run = self.run
        self.first_snapshot = [first + self.rng.randint(lo, hi) for _ in range(self.world)]
        self.sim.at(self.rng.uniform(*self.cfg.step_seconds), lambda: self._step(run, first))

    def _step(self, run: int, step: int) -> None:
        """Step ``step`` of every rank ended; each commits its snapshot a moment later
        (fetched in the next iteration's bubbles), from its first snapshot step on."""
        if run != self.run or not self.training:
            return
        for rank in range(self.world):
            if step >= self.first_snapshot[rank]:
                self.sim.at(self.commit_delay(rank),
                            lambda rank=rank: self._commit(run, rank, step))
        self.step_ended(step)
        self.sim.at(self.rng.uniform(*self.cfg.step_seconds), lambda: self._step(run, step + 1))

    def commit_delay(self, rank: int) -> float:
        """How long after a step ends ``rank``'s snapshot of it commits."""
        return self.rng.uniform(0.0, self.cfg.step_seconds[1])

    def step_ended(self, step: int) -> None:
        """Every rank's step ``step`` ended (scenarios hook failures on it)."""

    def _commit(self, run: int, rank: int, step: int) -> None:
        daemon = self.daemons[self.cfg.host_of(rank)]
        if run == self.run and self.training and daemon.alive:
            daemon.commit(rank, step, run)
            self.committed_by_trainer(rank, step)

    def committed_by_trainer(self, rank: int, step: int) -> None:
        """A trainer's commit was acknowledged (scenarios hook failures on it)."""

    # -- failures --------------------------------------------------------------------------------

    def _schedule_failure(self, kind: str, every: float) -> None:
        def strike():
            {"host": self._lose_host, "restart": self._restart_daemon,
             "job": self._fail_job}[kind]()
            self._schedule_failure(kind, every)
        self.sim.at(self.rng.expovariate(1.0 / every), strike)

    def _fully_copied(self) -> bool:
        """Whether losing one more host stays within the failure model: none is down and
        the newest committed step has 1 + k copies of every rank on live daemons."""
        if self.down or self.resuming:
            return False
        if self.newest_committed < 0:
            return True
        found = group_view.holders(self._live_holdings())
        return all(len(found.get((r, self.newest_committed), ())) >= 1 + self.cfg.replicas
                   for r in range(self.world))

    def _lose_host(self) -> None:
        if not self._fully_copied():
            return
        index = self.rng.randrange(self.cfg.daemons)
        daemon = self.daemons[index]
        daemon.alive, daemon.copies = False, {}
        self.down.add(index)
        self._fail_job()

        def replace():
            daemon.incarnation += 1
            daemon.alive = True
            daemon._fresh_view()
            self.down.discard(index)
            self.sim.spawn(daemon, daemon.replicator())
            for peer in daemon.others():
                self.sim.spawn(daemon, daemon._join(peer))
        self.sim.at(self.rng.uniform(*self.cfg.down_seconds), replace)

    def _restart_daemon(self) -> None:
        if self.down or self.resuming:
            return
        daemon = self.rng.choice(self.daemons)
        if not daemon.alive:
            return
        daemon.alive = False  # its copies stay in --shm-dir
        self.down.add(daemon.index)

        def restart():
            daemon.incarnation += 1
            daemon.alive = True
            self.down.discard(daemon.index)
            daemon._fresh_view()  # adopted copies wait for the group's committed steps
            self.sim.spawn(daemon, daemon.replicator())
            for peer in daemon.others():
                self.sim.spawn(daemon, daemon._join(peer))
        self.sim.at(self.rng.uniform(*self.cfg.down_seconds), restart)

    def _fail_job(self) -> None:
        if not self.training or self.resuming:
            return
        self.training = False
        self.resuming = True
        self.sim.at(self.rng.uniform(*self.cfg.down_seconds), self._resume)

    def _resume(self) -> None:
        if self.down or (self.cfg.atomic_rollback and self.sim.in_flight.get("Replicate")):
            self.sim.at(0.5, self._resume)  # the replacement host is not there yet
            return
        restorer = self.daemons[self.cfg.host_of(0)]
        if not restorer.alive:  # restarting: the trainer waits for it
            self.sim.at(0.5, self._resume)
            return
        if self.cfg.per_rank_resume:
            self.resume_steps: dict[int, int | None] = {}
            for rank in range(self.world):
                self.sim.spawn(self.daemons[self.cfg.host_of(rank)], self._rank_restore(rank))
            return
        self._resumed_at(restorer, None)

    def _rank_restore(self, rank: int):
        """One rank's restore without a step on its own daemon, at its own moment."""
        yield Sleep(self.rng.uniform(0.0, self.cfg.resume_spread))
        daemon = self.daemons[self.cfg.host_of(rank)]
        while True:
            decider = resume_rule.decider(daemon.index, daemon.not_dead())
            if not self.cfg.one_decider:  # the newest this rank's daemon knows of now
                steps = group_view.restorable_steps(self.world, daemon.view())
                step = steps[-1] if steps else None
            elif decider == daemon.index:
                step = daemon.resume_step(rank)
            else:
                result = yield Call(decider, "ResumeStep", rank, self.cfg.call_timeout)
                daemon.mark(decider, result)
                if result[0] != "ok":
                    yield Sleep(0.2)  # asked again (another decider once this one is dead)
                    continue
                step = result[1]
            break
        if step is not None:
            daemon.roll_back(step, resume=True)
            for peer in daemon.others():
                self.sim.spawn(daemon, self._roll_back_peer(daemon, peer, step))
        self.resume_steps[rank] = step
        if len(self.resume_steps) == self.world:
            steps = set(self.resume_steps.values())
            if len(steps) > 1:
                raise Violation(f"t={self.sim.now:.3f}: the ranks of one resume restored "
                                f"different steps: {dict(sorted(self.resume_steps.items()))}")
            self._resumed_at(daemon, steps.pop())

    def _resumed_at(self, restorer: Daemon, chosen: int | None) -> None:
        """The resume's checks and its new run; ``chosen``: the step the ranks took (None:
        the newest restorable now, one decision for all)."""
        holdings = self._live_holdings()
        steps = group_view.restorable_steps(self.world, holdings)
        record = {"at": self.sim.now, "run": self.run, "steps": steps,
                  "newest_committed": self.newest_committed, "held": held_by_rank(holdings)}
        self.restores.append(record)
        if not steps:
            if self.newest_committed >= 0:
                raise Violation(f"a resume found nothing to restore after step "
                                f"{self.newest_committed} was committed: {record}")
            for daemon in self.daemons:  # a new run under the job's name: the old one goes
                daemon.roll_back(-1)  # first, with what each daemon knew of it
            self._new_run(-1)
            return
        step = steps[-1] if chosen is None else chosen
        if step < self.newest_committed:
            raise Violation(f"the resume went back to step {step}, past step "
                            f"{self.newest_committed} committed: {record}")
        stale = [(h.index, h.rank) for h in holdings if h.step == step
                 and self.daemons[h.index].copies[(h.rank, h.step)].run != self.producer(step)]
        if stale:
            raise Violation(f"step {step} chosen for the resume has copies of another run's "
                            f"bytes at (daemon, rank) {stale}: {record}")
        record["restored"] = step
        if chosen is None:
            restorer.roll_back(step)
            for peer in restorer.others():
                self.sim.spawn(restorer, self._roll_back_peer(restorer, peer, step))
        self._new_run(step)

    def _roll_back_peer(self, restorer: Daemon, peer: int, step: int):
        restorer.mark(peer, (yield Call(peer, "Rollback", (step, self.cfg.per_rank_resume),
                                        self.cfg.call_timeout,
                                        reliable=self.cfg.atomic_rollback)))

    def _new_run(self, after: int) -> None:
        self.runs[len(self.runs)] = (self.run, after)
        self.run = len(self.runs) - 1
        self.newest_committed = -1
        self.resuming = False
        self._start_run(first=after + 1)

    def producer(self, step: int) -> int:
        """The run whose trainers wrote the bytes the current run's history has at ``step``."""
        run = self.run
        while self.runs[run][0] is not None and step <= self.runs[run][1]:
            run = self.runs[run][0]
        return run

    # -- the contract ---------------------------------------------------------------------------

    def _live_holdings(self) -> list[Holding]:
        return [h for d in self.daemons if d.alive for h in d.holdings()]

    def reported(self, daemon: Daemon) -> None:
        """``daemon`` took its committed steps anew: the newest is reported to trainers."""
        # (steps up to the one the run resumed after are history: that step is restored)
        newest = daemon.committed[-1] if daemon.committed else -1
        if newest > max(self.newest_committed, self.runs[self.run][1]):
            self.newest_committed = newest

    def check(self) -> None:
        """The newest step reported committed in this run is restorable whole, every rank
        from a live copy holding this run's bytes for it."""
        self.checked += 1
        step = self.newest_committed
        if step < 0:
            return
        want = self.producer(step)
        for rank in range(self.world):
            # a restarting daemon's copies count: they wait in its --shm-dir
            if not any(d.copies.get((rank, step)) is not None
                       and d.copies[(rank, step)].run == want for d in self.daemons):
                raise Violation(
                    f"t={self.sim.now:.3f} event {self.sim.events}: step {step}, reported "
                    f"committed, has no live copy of rank {rank} with run {want}'s bytes; "
                    f"held: {held_by_rank(self._live_holdings())}")

    def run_for(self, events: int, until=lambda: False) -> None:
        self.sim.run(events, self.check, until)


def held_by_rank(holdings, newest: int = 4) -> dict[int, list[int]]:
    """rank -> the newest steps the group holds of it (as a refused restore names them)."""
    per_rank: dict[int, set[int]] = {}
    for h in holdings:
        per_rank.setdefault(h.rank, set()).add(h.step)
    return {r: sorted(per_rank[r])[-newest:] for r in sorted(per_rank)}


__all__ = ["Config", "Daemon", "Faults", "Group", "Sleep", "Violation", "held_by_rank"]
