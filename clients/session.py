"""The framework-neutral core of a client: talk to the daemon, stage, commit, restore.

The JAX and numpy clients turn their arrays into shard specs and host buffers and leave
the rest to :class:`Session`; code that stages a step in pieces (``BubbleSnapshotter``,
over several bubbles) uses its calls one by one: :meth:`Session.begin_async`,
:meth:`Session.commit`, :meth:`Session.failed`. A session never lets a slow or missing
daemon stall training: a snapshot that does not wait goes through the session's
:class:`~bubblesnap.clients.save_lane.SaveLane` (the copy, never a round trip); every
call has a deadline, a failure turns into "no snapshot this step" with the reason, and a
snapshot that waits is not tried again for a while after a timeout.
"""

import contextlib
import logging
import os
import time

import grpc
import numpy as np

from bubblesnap.clients._bubble_stream import BubbleStream
from bubblesnap.clients._commits import CommitsInFlight
from bubblesnap.clients._job_commit import job_outcome, wait_committed
from bubblesnap.clients._log_calls import LogCalls
from bubblesnap.clients._regions import in_request_order
from bubblesnap.clients._restore_call import restore_call
from bubblesnap.clients._shared_memory import Heartbeat, SegmentMaps
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import LogError, RawStep, RestoreError, SnapshotResult
from bubblesnap.clients.save_lane import SaveLane
from bubblesnap.clients.staging import PendingStaging, Staging
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import daemon_pb2_grpc
from bubblesnap.protos.checksum import checksum
from bubblesnap.shared.trainer_api import TOKEN_ENV, with_token

log = logging.getLogger("bubblesnap.client")
#: The longest a channel waits to dial an away daemon again (gRPC's: up to two minutes).
REDIAL_SECONDS = 1.0


def wait_mode(wait: bool | str) -> str:
    """What a snapshot's ``wait`` asks for: "" (nothing), "rank" (True: this rank's copy
    checked and kept by its daemon) or "job" (the job committed the step)."""
    if wait is False or wait is True:
        return "rank" if wait else ""
    if wait in ("rank", "job"):
        return wait
    raise ValueError(f"wait={wait!r}: pass False, True (or 'rank': until this rank's copy is "
                     "safe in its daemon) or 'job' (until the job committed the step)")


