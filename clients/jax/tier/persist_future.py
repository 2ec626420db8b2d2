"""The commit future of an item a daemon writes: done once this process's part of the item
is durable in the item's folder (Orbax then finalizes the step).

Orbax's manager waits on the futures a handler's ``async_save`` returns before it
finalizes the step (``wait_until_finished``, the next ``save``), and raises what they
raise as it raises a failed save of its own. The write was asked for before ``save``
returned (memory_tier.py: Persist); this one, on a thread of its own, watches the item's
folder for the daemon's answer (persist.py of the daemon): the rank's sidecar (left for
whoever finalizes the step: saves_in_flight.py) or why the write failed.

A training step must not wait on a sick daemon (DESIGN). A daemon that has not answered
within ``wait_seconds`` (a few times what its recent writes took, at least a floor:
ClientOptions.persist_wait_*), or is gone, no longer writes the part: ``fallback`` has
Orbax write it here, as plain Orbax would, and moves it in with one rename that the
daemon's own late write then loses (the daemon drops its write when it wakes). Without a
fallback (a process of a job of several: parts must be cut alike) the future waits, and
fails once the daemon is gone, or stopped or silent for
``ClientOptions.persist_timeout_seconds``, or the folder Orbax makes never appears.
"""

import os
import threading
import time

from bubblesnap.shared import checkpoint_record

#: How often the folder is looked at: first soon (a small item is written in
#: milliseconds), then every few: the step's finalizing, and the next save, wait for the
#: answer (a look is one stat).
_FIRST_POLL, _MOST_POLL = 0.0005, 0.002
#: How often (and how long) a daemon whose heartbeat went silent is asked whether it is
#: gone, while its answer is awaited.
_ASK_EVERY = 0.5


class PersistError(RuntimeError):
    """A daemon did not write a step's item it had in memory to the item's folder: the
    step is not saved (raised by ``wait_until_finished`` or the next ``save``)."""


class PersistFuture:
    """Orbax's ``Future`` (``result(timeout)``, ``cancel()``) of one daemon write.

    ``fallback(why) -> bool | None``: writes the part here instead (True: written; False:
    the daemon's write got there first; None: it cannot). ``on_answer(seconds)``: the
    daemon wrote the part, in that time."""

    def __init__(self, session, step: int, folder: str, *, fallback=None,
                 wait_seconds: float = float("inf"), on_answer=None):
        self._session, self._step, self._folder = session, step, folder
        self._fallback, self._wait_seconds, self._on_answer = fallback, wait_seconds, on_answer
        self._asked = time.monotonic()
        self._next_ask = 0.0  # when the daemon may be asked whether it is gone
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
            self._wait_for_answer()
        except BaseException as err:  # the future carries it to whoever waits
            self._error = err
        finally:
            self._done.set()

    def _wait_for_answer(self) -> None:
        rank, options = self._session.rank, self._session.options
        done = os.path.join(self._folder, checkpoint_record.persisted_file(rank))
        failed = os.path.join(self._folder, checkpoint_record.failed_file(rank))
        made_by = self._asked + options.persist_timeout_seconds
        pause, sick_since = _FIRST_POLL, None
        while True:
            if os.path.exists(done):
                if self._on_answer is not None:
                    self._on_answer(time.monotonic() - self._asked)
                return
            if os.path.exists(failed):
                with open(failed, errors="replace") as f:
                    why = f.read(4000)
                raise PersistError(f"step {self._step}: the daemon could not write this "
                                   f"process's copy into {self._folder}: {why}")
            made = os.path.isdir(self._folder)
            if self._cancelled or (time.monotonic() > made_by and not made):
                raise PersistError(f"step {self._step}: {self._folder} was not made; the "
                                   "daemon did not write this process's copy of it")
            gone = self._daemon_gone()
            late = time.monotonic() - self._asked > self._wait_seconds
            if made and (gone or late) and self._write_here(
                    "is gone" if gone else f"did not answer within {self._wait_seconds:.1f} s"):
                return
            if gone:
                raise PersistError(f"step {self._step}: daemon {options.daemon} is gone; its "
                                   f"write of this process's copy into {self._folder} is lost")
            sick_since = self._sick_since(sick_since)
            time.sleep(pause)
            pause = min(pause * 1.5, _MOST_POLL)

    def _write_here(self, why: str) -> bool:
        """Whether the part was written here (the fallback, tried once)."""
        fallback, self._fallback = self._fallback, None
        if fallback is None:
            return False
        return bool(fallback(why))

    def _daemon_gone(self) -> bool:
        """Whether the daemon is gone (its socket refuses us), asked at most every
        :data:`_ASK_EVERY` once its heartbeat went silent (a stopped daemon, or one only
        slow to write its clock, answers later)."""
        if not self._session.sick_for() or time.monotonic() < self._next_ask:
            return False
        self._next_ask = time.monotonic() + _ASK_EVERY
        return self._session.gone(_ASK_EVERY)

    def _sick_since(self, sick_since: float | None) -> float | None:
        """When the daemon looks stopped or silent since (None: it runs); PersistError when
        it is sick for longer than the options allow."""
        session = self._session
        if not session.sick_for():
            return None
        now = time.monotonic()
        if sick_since is None:
            return now
        if now - sick_since > session.options.persist_timeout_seconds:
            raise PersistError(f"step {self._step}: daemon {session.options.daemon} has been "
                               f"stopped or silent for {now - sick_since:.0f} s while it writes "
                               f"{self._folder} (ClientOptions.persist_timeout_seconds)")
        return sick_since
