"""Bubble-aware snapshots of one pipeline stage (BAFT): fetch step k in iteration k+1's bubbles.

The pipeline runtime tells the snapshotter where it waits::

    snap = BubbleSnapshotter(client, stage=s)
    for it in range(steps):
        snap.begin_iteration(it)
        for position, action in enumerate(schedule):
            if action needs a neighbour's tensor:
                if it has arrived: snap.no_bubble(position)
                else:              tensor = snap.bubble(position, receive)   # fetches, then waits
            compute(action)
        state = update(state)
        snap.end_iteration(it, state)

The daemon plans, from the bubbles each stage reports, which chunks of the
held step to fetch in which bubble of which later iteration, and sends the
rank its whole plan whenever it changes. The snapshotter executes the plan
locally, so it never waits for the daemon inside a bubble: at each bubble it
copies the chunks planned there (device to host through Orbax's path, then
into the daemon's shared memory, hashing as it copies), then does the
blocking receive. If the runtime says the awaited tensor has arrived, the
copy into shared memory stops at the next 1 MiB block; what is left is
fetched in a later bubble or spilled. (The device-to-host transfer of a
tensor is not interrupted: on an accelerator a bubble that ends early can
still be overrun by one tensor's transfer.)
It announces each bubble as it begins (START: its position and the length
it expects; the daemon pushes replicas in them with ``--pace-replication``),
the first of an iteration with the plan version it holds, and once an
iteration sends the last iteration's bubble lengths (one REPORT); none is
waited for. What did not fit by the end of the snapshot
interval is fetched right away (spilled) and counted. The held state must not
be donated to the next step.
"""

import dataclasses
import logging
import time

import grpc

from bubblesnap.clients.jax import _layout
from bubblesnap.clients.jax._pending_step import Begun, PendingStep
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared.options import is_number, require

log = logging.getLogger("bubblesnap.client")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BubbleSnapshotOptions:
    """How a stage uses its bubbles.

    Attributes:
      warmup_iterations: iterations not reported at all (JIT compilation makes
        their bubbles meaningless), >= 0. Default 2.
      eager: ignore bubbles and copy the whole state right after the step
        (CheckFreq-style); the baseline bubbles are measured against.
        Default False.
      min_report_seconds: waits shorter than this, at positions that have
        never waited longer, are not reported, >= 0. Default 1 ms.
      smoothing: the weight of the newest wait in each position's moving
        average (which decides whether a short wait is reported), in (0, 1];
        1 keeps only the newest. Default 0.3.
    """

    warmup_iterations: int = 2
    eager: bool = False
    min_report_seconds: float = 1e-3
    smoothing: float = 0.3

    def __post_init__(self):
        require(self, "warmup_iterations", isinstance(self.warmup_iterations, int)
                     and not isinstance(self.warmup_iterations, bool)
                     and self.warmup_iterations >= 0, "a whole number >= 0")
        require(self, "eager", isinstance(self.eager, bool), "True or False")
        require(self, "min_report_seconds",
                     is_number(self.min_report_seconds) and self.min_report_seconds >= 0, ">= 0")
        require(self, "smoothing",
                     is_number(self.smoothing) and 0 < self.smoothing <= 1, "in (0, 1]")


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """One piece of snapshot work, for timelines: when, how many bytes, and whether it spilled."""

    step: int
    start: float
    stop: float
    nbytes: int
    spilled: bool


