"""bubblesnap's part of one CheckpointManager: the daemons' memory in front of Orbax's
handlers of the manager's pytree items.

Each pytree item of the manager is a job of the daemon named by the item's folder:
``<the manager's directory, resolved>/<item>`` (two managers whose folders share their
last name are two jobs; a directory in a bucket, ``gs://bucket/run``, names its jobs by
its URL, and Orbax writes its steps there). A save of an item (tier_handler.py) copies
it into the daemon's memory and, when the manager's directory lies inside the daemon's
durable tier, has the daemon write it into the item's folder of the step Orbax is saving
(persist_future.py): the steps Orbax's policy keeps reach disk exactly as Orbax would
write them, the writing done by the daemon. Outside the durable tier (or with no daemon)
Orbax writes the item itself, as plain Orbax; the memory copy still serves restores. A
restore reads the item from memory when the daemons hold the step and the arguments are
ones memory gives exactly (item_restore.py), else Orbax reads the folder.

:meth:`install` puts the tier in front of Orbax's composite handler: its handler
lookup (``_get_or_set_handler``, one private hook, present in every Orbax this project
supports) hands out a :class:`~bubblesnap.clients.jax.tier.tier_handler.TierHandler`
around each stock handler; the registry keeps Orbax's own handlers, so everything
that reads it (metadata, restore without arguments) sees Orbax's.
"""

import dataclasses
import logging
import os
import posixpath

import grpc
import jax
import orbax.checkpoint as ocp

from bubblesnap.clients.jax.client import SnapshotClient
from bubblesnap.clients.jax.tier import item_restore, orbax_v1, own_write
from bubblesnap.clients.jax.tier.item_records import ItemRecords
from bubblesnap.clients.jax.tier.item_snapshot import ItemSnapshots
from bubblesnap.clients.jax.tier.persist_future import PersistFuture
from bubblesnap.clients.jax.tier.saves_in_flight import SavesInFlight
from bubblesnap.clients.jax.tier.tier_handler import TierHandler
from bubblesnap.clients.results import RestoreError
from bubblesnap.protos import daemon_pb2 as pb

log = logging.getLogger("bubblesnap.client")

#: The handlers whose items the daemons hold (exactly these classes: a subclass is a
#: handler of its own, which writes its items itself).
STOCK_HANDLERS = (ocp.StandardCheckpointHandler, ocp.PyTreeCheckpointHandler)
#: How the daemon refuses the snapshot of a step it holds committed already.
_ALREADY_COMMITTED = "is already committed"


@dataclasses.dataclass(frozen=True)
class Found:
    """An item restored from memory (``value``: its tree)."""

    value: object


