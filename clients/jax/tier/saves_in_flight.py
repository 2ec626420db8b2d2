"""This process's side of a manager's saves in flight (bubblesnap/shared/save_in_flight.py):
what a trainer leaves so that the daemons finish a step it dies before finalizing.

Around Orbax's composite handler (memory_tier.py installs it), for a step whose items
the daemons write:

- before the items are saved, the primary process takes the step's lock (held while
  it lives) and writes the record: the step's folders, each item's finalize, the
  update of ``_CHECKPOINT_METADATA`` Orbax makes at commit. Its daemon is told with
  the primary's Persist, which is asked before ``save`` returns, so a kill right
  after ``save`` leaves the daemon watching a step it holds;
- once its items' writes by their own handlers are durable (a JSON item, an item the
  daemon did not take), a process says so (``process_<r>.json``); parts a daemon
  writes are answered by that daemon (the item's sidecars);
- when Orbax finalizes the step here, ``finalizing`` is said first and the daemons'
  answers are removed from the items (the step holds what Orbax writes); the folder
  of the save in flight goes once the step is renamed (:meth:`SavesInFlight.sweep`).

A resumed manager's primary process asks its daemon, before anything lists steps, to
finish each save its earlier run left (:meth:`SavesInFlight.finish_left`), and waits
for the answer: finalized (Orbax lists it; memory serves it) or dropped.
"""

import dataclasses
import fcntl
import logging
import os
import shutil
import threading
import time

import grpc
from orbax.checkpoint._src.handlers import (
    base_pytree_checkpoint_handler,
    checkpoint_handler,
    pytree_checkpoint_handler,
    standard_checkpoint_handler,
)
from orbax.checkpoint._src.metadata import step_metadata_serialization
from orbax.checkpoint._src.path import atomicity

from bubblesnap.clients.jax.tier import orbax_v1
from bubblesnap.clients.jax.tier.persist_future import PersistFuture
from bubblesnap.clients.jax.tier.tier_handler import TierHandler
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import checkpoint_record, save_in_flight

log = logging.getLogger("bubblesnap.client")

#: The finalize of Orbax's PyTree handlers: a merge of the processes' OCDBT databases.
_MERGED = (standard_checkpoint_handler.StandardCheckpointHandler.finalize,
           pytree_checkpoint_handler.PyTreeCheckpointHandler.finalize,
           base_pytree_checkpoint_handler.BasePyTreeCheckpointHandler.finalize)
#: How long a resumed manager waits for its daemon to finish a save left in flight.
_FINISH_SECONDS = 120.0


@dataclasses.dataclass
class _Held:
    folder: str
    tmp: str
    final: str
    lock_fd: int