class BubbleSnapshotter:
    """Snapshots one stage's state in its pipeline bubbles through the local daemon.

    ``client`` is the stage's ``SnapshotClient`` (any DaemonClient: only its
    :attr:`~bubblesnap.clients.DaemonClient.session` is used). The hooks are
    :class:`~bubblesnap.clients.PipelineHooks`; none of them raises for daemon
    trouble.
    """

    def __init__(self, client, stage: int,
                 options: BubbleSnapshotOptions = BubbleSnapshotOptions()):
        self._session = client.session
        self._stage = stage
        self.options = options
        self._stream = self._session.bubble_stream()
        self._specs = _layout.SpecCache(self._session.world_size)
        self._registered = False
        self._iteration, self._iteration_started = -1, 0.0
        self._last_iteration_seconds = 0.0
        self._announced = -1          # the iteration whose START was sent
        self._reports: list[pb.BubbleReport] = []
        self._copied = [0, 0.0]  # bytes and seconds fetched this iteration, spills included
        self._outbox: tuple | None = None  # (iteration, seconds, reports) not sent yet
        self._lengths: dict[int, float] = {}  # moving average of each position's wait
        self._plan_version, self._interval = 0, 1
        self._choosers: list[tuple[int, int]] = []  # (first step, interval) of each plan seen
        self._plan: dict[tuple[int, int], tuple] = {}  # (offset, position) -> (chunks, commit)
        self._held: tuple[int, object] | None = None  # (step, state) not prepared yet
        self._next_begin: tuple[int, object] | None = None  # BeginStep sent ahead
        self._pending: PendingStep | None = None
        self.records: list[CopyRecord] = []
        self.overrun_seconds = 0.0
        self.commits_acknowledged: list[int] = []  # steps the daemon committed

    @property
    def interval(self) -> int:
        """The snapshot interval the daemon's plan chose (1 until a plan exists)."""
        return self._interval

    @property
    def iteration(self) -> int:
        """The iteration :meth:`begin_iteration` last began (-1 before the first)."""
        return self._iteration

    # -- the runtime's hooks -------------------------------------------------------------------

    def begin_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` starts: the last one's bubbles are reported in its first."""
        now = time.perf_counter()
        # After a gap (iterations this snapshotter did not see) the length is unknown.
        self._last_iteration_seconds = (now - self._iteration_started
                                        if iteration == self._iteration + 1 else 0.0)
        if self._reports or self._copied[0]:
            self._outbox = (self._iteration, self._last_iteration_seconds, self._reports,
                            self._copied)
            self._reports, self._copied = [], [0, 0.0]
        self._iteration, self._iteration_started = iteration, now

    def no_bubble(self, position: int) -> None:
        """The stage did not have to wait at ``position`` this time."""
        self._report(position, 0.0)

    def bubble(self, position: int, receive, arrived=None):
        """Uses the bubble at ``position``, then returns ``receive()``'s value.

        ``receive()`` blocks until the neighbour's tensor is there and returns
        (value, arrival time on the perf_counter clock). ``arrived()``, if
        given, says without blocking whether it is there: fetching stops then.
        """
        if not self._reporting() or self.options.eager:
            return receive()[0]
        started = time.perf_counter()
        self._announce(position)
        self._prepare()
        pending = self._pending
        copied, copy_seconds = self._copy_planned(position, arrived)
        done = time.perf_counter()
        value, arrival = receive()
        measured = max(arrival - started, 0.0)
        overrun = max(done - arrival, 0.0) if copied else 0.0
        self.overrun_seconds += overrun
        if pending is not None and pending is self._pending:  # not committed in this bubble
            pending.usage.offered_seconds += measured
            pending.usage.overrun_seconds += overrun
        self._report(position, measured, copied, copy_seconds)
        return value

    def end_iteration(self, iteration: int, state) -> None:
        """Step ``iteration`` finished with ``state``: spill what is due, maybe hold this state.

        Holding only keeps a reference; the bookkeeping happens in the next
        bubble, where the stage is idle anyway.
        """
        if not self._registered:
            self._register(state)  # the daemon must know the rank before its bubbles are reported
        if self._held is not None or (self._pending is not None
                                      and iteration - self._pending.step >= self._interval):
            self.flush()
        if self._pending is None and self._should_snapshot(iteration):
            self._held = (iteration, state)
            if self.options.eager:
                self.flush()

    def flush(self) -> None:
        """Fetches and commits the held step now, if any (training waits for it)."""
        self._prepare()
        if self._pending is not None:
            self._finish(self._pending)

    def close(self) -> None:
        """Closes the bubble stream and waits for the commits in flight (not the client)."""
        self._stream.close()
        self._session.wait()

    # -- internals ------------------------------------------------------------------------------

    def _reporting(self) -> bool:
        # A data-parallel replica that is not its group's copier has nothing to copy:
        # it neither reports bubbles (no plan for it) nor holds a state.
        return (self._registered and self._session.copier == self._session.rank
                and self._iteration >= self.options.warmup_iterations)

    def _should_snapshot(self, iteration: int) -> bool:
        if not self._reporting():
            return False
        if self.options.eager:
            return True
        # Every rank picks the same steps: a plan chooses only from its first step on.
        chooser = [c for c in self._choosers if c[0] <= iteration]
        if not chooser:
            return False
        first, interval = chooser[-1]
        return (iteration - first) % interval == 0

    def _register(self, state) -> None:
        if self._session.quiet():
            return
        names, leaves, _ = _layout.flatten(state)
        try:
            self._session.ensure_registered(self._specs.specs(names, leaves))
            self._registered = True
        except grpc.RpcError as err:
            self._drop(err)

    def _announce(self, position: int) -> None:
        """A START at each bubble worth it (the daemon pushes replicas inside them); in
        the iteration's first also last iteration's REPORT, and a newer plan adopted."""
        expected = self._lengths.get(position, 0.0)
        event = dict(job=self._session.job, rank=self._session.rank, stage=self._stage,
                     step=self._pending.step if self._pending else -1)
        if self._announced == self._iteration:
            if expected >= self.options.min_report_seconds:
                # The plan version received, so the daemon does not send it again.
                latest = self._stream.latest
                self._stream.send(pb.BubbleEvent(
                    kind=pb.BubbleEvent.START, iteration=self._iteration, position=position,
                    expected_seconds=expected, plan_version=latest.plan_version
                    if latest is not None else self._plan_version, **event))
            return
        self._announced = self._iteration
        if self._outbox is not None:
            iteration, seconds, reports, (copied, copy_seconds) = self._outbox
            self._outbox = None
            self._stream.send(pb.BubbleEvent(kind=pb.BubbleEvent.REPORT, iteration=iteration,
                                             iteration_seconds=seconds, reports=reports,
                                             copied_bytes=copied, copy_seconds=copy_seconds,
                                             **event))
        self._stream.send(pb.BubbleEvent(kind=pb.BubbleEvent.START, iteration=self._iteration,
                                         position=position, expected_seconds=expected,
                                         plan_version=self._plan_version, **event))
        latest = self._stream.latest
        if latest is not None and latest.plan_version != self._plan_version:
            self._plan_version, self._interval = latest.plan_version, max(1, latest.interval)
            earlier = [c for c in self._choosers if c[0] < latest.first_step][-1:]
            self._choosers = [*earlier, (latest.first_step, self._interval)]
            self._plan = {(a.offset, a.position): (tuple(a.chunks), a.commit)
                          for a in latest.assignments}

    def _prepare(self) -> None:
        """Turns the held state into a pending snapshot: layout, slots, hashers, BeginStep."""
        if self._held is None:
            return
        step, state = self._held
        self._held = None
        refusal = self._session.refusal(step, block=False)
        if refusal is not None:
            log.warning("stage %d: no snapshot of step %d: %s", self._stage, step, refusal.reason)
            return
        names, leaves, _ = _layout.flatten(state)
        specs = self._specs.specs(names, leaves)
        ahead, self._next_begin = self._next_begin, None
        try:
            begun = ahead[1] if ahead and ahead[0] == step else self._session.begin_async(
                step, specs)
        except (grpc.RpcError, OSError, ValueError) as err:
            self._drop(err)
            return
        self._pending = PendingStep.of(step, leaves, specs, time.perf_counter(), begun)

    def _copy_planned(self, position: int, arrived) -> tuple[int, float]:
        """Copies the chunks the plan puts in this bubble: (bytes, seconds)."""
        pending = self._pending
        if pending is None:
            return 0, 0.0
        chunks, commit = self._plan.get((self._iteration - pending.step, position), ((), False))
        if not chunks:
            return 0, 0.0
        if pending.staging is None and not pending.begun.ready(arrived or (lambda: True)):
            return 0, 0.0  # the daemon did not answer BeginStep within this bubble
        started = time.perf_counter()
        try:
            pending.fetch({c.tensor for c in chunks})
            copied = sum(pending.copy(pending.slot_of[(c.tensor, c.shard)], c.stop, arrived)
                         for c in chunks)
        except (grpc.RpcError, OSError, ValueError) as err:
            self._drop(err)
            return 0, 0.0
        if not copied:
            return 0, 0.0
        seconds = time.perf_counter() - started
        self._copied[0] += copied
        self._copied[1] += seconds
        self.records.append(CopyRecord(pending.step, started, started + seconds, copied, False))
        pending.usage.used_seconds += seconds
        pending.usage.bubbles += 1
        # The commit goes out before this bubble ends: count it as its copy time.
        if commit and pending.complete():
            pending.usage.offered_seconds += seconds
            self._finish(pending)
        return copied, seconds

    def _finish(self, pending: PendingStep) -> None:
        """Copies whatever is left (spilled: training waits), commits, begins the next step."""
        started = time.perf_counter()
        try:
            left = pending.copy_rest()
        except (grpc.RpcError, OSError, ValueError) as err:
            self._drop(err)
            return
        if left:
            seconds = time.perf_counter() - started
            self._copied[0] += left
            self._copied[1] += seconds
            self.records.append(CopyRecord(pending.step, started, started + seconds, left, True))
            pending.usage.spilled_seconds += seconds
            pending.usage.spilled_bytes += left
        pending.usage.iterations = max(1, self._iteration - pending.step)
        step, interval = pending.step, self._interval
        # The commit also begins the next snapshot step, so its memory is ready
        # before that step's first bubble.
        future = self._session.commit(step, pending.started, pending.checksums(), pending.usage,
                                      next_step=step + interval)
        self._pending = None

        def on_commit(done) -> None:  # runs on a gRPC thread
            if done.exception() is not None:
                return
            self.commits_acknowledged.append(step)
            answer = done.result()
            if answer.HasField("next"):
                try:
                    self._next_begin = (step + interval,
                                        Begun(self._session.staging_of(step + interval,
                                                                       answer.next)))
                except (OSError, ValueError):
                    pass  # the next step begins in its own bubble instead
        future.add_done_callback(on_commit)

    def _drop(self, err: Exception) -> None:
        step = self._pending.step if self._pending else -1
        result = self._session.failed(step, time.perf_counter(), err)
        log.warning("stage %d: %s", self._stage, result.reason)
        self._pending = None

    def _report(self, position: int, measured: float, copied: int = 0,
                seconds: float = 0.0) -> None:
        if not self._reporting():
            return
        floor = self.options.min_report_seconds
        known = self._lengths.get(position, 0.0)
        if measured < floor and known < floor:
            return
        weight = self.options.smoothing
        self._lengths[position] = (1 - weight) * known + weight * measured if known else measured
        self._reports.append(pb.BubbleReport(position=position, measured_seconds=measured,
                                             copied_bytes=copied, copy_seconds=seconds))
