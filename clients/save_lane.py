"""Saves that never wait for the daemon: the next step's segment reserved at each commit,
and a save with no reservation in hand set aside and handed over by a thread of its own.

A save that does not wait (``wait=False``: ``SnapshotClient.snapshot``'s default, the
async ``CheckpointManager``) costs the training thread its copy and nothing more,
whatever the daemon is doing:

- In the steady state each commit asks the daemon to begin the next step too
  (``next_step``), so the next save copies straight into a segment already reserved
  and mapped, and sends its commit without waiting for it (the reservation's number
  goes along as ``staged_as`` when the save is of a later step: a client cannot know
  which step it saves next).
- With no reservation in hand (the first save, a new layout, a failed call, no memory
  to spare) the bytes are copied aside, into a buffer of the client's, and the lane's
  thread hands them over: Register and BeginStep as needed, the copy, the commit.
- A save that finds the lane busy (the last commit or hand-over not answered yet)
  waits for it while the daemon runs, as Orbax's manager waits for its previous save
  (a daemon behind, not sick). Whether it runs is read off its heartbeat file
  (``bubblesnap.shared.heartbeat_file``): where this process sees the daemon's process, the
  kernel says whether it is stopped or dead; elsewhere a clock older than
  ``ClientOptions.sick_after_seconds`` says it is frozen. A sick daemon's save is
  skipped at once, "no snapshot this step". With no heartbeat to read, the wait ends
  at the call deadline, and saves are skipped without waiting until the daemon
  answers. A save that finds the lane free tries again, so the first save after the
  daemon answers again is taken: no back-off outlives the fault, and a frozen daemon
  costs training a few milliseconds once (``sick_after_seconds`` where only the
  clock tells).

One buffer of a step's size exists once a save was set aside, reused after.
"""

import dataclasses
import threading
import time

import grpc
import numpy as np

from bubblesnap.clients.results import SnapshotResult
from bubblesnap.clients.staging import Staging
from bubblesnap.protos import daemon_pb2 as pb

#: What a failed call raises in the lane: the daemon's refusal or absence, or trouble
#: with its shared memory (mapping, a segment of the wrong size).
_TROUBLE = (grpc.RpcError, OSError, ValueError)
#: Failures that are no answer of the daemon's.
_NO_ANSWER = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.CANCELLED)


@dataclasses.dataclass
class _Aside:
    """A save's bytes waiting in the client for the daemon to answer."""

    step: int
    tensors: tuple
    buffer: np.ndarray
    slots: list  # (offset, nbytes) of each slot in ``buffer``
    started: float
    copy_seconds: float


