"""The CheckpointManager saves in flight this daemon watches, and finishes when their
trainer dies (DESIGN: a step a daemon holds whole survives its trainer).

The daemon holding the primary process's part of a step is told of the step's record
(bubblesnap/shared/save_in_flight.py) with that part's Persist. From then on it watches
the trainer's lock: while the primary process lives, the lock is held and Orbax finalizes
the step in the trainer (the trainer removes the record after). Once the lock is free
with the record still there, the trainer died (or exited) before finalizing: the step is
judged (finish_rule.judge) and, once whole, finalized here with Orbax's own code
(orbax_finalize.py), else dropped when its parts can no longer come. A resumed manager
asks for the same at once (``finish``), and waits for the answer before it lists steps.

Why the primary's daemon: Orbax's primary process is the one that finalizes a step, so
its death is what leaves a step unfinalized, and its daemon is the one that can see that
death without a guess: the lock lives in the kernel of the host they share (on a local
filesystem, or a network one that keeps POSIX locks). The daemon that happened to finish
the last part could only guess, from another host, whether the primary still lives; the
parts' answers (sidecars in the item folders) tell the primary's daemon when every part
is durable, wherever it was written.
"""

import collections
import dataclasses
import errno
import fcntl
import logging
import os
import threading
import time

from bubblesnap.service.durable import finish_rule, orbax_finalize, persist
from bubblesnap.service.errors import FailedPrecondition, InvalidArgument, NotFound, shown
from bubblesnap.shared import checkpoint_record, save_in_flight
from bubblesnap.shared.save_in_flight import Record

log = logging.getLogger("bubblesnap.daemon")

#: How often watched saves are looked at: a step whose trainer died is finalized within
#: about this much of its last part being durable.
_EVERY_SECONDS = 0.1
#: The saves watched at once (each holds a file open): past it, the oldest is let go.
MOST_WATCHED = 256
#: What happened to saves in flight, kept for Status: the newest this many.
_NOTES_KEPT = 16
_SHOWN = 300


@dataclasses.dataclass
class _Watch:
    folder: str
    record: Record
    lock_fd: int | None = None  # held once the trainer's lock was found free
    lock_inode: int = 0
    gone_since: float | None = None
    finish_now: bool = False
    state: str = "watching"  # "watching", "finalized", "dropped"
    why: str = ""


