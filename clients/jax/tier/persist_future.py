"""The commit future of an item a daemon writes: done once the daemon's write of this
process's copy into the item's folder is durable (Orbax then finalizes the step).

Orbax's manager waits on the futures a handler's ``async_save`` returns before it
finalizes the step (``wait_until_finished``, the next ``save``), and raises what they
raise as it raises a failed save of its own. This one, on a thread of its own: waits
for the item's folder (Orbax may make it in the background), asks the daemon to write
the committed copy there (Persist), then watches the folder for the daemon's answer
(persist.py of the daemon): the rank's sidecar (removed here, so that the step holds
what Orbax writes) or why the write failed. A daemon that is gone fails it at once; one
stopped or silent for ``ClientOptions.persist_timeout_seconds`` fails it then.
"""

import os
import threading
import time

import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import checkpoint_record

#: How often the folder is looked at: first soon (a small item is written in
#: milliseconds), then every few: the step's finalizing, and the next save, wait for the
#: answer (a look is one stat).
_FIRST_POLL, _MOST_POLL = 0.0005, 0.002


class PersistError(RuntimeError):
    """A daemon did not write a step's item it had in memory to the item's folder: the
    step is not saved (raised by ``wait_until_finished`` or the next ``save``)."""


class PersistFuture:
    """Orbax's ``Future`` (``result(timeout)``, ``cancel()``) of one daemon write."""

    def __init__(self, session, step: int, folder: str):
        self._session, self._step, self._folder = session, step, folder
        self._done = threading.Event()
        self._cancelled = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"bubblesnap-persist-{step}")
        self._thread.start()

    def result(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"step {self._step}: the daemon's write into {self._folder} "
                               f"did not finish within {timeout} s")
        if self._error is not None:
            raise self._error

    def cancel(self) -> bool:
        self._cancelled = True
        return False

    def _run(self) -> None:
        try:
            self._wait_for_folder()
            self._ask()
            self._wait_for_answer()
        except BaseException as err:  # the future carries it to whoever waits
            self._error = err
        finally:
            self._done.set()

    def _wait_for_folder(self) -> None:
        """Orbax makes the item's folder, in the background when its options say so."""
        deadline = time.monotonic() + self._session.options.persist_timeout_seconds
        pause = _FIRST_POLL
        while not os.path.isdir(self._folder):
            if self._cancelled or time.monotonic() > deadline:
                raise PersistError(f"step {self._step}: {self._folder} was not made; the "
                                   "daemon did not write this process's copy of it")
            time.sleep(pause)
            pause = min(pause * 2, _MOST_POLL)

    def _ask(self) -> None:
        session = self._session
        try:
            session.call("Persist", pb.PersistRequest(job=session.job, rank=session.rank,
                                                      step=self._step, directory=self._folder))
        except grpc.RpcError as err:
            raise PersistError(f"step {self._step}: daemon {session.options.daemon} did not "
                               f"take the write into {self._folder}: {err.code().name}: "
                               f"{err.details()}") from None

    def _wait_for_answer(self) -> None:
        rank = self._session.rank
        done = os.path.join(self._folder, checkpoint_record.persisted_file(rank))
        failed = os.path.join(self._folder, checkpoint_record.failed_file(rank))
        pause, sick_since = _FIRST_POLL, None
        while True:
            if os.path.exists(done):
                _remove(done)
                return
            if os.path.exists(failed):
                with open(failed, errors="replace") as f:
                    why = f.read(4000)
                _remove(failed)
                raise PersistError(f"step {self._step}: the daemon could not write this "
                                   f"process's copy into {self._folder}: {why}")
            sick_since = self._check_daemon(sick_since)
            time.sleep(pause)
            pause = min(pause * 1.5, _MOST_POLL)

    def _check_daemon(self, sick_since: float | None) -> float | None:
        """When the daemon looks stopped or silent since (None: it runs); PersistError when
        it is gone, or sick for longer than the options allow."""
        session = self._session
        if not session.sick_for():
            return None
        now = time.monotonic()
        if sick_since is None:
            try:  # dead, or stopped (SIGSTOP), or only slow to write its clock?
                session.call("Status", pb.StatusRequest(job=session.job))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    raise PersistError(f"step {self._step}: daemon {session.options.daemon} "
                                       "is gone; its write of this process's copy into "
                                       f"{self._folder} is lost") from None
            return now
        if now - sick_since > session.options.persist_timeout_seconds:
            raise PersistError(f"step {self._step}: daemon {session.options.daemon} has been "
                               f"stopped or silent for {now - sick_since:.0f} s while it writes "
                               f"{self._folder} (ClientOptions.persist_timeout_seconds)")
        return sick_since


def _remove(path: str) -> None:
    """The daemon's answer taken away, and its folder once empty (the last process's)."""
    try:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass  # another process's answer is still there, or it went first