class Session:
    """One rank of one job, talking to its daemon.

    ``replica_group``: the ranks whose state is identical to this rank's (its
    data-parallel replicas). Only the group's lowest rank, its copier, copies
    the state; the daemon holds the others through its copies.

    Attributes:
      job, rank, world_size, options: as given.
      copier: the rank that copies this rank's state (itself unless it is a
        replica that is not its group's lowest rank).
    """

    def __init__(self, job: str, rank: int, world_size: int, options: ClientOptions,
                 replica_group=()):
        self.job, self.rank, self.world_size = job, rank, world_size
        self.options = options
        self._replica_group = tuple(sorted({rank, *replica_group})) if replica_group else ()
        self.copier = min(self._replica_group, default=rank)
        # Answers carrying layouts or log pages may pass gRPC's default 4 MiB.
        self._channel = grpc.insecure_channel(options.daemon, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(REDIAL_SECONDS * 1000))])
        self._stub = daemon_pb2_grpc.DaemonStub(with_token(
            self._channel, options.token or os.environ.get(TOKEN_ENV, "")))
        self._maps = SegmentMaps()
        self._heartbeat = Heartbeat("")
        self._tensors: tuple = ()
        self._registered = False
        self._quiet_until = 0.0
        self._bound = float("inf")  # a bounded block's deadline
        self._last_warning = ""
        #: commits sent, and saves that failed after their call returned
        self.commits = CommitsInFlight(self.failed, self._answered)
        self._lane = SaveLane(self)
        self._logs = LogCalls(job, rank, self._stub, options)

    # -- calls with deadlines -------------------------------------------------

    def call(self, method: str, request):
        """Calls ``method`` with the session's deadline; raises grpc.RpcError."""
        return getattr(self._stub, method)(request, timeout=self.timeout())

    def call_async(self, method: str, request):
        """Calls ``method`` with the session's deadline without waiting; its future."""
        return getattr(self._stub, method).future(request, timeout=self.timeout())

    def wait_committed(self, step: int, timeout: float) -> bool:
        """Whether the job committed ``step`` within ``timeout`` s; raises grpc.RpcError."""
        return wait_committed(self._stub, self.job, step, timeout, self.options)[0]

    def timeout(self) -> float:
        """The deadline of a call made now (``options.rpc_timeout_seconds``, or less in a
        :meth:`bounded` block)."""
        return min(self.options.rpc_timeout_seconds, self._bound)

    @contextlib.contextmanager
    def bounded(self, seconds: float):
        """Calls made in the block (on any thread) wait at most ``seconds``: a save that
        must not wait long for a sick daemon."""
        before, self._bound = self._bound, seconds
        try:
            yield
        finally:
            self._bound = before

    def registered(self, tensors) -> bool:
        """Whether the layout ``tensors`` is the one registered."""
        return self._registered and tuple(tensors) == self._tensors

    def ensure_registered(self, tensors) -> None:
        """Registers ``tensors`` unless that layout is already registered; raises grpc.RpcError."""
        if not self._registered or tuple(tensors) != self._tensors:
            self.register(tensors)

    def register(self, tensors) -> pb.RegisterResponse:
        """Declares the layout; raises grpc.RpcError if the daemon refuses it."""
        response = self.call("Register", pb.RegisterRequest(
            job=self.job, rank=self.rank, world_size=self.world_size, tensors=tensors,
            replica_group=self._replica_group))
        self._tensors, self._registered = tuple(tensors), True
        try:  # the old one is closed once no thread reads it (Heartbeat.__del__)
            self._heartbeat = Heartbeat(response.heartbeat_path)
        except OSError:  # another machine's daemon, or not readable by this user
            self._heartbeat = Heartbeat("")
        return response

    def daemon_beat(self):
        """How the daemon is doing, read off its heartbeat (``heartbeat_file.Beat``; None:
        not known)."""
        return self._heartbeat.read()

    def answers(self, timeout: float = REDIAL_SECONDS * 1.5) -> bool:
        """Whether the daemon answers within ``timeout`` s (a refusal is an answer), waiting
        for the channel to dial a restarted daemon again (after up to ``REDIAL_SECONDS``
        and gRPC's jitter of a fifth)."""
        try:
            self._stub.Status(pb.StatusRequest(job=self.job), timeout=timeout,
                              wait_for_ready=True)
        except grpc.RpcError as err:
            return err.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
        return True

    def gone(self, timeout: float) -> bool:
        """Whether the daemon is gone: its address refuses the call (a daemon stopped or
        busy past ``timeout`` is not)."""
        try:
            self._stub.Status(pb.StatusRequest(job=self.job), timeout=timeout)
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.UNAVAILABLE
        return False

    def sick_for(self) -> float:
        """How long the daemon has been sick by its heartbeat (``Heartbeat.sick_for``:
        silent past ``options.sick_after_seconds`` where only its clock tells); 0.0 while
        it runs or when there is no heartbeat to read."""
        return self._heartbeat.sick_for(self.options.sick_after_seconds)

    # -- snapshot -------------------------------------------------------------

    def snapshot(self, step: int, tensors, fetch, wait: bool | str = True) -> SnapshotResult:
        """Stages one step: ``fetch()`` returns host arrays in slot order.

        ``tensors`` is the layout of this step; it is (re)registered when it
        differs from the last one. ``wait``: False returns once the bytes are
        in shared memory, or set aside for it when the daemon has not answered
        the last call yet (:mod:`~bubblesnap.clients.save_lane`: never a round
        trip); True or ``"rank"`` waits for the daemon to check and keep this
        rank's copy; ``"job"`` then waits (at most
        ``options.commit_timeout_seconds``) for the whole job to commit the
        step. :class:`SnapshotResult` says which (``waited_for``). Never
        raises for daemon trouble.
        """
        mode = wait_mode(wait)
        started = time.perf_counter()
        if not mode and self.copier == self.rank:
            self.commits.collect(block=False)
            return self._lane.save(step, tensors, fetch, started)
        refusal = self.refusal(step)
        if refusal is not None:
            return refusal
        if self.copier != self.rank:
            held = self._held_by_copier(step, tensors, started)
            if mode != "job" or held.copied_by is None:
                return held
            return job_outcome(self._stub, self.job, self.options, held, started)
        try:
            begun = time.perf_counter()
            self._lane.settle()  # saves that did not wait go first
            staging = self._lane.take_reservation(step, tensors) or self.begin(step, tensors)
            copying = time.perf_counter()
            for (offset, nbytes), array in zip(staging.slots, fetch(), strict=True):
                np.copyto(staging.segment[offset:offset + nbytes], array)
            phases = {"begin": copying - begun, "copy": time.perf_counter() - copying}
            self.commit(step, started, phases=phases,
                        staged_as=staging.step if staging.step != step else None)
        except (grpc.RpcError, OSError, ValueError) as err:
            return self.failed(step, started, err)
        if not mode:
            return SnapshotResult(step, True, None, "", time.perf_counter() - started,
                                  phases=phases)
        outcome = self.wait()
        if mode == "rank" or not outcome.taken:
            return outcome
        return job_outcome(self._stub, self.job, self.options, outcome, started)

    def _held_by_copier(self, step: int, tensors, started: float) -> SnapshotResult:
        """A replica's snapshot: nothing is fetched or copied, the copier's copy holds
        this state. The rank is registered (once) so the daemon knows its group."""
        try:
            self.ensure_registered(tensors)
        except grpc.RpcError as err:
            return self.failed(step, started, err)
        return SnapshotResult(step, False, None,
                              f"rank {self.rank} is held through rank {self.copier}'s snapshot "
                              f"(replica group {list(self._replica_group)}); nothing to copy",
                              time.perf_counter() - started, copied_by=self.copier)

    def refusal(self, step: int, block: bool = True) -> SnapshotResult | None:
        """Collects earlier commits; says why not to snapshot now (None: go ahead).

        With ``block`` false only commits already answered are collected.
        """
        started = time.perf_counter()
        self.commits.collect(block)
        now = time.monotonic()
        if now < self._quiet_until:
            return SnapshotResult(step, False, False, f"daemon {self.options.daemon} did not "
                                  f"answer recently; retrying in {self._quiet_until - now:.1f} s",
                                  time.perf_counter() - started)
        return None

    def staging_of(self, step: int, answer: pb.BeginStepResponse) -> Staging:
        """The mapped segment and slots of a BeginStep answer."""
        segment = self._maps.view(answer.segment_path, answer.segment_bytes)
        return Staging(step, segment, tuple((s.offset, s.nbytes) for s in answer.slots))

    def begin(self, step: int, tensors) -> Staging:
        """Registers if needed and reserves the step's segment; raises grpc.RpcError."""
        return self.begin_async(step, tensors)()

    def begin_async(self, step: int, tensors) -> PendingStaging:
        """Like :meth:`begin`, but returns at once; the answer is waited for when used."""
        self.ensure_registered(tensors)
        future = self._stub.BeginStep.future(
            pb.BeginStepRequest(job=self.job, rank=self.rank, step=step),
            timeout=self.timeout())
        return PendingStaging(step, future, self)

    def commit(self, step: int, started: float, checksums=(), usage=None, next_step=None,
               phases=None, staged_as=None, late=False):
        """Sends the commit without waiting and returns its future; :meth:`wait` collects it.

        With ``next_step`` the daemon also begins that step; :meth:`staging_of`
        turns the answer into its :class:`Staging`. ``staged_as``: the step the
        segment was begun as, when not ``step``. ``phases``: the snapshot's so
        far, which its outcome reports with ``commit`` added. ``late``: a save
        whose call returned already; a failure is kept for :meth:`take_late_failures`.
        """
        request = pb.CommitStepRequest(job=self.job, rank=self.rank, step=step,
                                       checksums=checksums, usage=usage, next_step=next_step,
                                       staged_as=staged_as)
        future = self._stub.CommitStep.future(request, timeout=self.timeout())
        self.commits.add(step, future, started, phases or {}, late)
        return future

    def wait(self) -> SnapshotResult | None:
        """Waits for every snapshot in flight (set aside, or its commit sent); returns the
        outcome of the newest (None if none)."""
        self._lane.settle()
        return self.commits.collect(block=True)

    def take_late_failures(self) -> list[SnapshotResult]:
        """Saves that returned without waiting and then failed (a commit refused, bytes
        set aside replaced or never handed over), oldest first, since the last call."""
        return self.commits.take_late()

    def _answered(self, step: int) -> None:
        if self._last_warning:
            log.warning("snapshots go on from step %d: daemon %s answers again", step,
                        self.options.daemon)
            self._last_warning = ""

    def quiet(self) -> bool:
        """Whether the daemon failed recently and is being left alone."""
        return time.monotonic() < self._quiet_until

    def failed(self, step: int, started: float, err: Exception) -> SnapshotResult:
        """Turns a failed call into "no snapshot", backing off if the daemon is unreachable."""
        if not isinstance(err, grpc.RpcError):  # shared memory trouble: mapping, permissions
            self._quiet_until = time.monotonic() + self.options.backoff_seconds
            reason = f"shared memory of daemon {self.options.daemon}: {err}"
            self.warn(step, reason)
            return SnapshotResult(step, False, False, reason, time.perf_counter() - started)
        code = err.code()
        if code == grpc.StatusCode.NOT_FOUND:
            self._registered = False  # a restarted daemon: register again next time
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._quiet_until = time.monotonic() + self.options.backoff_seconds
            self._registered = False  # a restarted daemon has forgotten us
            reason = f"daemon {self.options.daemon} {code.name.lower().replace('_', ' ')}"
        else:
            reason = f"daemon refused: {code.name}: {err.details()}"
        self.warn(step, reason)
        return SnapshotResult(step, False, False, reason, time.perf_counter() - started)

    def warn(self, step: int, reason: str) -> None:
        """Logs why a step was not snapshotted, once per reason in a row: a daemon away
        for a thousand steps is one line, and one more when it answers again."""
        if reason != self._last_warning:
            self._last_warning = reason
            log.warning("no snapshot of step %d: %s", step, reason)

    # -- restore --------------------------------------------------------------

    def restore(self, step: int | None = None, alone: bool = False,
                tensors=()) -> RawStep:
        """Maps a committed step handed over by the daemon; raises RestoreError.

        ``tensors`` (``pb.TensorRequest``): restore these regions, wherever
        the job holds them; the answer comes back in request order (see
        ``RawStep``), checked against the request. Empty: the rank's own copy.
        """
        self._lane.settle()
        if not alone:
            self._lane.drop_reservation()  # the job may go back to an earlier step
        request = pb.RestoreRequest(job=self.job, rank=self.rank,
                                    replica_group=self._replica_group, alone=alone,
                                    world_size=self.world_size, tensors=tensors,
                                    skip_answer_checksums=not self.options.verify_restore)
        if step is not None:
            request.step = step
        found, segments, phases = restore_call(self._stub, request, self.options)
        verified = time.perf_counter()
        shards = {}
        for slot, expected in zip(found.slots, found.checksums, strict=True):
            data = segments[slot.segment][slot.offset:slot.offset + slot.nbytes]
            if self.options.verify_restore and checksum(data) != expected:
                raise RestoreError(
                    f"step {found.step}: {found.tensors[slot.tensor].name!r} shard {slot.shard} "
                    "does not match its checksum in this process; restore again")
            shards[(slot.tensor, slot.shard)] = data
        if self.options.verify_restore:
            phases["verify"] = time.perf_counter() - verified
        raw = RawStep(found.step, tuple(found.tensors), shards, found.source or "memory",
                      found.world_size, phases)
        return in_request_order(tensors, raw) if tensors else raw

    def bubble_stream(self) -> BubbleStream:
        """A Bubbles stream on this session's channel."""
        return BubbleStream(self._stub, self.options.backoff_seconds)

    # -- training log ---------------------------------------------------------

    def log(self, step: int, payload: bytes, stream: str = "") -> None:
        """Sends one record to the training log (""), or keeps one for a boundary
        ``stream`` until :meth:`wait_log` (see ``LogCalls.log``). Thread-safe."""
        self._logs.log(step, payload, stream)

    def wait_log(self) -> int:
        """Sends the kept boundary records and waits for every record sent so far; the
        fewest daemons holding a training-log record (0: none). Raises LogError."""
        return self._logs.wait_log()

    def read_log(self, after_step: int, stream: str = "",
                 until_step: int | None = None) -> tuple[list[tuple[int, bytes]], str]:
        """(step, payload) records after ``after_step`` (through ``until_step``) without
        gaps, and their sources. Raises LogError."""
        return self._logs.read_log(after_step, stream, until_step)

    def status(self) -> pb.JobStatus:
        """This job's status as the daemon reports it; raises grpc.RpcError."""
        response = self.call("Status", pb.StatusRequest(job=self.job))
        return response.jobs[0]

    def close(self) -> None:
        """Collects the commits and log records in flight, then closes the channel."""
        self.wait()
        self._lane.close()
        try:
            self.wait_log()  # kept boundary records go out before the channel closes
        except LogError as err:
            log.warning("%s", err)
        self._maps.close()
        self._heartbeat.close()
        self._channel.close()