class SaveFinisher:
    """Watches saves in flight of managers whose directories lie inside ``durable_dir``."""

    def __init__(self, durable_dir: str, timing: finish_rule.Timing = finish_rule.Timing()):
        self._root = os.path.realpath(durable_dir)
        self._timing = timing
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="save-finisher", daemon=True)
        self._notes: collections.deque = collections.deque(maxlen=_NOTES_KEPT)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10)
        with self._lock:
            for watch in self._watches.values():
                _release(watch)
            self._watches.clear()

    # -- the calls ----------------------------------------------------------------------

    def watch(self, record_path: str) -> None:
        """Watches the save whose record is at ``record_path`` (InvalidArgument or
        FailedPrecondition when it is none inside the durable tier)."""
        folder, record = self._read(record_path)
        with self._lock:
            known = self._watches.get(folder)
            if known is None or known.record != record:
                if known is not None:
                    _release(known)
                self._watches[folder] = _Watch(folder, record)
                self._let_go_oldest()
        self._wake.set()

    def finish(self, record_path: str, drop: bool = False) -> tuple[str, str]:
        """For a resumed manager, whose trainers are all gone: the save is finished now if
        it is whole, dropped if its parts can no longer come (or if ``drop``), else
        waited for; (its state, why). NotFound when the record is gone (finalized)."""
        self.watch(record_path)
        folder = os.path.dirname(record_path)
        with self._lock:
            watch = self._watches.get(folder)
            if watch is None:
                raise NotFound(f"no save in flight is recorded at {shown(record_path, _SHOWN)}")
            watch.finish_now = True
            self._look(watch, drop=drop)
            if watch.state == "watching" and watch.lock_fd is None:
                return "alive", watch.why
            return watch.state, watch.why

    def watched(self) -> list[tuple[str, int, str, str]]:
        """(directory, step, state, why) of every save watched, for Status."""
        with self._lock:
            return [(w.record.directory, w.record.step, w.state, w.why)
                    for w in self._watches.values()]

    def note(self, what: str) -> None:
        """Keeps ``what`` happened to a save in flight (said in the log too) for Status."""
        log.warning("durable: %s", what)
        self._notes.append(f"{time.strftime('%H:%M:%S')} {what}")

    def notes(self) -> list[str]:
        """What happened lately to saves in flight (finished here, dropped, written by
        their trainers), oldest first."""
        return list(self._notes)

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                for watch in list(self._watches.values()):
                    try:
                        self._look(watch)
                    except Exception:  # a bug here must not end the watching of the rest
                        log.exception("durable: looking at the save of step %d of %s failed",
                                      watch.record.step, watch.record.directory)
                    if watch.state != "watching":
                        _release(watch)
                        del self._watches[watch.folder]
                busy = bool(self._watches)
            self._wake.wait(_EVERY_SECONDS if busy else None)
            self._wake.clear()

    def _look(self, watch: _Watch, drop: bool = False) -> None:
        """One look at a watched save, under the lock: finalized, dropped or left."""
        if watch.state != "watching":
            return
        record = watch.record
        if not os.path.exists(os.path.join(watch.folder, save_in_flight.RECORD)):
            watch.state, watch.why = "finalized", "its trainer finalized it"
            return
        if watch.lock_fd is None and not self._trainer_gone(watch):
            if drop:
                raise FailedPrecondition(f"step {record.step} of {shown(record.directory, _SHOWN)} "
                                         "is still being saved by a live trainer")
            watch.why = "its trainer lives and finalizes it"
            return
        if not _same_lock(watch):  # a new save of the step took the folder over
            watch.state, watch.why = "dropped", "a new save of the step took its place"
            return
        gone_for = time.monotonic() - watch.gone_since
        verdict = finish_rule.judge(record, _seen(record, watch.folder), gone_for,
                                    watch.finish_now, self._timing)
        if drop and verdict.action == "wait":
            verdict = finish_rule.Verdict("drop", "dropped by its resumed manager: " +
                                          verdict.why)
        if verdict.action == "finalize":
            orbax_finalize.finalize(record, watch.folder)
            self.note(f"finalized step {record.step} of {record.directory}, which its trainer "
                      f"had left in flight ({verdict.why})")
            watch.state, watch.why = "finalized", "finalized by this daemon: " + verdict.why
        elif verdict.action == "finalized":
            watch.state, watch.why = "finalized", verdict.why
        elif verdict.action == "drop":
            self.note(f"dropped step {record.step} of {record.directory}, left in flight by "
                      f"its trainer: {verdict.why}")
            watch.state, watch.why = "dropped", verdict.why
        else:
            watch.why = verdict.why
            return
        save_in_flight.remove(record.directory, record.step)

    def _trainer_gone(self, watch: _Watch) -> bool:
        """Takes the trainer's lock if it is free (the trainer is gone)."""
        path = os.path.join(watch.folder, save_in_flight.LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # its trainer is removing the finalized save's folder
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        watch.lock_fd, watch.lock_inode = fd, os.fstat(fd).st_ino
        watch.gone_since = time.monotonic()
        log.info("durable: the trainer saving step %d of %s is gone; the step is finished "
                 "here", watch.record.step, watch.record.directory)
        return True

    def _read(self, record_path: str) -> tuple[str, Record]:
        """The pending folder and the record at ``record_path``, checked."""
        folder = os.path.dirname(record_path)
        pending = os.path.dirname(folder)
        directory = os.path.dirname(os.path.dirname(pending))
        if os.path.basename(record_path) != save_in_flight.RECORD or \
                not os.path.basename(folder).isdigit() or \
                os.path.join(directory, save_in_flight.FOLDER) != pending:
            raise InvalidArgument(f"{shown(record_path, _SHOWN)} is not the record of a save "
                                  f"in flight (<directory>/{save_in_flight.FOLDER}/<step>/"
                                  f"{save_in_flight.RECORD})")
        resolved = os.path.realpath(folder)
        if os.path.commonpath([self._root, resolved]) != self._root or resolved != folder:
            raise FailedPrecondition(f"{shown(record_path, _SHOWN)} is outside this daemon's "
                                     f"durable tier {shown(self._root, _SHOWN)}, or through a "
                                     "symbolic link")
        try:
            with open(record_path, errors="replace") as f:
                text = f.read(save_in_flight.MAX_RECORD_BYTES + 1)
            return folder, Record.from_json(text, directory)
        except FileNotFoundError:
            raise NotFound(f"no save in flight is recorded at "
                           f"{shown(record_path, _SHOWN)}") from None
        except (OSError, ValueError) as err:
            raise InvalidArgument(f"{shown(record_path, _SHOWN)} is not a record of a save "
                                  f"in flight: {shown(str(err), _SHOWN)}") from None

    def _let_go_oldest(self) -> None:
        while len(self._watches) > MOST_WATCHED:
            oldest = next(iter(self._watches))
            _release(self._watches.pop(oldest))


def _seen(record: Record, folder: str) -> finish_rule.Seen:
    """What the step's folders hold now."""
    sidecars, writing, failed = {}, {}, {}
    for item in record.items:
        state = os.path.join(item.tmp, checkpoint_record.STATE_DIR)
        names = _names(state)
        sidecars[item.name] = _ranks(names, ".json")
        # a write whose marker went stale died with its daemon (or froze): not coming
        writing[item.name] = frozenset(
            r for r in _ranks(names, ".writing")
            if persist.writing_alive(os.path.join(item.tmp, checkpoint_record.writing_file(r))))
        failed[item.name] = _ranks(names, ".failed")
    done = {}
    names = _names(folder)
    for rank in save_in_flight.processes_done(names):
        try:
            with open(os.path.join(folder, save_in_flight.process_file(rank))) as f:
                marker = save_in_flight.ProcessDone.from_json(f.read())
        except (OSError, ValueError):
            continue  # half written by a trainer that died: not done
        if marker.rank == rank:
            done[rank] = marker.items
    return finish_rule.Seen(
        tmp_exists=os.path.isdir(record.tmp), final_exists=os.path.isdir(record.final),
        finalizing=save_in_flight.FINALIZING in names, sidecars=sidecars, writing=writing,
        failed=failed, done=done)


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _ranks(names, suffix: str) -> frozenset[int]:
    ranks = set()
    for name in names:
        if name.startswith("rank_") and name.endswith(suffix):
            number = name[len("rank_"):-len(suffix)]
            if number.isdigit():
                ranks.add(int(number))
    return frozenset(ranks)


def _same_lock(watch: _Watch) -> bool:
    """Whether the save's lock file is still the one this daemon holds."""
    try:
        return os.stat(os.path.join(watch.folder, save_in_flight.LOCK),
                       follow_symlinks=False).st_ino == watch.lock_inode
    except FileNotFoundError:
        return False


def _release(watch: _Watch) -> None:
    if watch.lock_fd is not None:
        os.close(watch.lock_fd)
        watch.lock_fd = None