class MemoryTier:
    """The tier of the manager of ``directory``. ``settings``: bubblesnap's options
    (manager_options.py); ``primary_host``: Orbax's (None: every process saves a
    checkpoint of its own, each its own one-process job)."""

    def __init__(self, directory, settings, primary_host: int | None):
        text = os.fspath(directory)
        self.local = "://" not in text  # an object store's URL: Orbax writes every step
        self.root = _root(text)
        self.settings = settings
        if primary_host is None:
            self.rank, self._world, self.primary = 0, 1, True
        else:
            self.rank, self._world = jax.process_index(), jax.process_count()
            self.primary = self.rank == primary_host
        #: The step the manager is saving or restoring (its handlers are not told), and the
        #: custom metadata of the save.
        self.step: int | None = None
        self.custom_metadata: dict | None = None
        #: what finishing a save this trainer dies in the middle of takes
        self.saves = SavesInFlight(self)
        self._clients: dict[str, SnapshotClient] = {}
        self._snapshots: dict[str, ItemSnapshots] = {}
        self._records = ItemRecords(self.client, settings.record_bytes)
        self._handlers: dict[tuple[str, int], TierHandler] = {}
        self._write_times = own_write.WriteTimes(settings.client.persist_wait_floor_seconds,
                                                 settings.client.persist_wait_factor)
        self._durable: str | None = None  # the daemon's durable tier; None: not known yet
        #: a session's job for calls about no item (no item starts with ".": never a job)
        self.probe_job = self.job(".daemon")
        self._warned: set[str] = set()

    # -- in front of Orbax's composite handler ---------------------------------------------

    def install(self, composite) -> None:
        """Hands out a TierHandler for each stock handler ``composite`` looks up (once per
        composite: Orbax v1 brings a composite of its own to every save)."""
        if getattr(composite, "_bubblesnap_tier", None) is self:
            return
        composite._bubblesnap_tier = self
        lookup, save, finalize = (composite._get_or_set_handler, composite.async_save,
                                  composite.finalize)

        def get_or_set_handler(item_name, args):
            return self.wrap(item_name, lookup(item_name, args))

        async def async_save(directory, args):
            step = self.step
            if step is None or not self.local or not self.persists(os.fspath(directory)):
                return await save(directory, args)
            self.saves.begin(step, composite, directory, args)
            futures = await save(directory, args)
            self.saves.saved(step, futures)
            return futures

        def finalize_step(directory):
            paths = getattr(composite, "_current_temporary_paths", {}) or {}
            self.saves.finalizing(os.fspath(directory), [os.fspath(p.get())
                                                         for p in paths.values()])
            return finalize(directory)
        composite._get_or_set_handler = get_or_set_handler
        composite.async_save = async_save
        composite.finalize = finalize_step

    def wrap(self, item: str, handler):
        v1 = orbax_v1.pytree_handler_of(handler)
        if v1 is not None:  # Orbax v1's: its v0 core goes through the tier, v1 finalizes
            if type(v1._handler_impl) is not TierHandler:
                v1._handler_impl = TierHandler(self, item, v1._handler_impl)
            return handler
        if type(handler) not in STOCK_HANDLERS:
            return handler
        key = (item, id(handler))
        if key not in self._handlers:
            self._handlers[key] = TierHandler(self, item, handler)
        return self._handlers[key]

    @property
    def world_size(self) -> int:
        """The processes of the manager's jobs (1 where each saves its own checkpoint)."""
        return self._world

    def job(self, item: str, root: str | None = None) -> str:
        """The daemon's job of ``item`` of the manager of ``root`` (default: this one)."""
        return f"{root or self.root}/{item}"

    def client(self, job: str) -> SnapshotClient:
        if job not in self._clients:
            self._clients[job] = SnapshotClient(job, self.rank, self._world,
                                                options=self.settings.client)
        return self._clients[job]

    # -- the daemon ---------------------------------------------------------------------

    def check_daemon(self) -> None:
        """Says, once, where the steps will be written: by the daemon into the manager's
        directory, or by Orbax (no daemon answering, none with a durable tier holding the
        directory)."""
        if not self.local:
            self._warn("url", "bubblesnap: %s is a bucket: Orbax writes its steps there; the "
                       "daemons' memory holds them for fast restores (the daemons write a "
                       "manager's steps only into a local --durable-dir)", self.root)
            return
        durable = self._durable_tier()
        address = self.settings.client.daemon
        if durable is None:
            self._warn("away", "bubblesnap: no daemon answers at %s: Orbax writes the steps "
                       "of %s itself until one does", address, self.root)
        elif not durable:
            self._warn("tier", "bubblesnap: the daemon at %s has no durable tier "
                       "(--durable-dir): Orbax writes the steps of %s itself; the daemon's "
                       "memory holds them for fast restores", address, self.root)
        elif not _inside(self.root, durable):
            self._warn("tier", "bubblesnap: %s is outside the durable tier %s of the daemon "
                       "at %s (--durable-dir): Orbax writes its steps itself; the daemon's "
                       "memory holds them for fast restores. Start the daemon with "
                       "--durable-dir at or above %s to have it write them", self.root,
                       durable, address, self.root)

    def _durable_tier(self) -> str | None:
        """The daemon's durable directory ("" when it has none; None when no daemon
        answers), asked once it answers."""
        if self._durable is None:
            client = self.client(self.probe_job)
            if not client.session.quiet():
                try:
                    answer = client.session.call("Status", pb.StatusRequest())
                    tier = answer.durable_directory
                    # an object store's URL is no folder to resolve (and holds none of
                    # this manager's local steps)
                    self._durable = tier if "://" in tier or not tier else \
                        os.path.realpath(tier)
                except grpc.RpcError:
                    return None  # not known: asked again at the next save
        return self._durable

    def persists(self, folder: str) -> bool:
        """Whether the daemon writes ``folder`` (inside its durable tier)."""
        durable = self._durable_tier()
        return bool(durable) and _inside(folder, durable)

    # -- save and restore of an item -------------------------------------------------------

    def save_item(self, item: str, handler, directory, args):
        """Copies the item into the daemon's memory; the commit futures of the daemon's
        write into ``directory`` (the item's folder), or None when Orbax's ``handler``
        writes it (the daemon does not, or could not take the item)."""
        step = self.step
        if step is None:
            return None
        folder = os.fspath(getattr(directory, "path", directory))
        # the daemon writes Orbax's OCDBT layout only: a handler told otherwise writes
        persists = self.persists(folder) and getattr(handler, "_use_ocdbt", True)
        client = self._snapshot(item, handler, step, args, wait="rank" if persists else False)
        if client is None or not persists:
            return None
        session = client.session
        try:  # asked before save returns: a kill after it leaves the write to the daemon
            with session.bounded(self.settings.client.persist_wait_floor_seconds):
                session.call("Persist", pb.PersistRequest(
                    job=session.job, rank=session.rank, step=step, directory=folder,
                    record=self.saves.record_path(step)))
        except grpc.RpcError as err:
            self._warn(f"persist-{item}", "bubblesnap: the daemon at %s did not take the "
                       "write of item %r of step %d (%s: %s): Orbax writes it", session.options
                       .daemon, item, step, err.code().name, err.details())
            return None
        self.saves.daemon_writes(step, item)
        return [PersistFuture(
            session, step, folder, on_answer=lambda took: self._write_times.wrote(item, took),
            wait_seconds=self.persist_wait(item),
            fallback=None if self._world > 1 else
            lambda why: self._write_here(item, handler, folder, args, step, why))]

    def persist_wait(self, item: str) -> float:
        """How long a save of ``item`` waits for its daemon's write before Orbax writes it
        here (own_write.WriteTimes)."""
        snapshots = self._snapshots.get(item)
        return self._write_times.wait(item, snapshots.nbytes if snapshots else 0)

    def _write_here(self, item: str, handler, folder: str, args, step: int, why: str):
        """The part written by Orbax here: its daemon ``why`` (own_write.py); said once."""
        written = own_write.write_part(handler, folder, args, self.rank, why)
        if written:
            self._warn("own-write", "bubblesnap: the daemon at %s %s: Orbax wrote item %r of "
                       "step %d of %s itself (so again whenever a daemon does not answer in "
                       "time; said once)", self.settings.client.daemon, why, item, step,
                       self.root)
        return written

    def snapshot_in_memory(self, item: str, handler, step: int, args) -> bool:
        """Copies the item into the daemon's memory only (a step held in memory only);
        whether it was taken."""
        return self._snapshot(item, handler, step, args, wait=False) is not None

    def _snapshot(self, item: str, handler, step: int, args, wait):
        """The item's snapshot handed to its job's daemon: the job's client, or None when
        the daemon did not take it (the session said why, once)."""
        tree = args.item
        validate = getattr(handler, "_validate_save_state", None)
        if validate is not None:  # Orbax's Standard handler refuses what it would refuse
            tree = validate(tree, save_args=getattr(args, "save_args", None))
        if any(getattr(leaf, "size", 1) == 0 for leaf in jax.tree.leaves(tree)):
            return None  # Orbax refuses arrays of no elements, with its own error
        snapshots = self._snapshots.setdefault(item, ItemSnapshots(
            item, self.settings.record_bytes, self._world, self.primary))
        try:
            names, leaves, record = snapshots.build(
                step, tree, handler.typestr(), getattr(args, "save_args", None),
                getattr(args, "custom_metadata", None))
        except (TypeError, ValueError) as err:
            self._warn(f"build-{item}", "bubblesnap: item %r of %s is saved by Orbax alone, "
                       "not held in memory: %s", item, self.root, err)
            return None
        job = self.job(item)
        client = self.client(job)
        if wait and not self._well(client.session):
            return None  # a save that waits must not wait for a sick daemon: Orbax writes
        with client.session.bounded(self.settings.client.persist_wait_floor_seconds
                                    if wait else float("inf")):
            result = client.snapshot_leaves(step, names, leaves, wait=wait)
            if not result.taken and _ALREADY_COMMITTED in result.reason:
                # the daemons hold another save of this step (a deleted step saved again):
                # it goes, with what came after it, and this save replaces it
                self.drop_after([job], step - 1)
                result = client.snapshot_leaves(step, names, leaves, wait=wait)
        if not result.taken:
            return None
        self._records.remember(job, step, record)
        return client

    @staticmethod
    def _well(session) -> bool:
        """Whether a daemon may be waited for: not stopped (the kernel says), and, when its
        heartbeat went silent, answering (a dead daemon's heartbeat, replaced since)."""
        beat = session.daemon_beat()
        if beat is not None and beat.stopped:
            return False
        return not session.sick_for() or session.answers()

    def restore_item(self, item: str, directory, args) -> Found | None:
        """The item restored from the daemons' memory, or None (Orbax reads the folder)."""
        step = self.step
        if step is None:
            return None
        folder = _root(os.fspath(getattr(directory, "path", directory)))
        job = self.job(item, posixpath.dirname(posixpath.dirname(folder)))
        record = self.record(job, step)
        if record is None:
            return None
        item_plan = item_restore.plan(item, record, args)
        if item_plan is None:
            return None
        try:
            return Found(item_restore.restore(self.client(job), item_plan, step))
        except RestoreError as err:
            log.info("step %d of %s: not from memory (%s); Orbax reads %s", step, job, err,
                     folder)
            return None

    def forget(self, steps) -> None:
        """Drops ``steps`` of every item from this daemon's memory (a deleted step saved
        again must not meet its old copy), without waiting."""
        for job, client in self._clients.items():
            if job != self.probe_job:
                client.session.call_async("DeleteSnapshots", pb.DeleteSnapshotsRequest(
                    job=job, steps=list(steps)))

    def drop_after(self, jobs, step: int) -> None:
        """The daemons drop every copy of ``jobs`` after ``step``, here and at their
        peers: an earlier run's, which this one is about to save anew (all processes of
        the job do it before any of them saves again: Orbax's barrier at the start of a
        save, or one of ours for a step held in memory only)."""
        for job in jobs:
            session = self.client(job).session
            if not _reachable(session):
                continue
            try:
                session.call("DropAfter", pb.DropAfterRequest(job=job, step=step))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    log.info("bubblesnap: the daemon did not drop the later copies of %s: "
                             "%s: %s", job, err.code().name, err.details())

    def committed(self, job: str) -> set[int]:
        """The steps of ``job`` the daemons hold committed (none when it does not answer)."""
        session = self.client(job).session
        if not _reachable(session):
            return set()
        try:
            return {s.step for s in session.status().steps if s.committed}
        except grpc.RpcError:
            return set()

    def wait(self) -> None:
        """Waits until every copy sent to the daemons was answered (kept or refused)."""
        for client in list(self._clients.values()):
            client.wait()

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def record(self, job: str, step: int) -> dict | None:
        """The item record of ``step`` of ``job`` (item_records.py); None when not held."""
        return self._records.record(job, step)

    def _warn(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def _reachable(session) -> bool:
    """Whether to call the daemon now: also while the session backs off from a failed
    snapshot (a listing or a drop after a daemon's hiccup or restart must not pass over
    what it holds), once it answers a probe that waits for the channel to dial again (a
    plain call fails at once until then: UNAVAILABLE)."""
    return not session.quiet() or session.answers()


def _root(text: str) -> str:
    """A manager's folder as its jobs are named: a local one resolved (symbolic links,
    ``..``), a bucket's URL normalized (``gs://b/run/`` and ``gs://b//run`` are
    ``gs://b/run``)."""
    if "://" not in text:
        return os.path.realpath(text)
    scheme, rest = text.split("://", 1)
    return f"{scheme}://" + posixpath.normpath(rest).lstrip("/")


def _inside(path: str, root: str) -> bool:
    """Whether the local folder ``path`` lies inside the folder ``root`` (never a bucket's:
    the daemons write a manager's steps only into a local folder)."""
    if "://" in root or "://" in path:
        return False
    path = os.path.realpath(path)
    return os.path.commonpath([root, path]) == root