class SaveLane:
    """The saves of one :class:`~bubblesnap.clients.session.Session` that do not wait.

    Thread-safe against its own thread and gRPC's callback threads; called by one
    training thread.
    """

    def __init__(self, session):
        self._session = session
        self._cond = threading.Condition()
        self._reserved: tuple[tuple, Staging] | None = None  # (layout, its staging)
        self._awaiting = 0  # commits sent whose answer was not handled yet
        self._aside: _Aside | None = None
        self._handing_over = False
        self._buffer: np.ndarray | None = None  # what is set aside is copied into
        self._busy_since: float | None = None  # when the lane last found work
        self._sick_since: float | None = None  # a wait ran out; no answer since
        self._thread: threading.Thread | None = None
        self._closed = False

    def save(self, step: int, tensors, fetch, started: float) -> SnapshotResult:
        """Copies ``fetch()``'s arrays (slot order) into the reserved segment and sends the
        commit, or sets them aside for the lane's thread; never waits for the daemon."""
        tensors = tuple(tensors)
        with self._cond:
            sick = self._wait_free()
            staging = None if sick else self._take_reservation(step, tensors)
        if sick:
            self._session.warn(step, f"daemon {self._session.options.daemon} does not answer; "
                               "snapshots are skipped until it does")
            return SnapshotResult(step, False, False, f"daemon {self._session.options.daemon} "
                                  f"has not answered for {sick:.1f} s",
                                  time.perf_counter() - started)
        if staging is None:
            return self._set_aside(step, tensors, fetch, started)
        copying = time.perf_counter()
        try:
            for (offset, nbytes), array in zip(staging.slots, fetch(), strict=True):
                np.copyto(staging.segment[offset:offset + nbytes], array)
        except _TROUBLE as err:
            return self._session.failed(step, started, err)
        phases = {"copy": time.perf_counter() - copying}
        self._send(step, tensors, staging, started, phases)
        return SnapshotResult(step, True, None, "", time.perf_counter() - started,
                              phases=phases)

    def take_reservation(self, step: int, tensors) -> Staging | None:
        """The reserved segment, for a save of ``step`` that waits (after :meth:`settle`),
        or None; the caller commits it with ``staged_as=staging.step``."""
        with self._cond:
            return self._take_reservation(step, tuple(tensors))

    def settle(self) -> None:
        """Waits until nothing is aside and every commit sent was answered (each call has
        its deadline, so this ends)."""
        with self._cond:
            self._cond.wait_for(lambda: self._aside is None and not self._handing_over
                                and not self._awaiting)

    def drop_reservation(self) -> None:
        """Gives the reserved segment back (a restore: the job may go back to an earlier
        step, and its daemons drop later copies)."""
        with self._cond:
            reserved, self._reserved = self._reserved, None
        if reserved is not None:
            self._abort(reserved[1].step)

    def close(self) -> None:
        """Ends the lane's thread (after :meth:`settle`: nothing is lost)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the training thread's side -------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._awaiting) or self._aside is not None or self._handing_over

    def _wait_free(self) -> float:
        """Waits (lock held) for the lane to be free while the daemon runs; 0 when it is,
        else how long the daemon has been silent (it is sick: skip this save)."""
        options = self._session.options
        deadline = time.monotonic() + options.rpc_timeout_seconds
        while self._busy():
            sick = self._session.sick_for()
            if sick:
                return sick  # stopped (the kernel says) or silent
            if self._sick_since is not None:
                return time.monotonic() - self._sick_since  # no answer since a wait ran out
            left = deadline - time.monotonic()
            if left <= 0:
                self._sick_since = self._busy_since
                return time.monotonic() - self._sick_since
            # the heartbeat is read again every few ms; without one, the lane's end wakes it
            self._cond.wait(min(left, 0.005) if self._session.daemon_beat() is not None
                            else left)
        return 0.0

    def _working(self) -> None:
        """The lane found work (lock held)."""
        if self._busy_since is None:
            self._busy_since = time.monotonic()

    def _maybe_idle(self, answered: bool) -> None:
        """Work ended (lock held); ``answered``: the daemon answered (it is not sick)."""
        if answered:
            self._sick_since = None
        if not self._busy():
            self._busy_since = None
        self._cond.notify_all()

    def _take_reservation(self, step: int, tensors: tuple) -> Staging | None:
        """The reservation, if a save of ``step`` can use it now (lock held)."""
        if self._busy() or self._reserved is None or not self._session.registered(tensors):
            return None
        layout, staging = self._reserved
        if layout != tensors or staging.step > step:
            return None  # the lane's thread gives it back
        self._reserved = None
        return staging

    def _set_aside(self, step: int, tensors: tuple, fetch, started: float) -> SnapshotResult:
        """Copies the save into the lane's buffer for its thread (the lane is free)."""
        copying = time.perf_counter()
        try:
            arrays = fetch()
            total = sum(a.nbytes for a in arrays)
            if self._buffer is None or self._buffer.nbytes < total:
                self._buffer = np.empty(total, dtype=np.uint8)
            slots, offset = [], 0
            for array in arrays:
                np.copyto(self._buffer[offset:offset + array.nbytes], array)
                slots.append((offset, array.nbytes))
                offset += array.nbytes
        except _TROUBLE as err:
            return self._session.failed(step, started, err)
        seconds = time.perf_counter() - copying
        with self._cond:
            self._aside = _Aside(step, tensors, self._buffer, slots, started, seconds)
            self._working()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bubblesnap-save-lane",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return SnapshotResult(step, True, None, "", time.perf_counter() - started,
                              phases={"aside": seconds})

    # -- both sides -----------------------------------------------------------------------

    def _send(self, step: int, tensors: tuple, staging: Staging, started: float,
              phases: dict) -> None:
        """Sends the commit of ``step`` (staged as ``staging.step``), asking for the next
        step's segment; its answer is handled on gRPC's thread."""
        with self._cond:
            self._awaiting += 1
            self._working()
        try:
            future = self._session.commit(
                step, started, next_step=step + 1, phases=phases, late=True,
                staged_as=staging.step if staging.step != step else None)
        except BaseException:
            self._answered(step + 1, tensors, None)
            raise
        future.add_done_callback(lambda done: self._answered(step + 1, tensors, done))

    def _answered(self, next_step: int, tensors: tuple, future) -> None:
        staging, answered = None, False
        try:
            response = future.result() if future is not None else None
            answered = response is not None
            if answered and response.HasField("next"):
                staging = self._session.staging_of(next_step, response.next)
        except grpc.RpcError as err:  # the commit's own outcome is collected by the session
            answered = err.code() not in _NO_ANSWER
        except (OSError, ValueError, grpc.FutureCancelledError):
            pass
        finally:
            with self._cond:
                self._awaiting -= 1
                if staging is not None:
                    self._reserved = (tensors, staging)
                self._maybe_idle(answered)

    def _abort(self, step: int) -> None:
        """Gives a reserved segment back without waiting (if the call is lost, the daemon
        drops the segment at the rank's next BeginStep or registration)."""
        session = self._session
        session.call_async("AbortStep", pb.AbortStepRequest(job=session.job, rank=session.rank,
                                                             step=step))

    # -- the lane's thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._aside is not None or self._closed)
                if self._aside is None:
                    return
                # set aside only when no commit was awaited: a reservation is in or not
                aside, self._aside, self._handing_over = self._aside, None, True
                reserved, self._reserved = self._reserved, None
            answered = False
            try:
                answered = self._hand_over(aside, reserved)
            finally:
                with self._cond:
                    self._handing_over = False
                    self._maybe_idle(answered)

    def _hand_over(self, aside: _Aside, reserved) -> bool:
        """Register (a new layout), BeginStep (no usable reservation), copy, commit; whether
        the daemon answered."""
        session = self._session
        if reserved is not None and (reserved[0] != aside.tensors
                                     or reserved[1].step > aside.step):
            self._abort(reserved[1].step)
            reserved = None
        begun = time.perf_counter()
        try:
            if not session.registered(aside.tensors):
                reserved = None  # a registration drops the rank's staged segments
            staging = reserved[1] if reserved is not None else session.begin(aside.step,
                                                                             aside.tensors)
            copying = time.perf_counter()
            if [nbytes for _, nbytes in staging.slots] != [n for _, n in aside.slots]:
                raise ValueError(f"the daemon's slots for step {aside.step} do not match the "
                                 "bytes set aside (the layout changed)")
            for (offset, nbytes), (start, _) in zip(staging.slots, aside.slots, strict=True):
                staging.segment[offset:offset + nbytes] = aside.buffer[start:start + nbytes]
            phases = {"aside": aside.copy_seconds, "begin": copying - begun,
                      "copy": time.perf_counter() - copying}
            self._send(aside.step, aside.tensors, staging, aside.started, phases)
        except _TROUBLE as err:
            session.commits.note_late(session.failed(aside.step, aside.started, err))
            return not isinstance(err, grpc.RpcError) or err.code() not in _NO_ANSWER
        return True