class SavesInFlight:
    """The saves in flight of the manager whose tier is ``tier``."""

    def __init__(self, tier):
        self._tier = tier
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()  # _held: Orbax finalizes on a thread of its own
        self._items: dict[int, list[str]] = {}
        self._daemon_items: dict[int, set[str]] = {}
        self._warned = False

    def record_path(self, step: int) -> str:
        """The record of ``step`` this process wrote ("" when none: not the primary, or
        the step is not recorded)."""
        with self._lock:
            held = self._held.get(step)
        return os.path.join(held.folder, save_in_flight.RECORD) if held else ""

    def daemon_writes(self, step: int, item: str) -> None:
        """This process's part of ``item`` is written by its daemon."""
        self._daemon_items.setdefault(step, set()).add(item)

    # -- around Orbax's composite handler ---------------------------------------------

    def begin(self, step: int, composite, step_tmp, args) -> None:
        """Before the items of ``step`` are saved into ``step_tmp``: the primary's lock and
        record (none for a step some item of which a daemon could not finalize)."""
        self._daemon_items.pop(step, None)
        self._items[step] = list(args.keys())
        paths = composite._get_item_temporary_paths(step_tmp, args)  # (an epath.Path)
        step_tmp = os.fspath(step_tmp)
        if not self._tier.primary or atomicity.TMP_DIR_SUFFIX not in os.path.basename(step_tmp):
            return  # (a step written in place, with a commit file: nothing to rename)
        items, handlers = [], {}
        for name, path in paths.items():
            handler = composite._get_or_set_handler(name, args[name])
            handlers[name] = handler.typestr()
            finalize = _finalize_of(handler)
            if finalize is None:
                self._warn(name, handler)
                return
            items.append(save_in_flight.Item(name, os.fspath(path.get()),
                                             os.fspath(path.get_final()), *finalize))
        metadata = step_metadata_serialization.serialize_for_update(
            custom_metadata=self._tier.custom_metadata, item_handlers=handlers)
        record = save_in_flight.Record(
            directory=self._tier.root, step=step, world_size=self._tier.world_size,
            tmp=step_tmp, final=_final(step_tmp),
            items=tuple(items), metadata=metadata)
        self._hold(record)

    def saved(self, step: int, futures) -> None:
        """After the items of ``step`` were handed over: once the parts this process's own
        handlers write are durable, it says so (none to say if the daemons write all)."""
        ours = self._daemon_items.pop(step, set())
        others = [f for f in futures or () if not isinstance(f, PersistFuture)]
        names = sorted(set(self._items.pop(step, ())) - ours)
        if not names:
            return
        folder = save_in_flight.folder(self._tier.root, step)
        marker = save_in_flight.ProcessDone(self._tier.rank, tuple(names))
        threading.Thread(target=_mark_when_done, args=(others, folder, marker), daemon=True,
                         name=f"bubblesnap-handlers-{step}").start()

    def finalizing(self, step_tmp: str, item_tmps) -> None:
        """Orbax finalizes the step in ``step_tmp`` here: said first, then the daemons'
        answers leave its items."""
        with self._lock:
            folders = [held.folder for held in self._held.values() if held.tmp == step_tmp]
        for folder in folders:
            _write(os.path.join(folder, save_in_flight.FINALIZING), "")
        for tmp in item_tmps:
            shutil.rmtree(os.path.join(tmp, checkpoint_record.STATE_DIR), ignore_errors=True)

    def sweep(self, before: int | None = None) -> None:
        """Forgets the saves Orbax finished here (their folders, their locks): those before
        step ``before`` (None: every one), which Orbax waited for, whose temporary folder
        is gone (finalized; maybe deleted since, by its preservation policy). A failed
        save keeps its own, for the daemon to judge once this trainer is gone."""
        with self._lock:
            for step, held in list(self._held.items()):
                if (before is None or step < before) and not os.path.isdir(held.tmp):
                    self._let_go(step)

    def close(self) -> None:
        self.sweep()
        with self._lock:  # unfinalized: the daemon decides, as after a crash
            for step in list(self._held):
                os.close(self._held.pop(step).lock_fd)

    # -- a resumed manager -------------------------------------------------------------

    def finish_left(self) -> None:
        """Has this host's daemon finish (or drop) every save the manager's earlier run
        left in flight, before anything lists steps (primary process only)."""
        if not self._tier.primary:
            return
        for step in save_in_flight.steps(self._tier.root):
            record = os.path.join(save_in_flight.folder(self._tier.root, step),
                                  save_in_flight.RECORD)
            if os.path.exists(record):
                self._finish(step, record)

    def _finish(self, step: int, record: str) -> None:
        session = self._tier.client(self._tier.probe_job).session
        deadline = time.monotonic() + _FINISH_SECONDS
        drop = False
        while True:
            try:
                answer = session.call("FinishSave", pb.FinishSaveRequest(record=record,
                                                                         drop=drop))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return  # finalized or dropped meanwhile
                log.warning("bubblesnap: step %d of %s, left in flight by an earlier run, was "
                            "not finished by the daemon: %s: %s", step, self._tier.root,
                            err.code().name, err.details())
                return
            if answer.state == pb.FinishSaveResponse.TRAINER_ALIVE:
                return  # not left: a live trainer saves it (another manager of the folder)
            if answer.state != pb.FinishSaveResponse.WATCHING:
                log.warning("bubblesnap: step %d of %s, left in flight by an earlier run: %s "
                            "(%s)", step, self._tier.root,
                            pb.FinishSaveResponse.State.Name(answer.state).lower(),
                            answer.detail)
                return
            drop = time.monotonic() > deadline  # never listed later, under a new run
            time.sleep(0.05)

    # -- the lock and the record --------------------------------------------------------

    def _hold(self, record: save_in_flight.Record) -> None:
        folder = save_in_flight.folder(record.directory, record.step)
        with self._lock:
            if record.step in self._held:
                self._let_go(record.step)
            for name in (save_in_flight.RECORD, save_in_flight.LOCK, save_in_flight.FINALIZING):
                _remove(os.path.join(folder, name))  # of a save of the step given up
            os.makedirs(folder, exist_ok=True)  # (another process's marker may be in it)
            fd = os.open(os.path.join(folder, save_in_flight.LOCK),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.lockf(fd, fcntl.LOCK_EX)  # never contended: the folder is new
            self._held[record.step] = _Held(folder, record.tmp, record.final, fd)
        _write(os.path.join(folder, save_in_flight.RECORD), record.to_json())

    def _let_go(self, step: int) -> None:
        """(under the lock)"""
        held = self._held.pop(step)
        save_in_flight.remove(self._tier.root, step)  # the lock goes last: with the fd
        os.close(held.lock_fd)

    def _warn(self, item: str, handler) -> None:
        if not self._warned:
            self._warned = True
            log.warning("bubblesnap: item %r of %s has a handler with a finalize of its own "
                        "(%s): a step of it that its trainer leaves in flight is not "
                        "finished by the daemons (as in Orbax, it is lost)", item,
                        self._tier.root, type(handler).__name__)


def _finalize_of(handler) -> tuple[str, bool, bool] | None:
    """(kind, use_zarr3, validate) of an item handler's finalize; None when it is a
    finalize of its own, which a daemon cannot run."""
    if isinstance(handler, TierHandler):
        handler = handler._inner
    v1 = orbax_v1.pytree_handler_of(handler)
    if v1 is not None:  # v1 merges in the item's own commit; the finalize left is a rename
        base = v1._handler_impl
        handler = base._inner if isinstance(base, TierHandler) else base
    elif type(handler).finalize not in _MERGED:
        if type(handler).finalize in (checkpoint_handler.CheckpointHandler.finalize,
                                      orbax_v1.compatibility_finalize()):
            return "none", False, False
        return None
    base = handler
    for name in ("_impl", "_handler_impl"):
        base = getattr(base, name, base)
    return "ocdbt", bool(getattr(base, "_use_zarr3", False)), \
        bool(getattr(base, "_enable_post_merge_validation", False))


def _final(step_tmp: str) -> str:
    """The step's folder once Orbax renamed its temporary one (Orbax's own rule)."""
    name = os.path.basename(step_tmp)
    return os.path.join(os.path.dirname(step_tmp),
                        name[:name.find(atomicity.TMP_DIR_SUFFIX)])


def _mark_when_done(futures, folder: str, marker) -> None:
    try:
        for future in futures:
            future.result()
    except BaseException:
        return
    _write(os.path.join(folder, save_in_flight.process_file(marker.rank)), marker.to_json())


def _write(path: str, text: str) -> None:
    """``path`` whole or not at all (a daemon reads it while this process may die)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    for _ in range(3):  # the primary may remove empty folders above it meanwhile
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            return
        except FileNotFoundError:
            continue


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
