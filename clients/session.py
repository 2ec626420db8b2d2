"""The framework-neutral core of a client: talk to the daemon, stage, commit, restore.

The JAX and numpy clients turn their arrays into shard specs and host
buffers and leave the rest to :class:`Session`; code that stages a step in
pieces (``BubbleSnapshotter``, over several bubbles) uses its calls one by
one: :meth:`Session.begin_async`, :meth:`Session.commit`,
:meth:`Session.failed`. A session never lets a slow or missing daemon stall
training: every call has a deadline, a failure turns into "no snapshot this
step" with the reason, and after a timeout the session stops asking for a
while instead of paying the deadline every step.
"""

import logging
import threading
import time

import grpc
import numpy as np

from bubblesnap.clients._bubble_stream import BubbleStream
from bubblesnap.clients._shared_memory import SegmentMaps, map_restored
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import LogError, RawStep, RestoreError, SnapshotResult
from bubblesnap.clients.staging import PendingStaging, Staging
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import daemon_pb2_grpc
from bubblesnap.protos.checksum import checksum

log = logging.getLogger("bubblesnap.client")


#: Kept boundary records are sent once they reach this many bytes, even before wait_log.
LOG_BATCH_BYTES = 8 << 20


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
        self._channel = grpc.insecure_channel(
            options.daemon, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._stub = daemon_pb2_grpc.DaemonStub(self._channel)
        self._maps = SegmentMaps()
        self._tensors: tuple = ()
        self._registered = False
        self._quiet_until = 0.0
        self._in_flight: list = []  # (step, future, started) of commits not yet collected
        self._log_pending: list = []  # (what, future, is training log) not awaited
        self._log_kept: dict[str, list] = {}  # boundary records not sent yet, by stream
        self._log_kept_bytes = 0
        self._log_lock = threading.Lock()

    # -- calls with deadlines -------------------------------------------------

    def call(self, method: str, request):
        """Calls ``method`` with the session's deadline; raises grpc.RpcError."""
        return getattr(self._stub, method)(request, timeout=self.options.rpc_timeout_seconds)

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
        return response

    # -- snapshot -------------------------------------------------------------

    def snapshot(self, step: int, tensors, fetch, wait: bool = True) -> SnapshotResult:
        """Stages one step: ``fetch()`` returns host arrays in slot order.

        ``tensors`` is the layout of this step; it is (re)registered when it
        differs from the last one. Never raises for daemon trouble.
        """
        started = time.perf_counter()
        refusal = self.refusal(step)
        if refusal is not None:
            return refusal
        if self.copier != self.rank:
            return self._held_by_copier(step, tensors, started)
        try:
            staging = self.begin(step, tensors)
            for (offset, nbytes), array in zip(staging.slots, fetch(), strict=True):
                np.copyto(staging.segment[offset:offset + nbytes], array)
            self.commit(step, started)
        except (grpc.RpcError, OSError, ValueError) as err:
            return self.failed(step, started, err)
        if not wait:
            return SnapshotResult(step, True, None, "", time.perf_counter() - started)
        return self.wait()

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
        self._collect(block)
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
            timeout=self.options.rpc_timeout_seconds)
        return PendingStaging(step, future, self)

    def commit(self, step: int, started: float, checksums=(), usage=None, next_step=None):
        """Sends the commit without waiting and returns its future; :meth:`wait` collects it.

        With ``next_step`` the daemon also begins that step; :meth:`staging_of`
        turns the answer into its :class:`Staging`.
        """
        request = pb.CommitStepRequest(job=self.job, rank=self.rank, step=step,
                                       checksums=checksums, usage=usage, next_step=next_step)
        future = self._stub.CommitStep.future(request, timeout=self.options.rpc_timeout_seconds)
        self._in_flight.append((step, future, started))
        return future

    def wait(self) -> SnapshotResult | None:
        """Waits for every commit in flight; returns the outcome of the newest (None if none)."""
        return self._collect(block=True)

    def _collect(self, block: bool) -> SnapshotResult | None:
        outcome, still = None, []
        for step, future, started in self._in_flight:
            if not block and not future.done():
                still.append((step, future, started))
                continue
            try:
                response = future.result()
                outcome = SnapshotResult(step, True, response.job_committed, "",
                                         time.perf_counter() - started)
            except grpc.RpcError as err:
                outcome = self.failed(step, started, err)
        self._in_flight = still
        return outcome

    def quiet(self) -> bool:
        """Whether the daemon failed recently and is being left alone."""
        return time.monotonic() < self._quiet_until

    def failed(self, step: int, started: float, err: Exception) -> SnapshotResult:
        """Turns a failed call into "no snapshot", backing off if the daemon is unreachable."""
        if not isinstance(err, grpc.RpcError):  # shared memory trouble: mapping, permissions
            self._quiet_until = time.monotonic() + self.options.backoff_seconds
            reason = f"shared memory of daemon {self.options.daemon}: {err}"
            log.warning("no snapshot of step %d: %s", step, reason)
            return SnapshotResult(step, False, False, reason, time.perf_counter() - started)
        code = err.code()
        if code == grpc.StatusCode.NOT_FOUND:
            self._registered = False  # a restarted daemon: register again next time
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._quiet_until = time.monotonic() + self.options.backoff_seconds
            self._registered = False  # a restarted daemon has forgotten us
            reason = (f"daemon {self.options.daemon} {code.name.lower().replace('_', ' ')}; "
                      f"no snapshots for {self.options.backoff_seconds:.0f} s")
        else:
            reason = f"daemon refused: {code.name}: {err.details()}"
        log.warning("no snapshot of step %d: %s", step, reason)
        return SnapshotResult(step, False, False, reason, time.perf_counter() - started)

    # -- restore --------------------------------------------------------------

    def restore(self, step: int | None = None, alone: bool = False) -> RawStep:
        """Maps a committed step handed over by the daemon; raises RestoreError."""
        request = pb.RestoreRequest(job=self.job, rank=self.rank,
                                    replica_group=self._replica_group, alone=alone)
        if step is not None:
            request.step = step
        try:
            found = self._stub.Restore(request, timeout=self.options.restore_timeout_seconds)
        except grpc.RpcError as err:
            raise RestoreError(f"daemon {self.options.daemon}: {err.code().name}: "
                               f"{err.details()}") from None
        try:
            segment = map_restored(found.segment_path)
        except FileNotFoundError:
            raise RestoreError(f"step {found.step} was deleted while it was being restored; "
                               "restore again") from None
        shards = {}
        for slot, expected in zip(found.slots, found.checksums, strict=True):
            data = segment[slot.offset:slot.offset + slot.nbytes]
            if self.options.verify_restore and checksum(data) != expected:
                raise RestoreError(
                    f"step {found.step}: {found.tensors[slot.tensor].name!r} shard {slot.shard} "
                    "does not match its checksum in this process; restore again")
            shards[(slot.tensor, slot.shard)] = data
        return RawStep(found.step, tuple(found.tensors), shards, found.source or "memory")

    def bubble_stream(self) -> BubbleStream:
        """A Bubbles stream on this session's channel."""
        return BubbleStream(self._stub, self.options.backoff_seconds)

    # -- training log ---------------------------------------------------------

    def log(self, step: int, payload: bytes, stream: str = "") -> None:
        """Sends one record to the training log (""), or keeps one for a boundary
        ``stream`` until :meth:`wait_log` sends the kept ones in one call (a
        stage sends a tensor per microbatch: one call each would cost more than
        the bytes). :meth:`wait_log` collects the answers. Thread-safe."""
        record = pb.LogRecord(step=step, payload=payload)
        if stream:
            with self._log_lock:
                self._log_kept.setdefault(stream, []).append(record)
                self._log_kept_bytes += len(payload)
                full = self._log_kept_bytes >= LOG_BATCH_BYTES
            if full:
                self._send_kept()
            return
        request = pb.AppendLogRequest(job=self.job, rank=self.rank, records=[record])
        future = self._stub.AppendLog.future(request, timeout=self.options.rpc_timeout_seconds)
        with self._log_lock:
            self._log_pending.append((f"step {step}", future, True))

    def _send_kept(self) -> None:
        with self._log_lock:
            kept, self._log_kept, self._log_kept_bytes = self._log_kept, {}, 0
            if not kept:
                return
            request = pb.AppendLogsRequest(logs=[
                pb.AppendLogRequest(job=self.job, rank=self.rank, stream=stream, records=records)
                for stream, records in kept.items()])
            future = self._stub.AppendLogs.future(request,
                                                  timeout=self.options.rpc_timeout_seconds)
            self._log_pending.append((
                "boundary records of steps " + ", ".join(sorted(
                    {str(r.step) for records in kept.values() for r in records})),
                future, False))

    def wait_log(self) -> int:
        """Sends the kept boundary records, waits for every record sent so far; returns
        the fewest daemons holding one of the training-log records (0: none
        pending; boundary records are held by this host's daemon alone). Raises
        LogError if one was not stored."""
        self._send_kept()
        with self._log_lock:
            pending, self._log_pending = self._log_pending, []
        copies, failed = [], []
        for what, future, training in pending:
            try:
                answer = future.result()
                if training:
                    copies.append(answer.copies)
            except grpc.RpcError as err:
                failed.append(f"{what}: {err.code().name}: {err.details()}")
        if failed:
            raise LogError(f"not logged by daemon {self.options.daemon}: {'; '.join(failed)}")
        return min(copies, default=0)

    def read_log(self, after_step: int, stream: str = "",
                 until_step: int | None = None) -> tuple[list[tuple[int, bytes]], str]:
        """(step, payload) records after ``after_step`` (through ``until_step``) without
        gaps, and their sources (the daemon answers a page at a time)."""
        records, sources = [], set()
        while True:
            try:
                answer = self._stub.ReadLog(pb.ReadLogRequest(job=self.job, rank=self.rank,
                                                              after_step=after_step,
                                                              stream=stream,
                                                              until_step=until_step),
                                            timeout=self.options.restore_timeout_seconds)
            except grpc.RpcError as err:
                raise LogError(f"daemon {self.options.daemon}: {err.code().name}: "
                               f"{err.details()}") from None
            if answer.records:
                records += [(r.step, r.payload) for r in answer.records]
                sources.add(answer.source)
            if not answer.records or (until_step is not None and records[-1][0] >= until_step):
                return records, ", ".join(sorted(sources)) or "memory"
            after_step = records[-1][0]

    def status(self) -> pb.JobStatus:
        """This job's status as the daemon reports it; raises grpc.RpcError."""
        response = self.call("Status", pb.StatusRequest(job=self.job))
        return response.jobs[0]

    def close(self) -> None:
        """Collects the commits and log records in flight, then closes the channel."""
        self.wait()
        try:
            self.wait_log()  # kept boundary records go out before the channel closes
        except LogError as err:
            log.warning("%s", err)
        self._maps.close()
        self._channel.close()
