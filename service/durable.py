"""The durable tier: some committed steps written as standard Orbax checkpoints.

Each daemon writes the ranks its trainers registered, in the background:
``<directory>/<job>/step_<step>/rank_<rank>/`` is an Orbax checkpoint of the
rank's state as a nested dict of numpy arrays (tensor names split at "/"),
so ``orbax.checkpoint.StandardCheckpointer().restore(path)`` loads it with
no daemon, into any sharding. Beside it, ``rank_<rank>.json`` lists each
tensor's dtype, shape and xxh3 checksum; it is written last, so a rank
directory without it is an unfinished write and is ignored. The members of a
data-parallel replica group are written once, as their copier (the lowest
rank); its ``.json`` names the group.

Orbax and JAX are imported on first use: a daemon without ``--durable-dir``
does not need them.
"""

import dataclasses
import json
import logging
import math
import os
import queue
import re
import shutil
import threading
import time

import numpy as np

from bubblesnap.protos.checksum import checksum
from bubblesnap.service import group_view
from bubblesnap.service import layout as layout_lib
from bubblesnap.service.errors import DaemonError, DataLoss, FailedPrecondition, NotFound

log = logging.getLogger("bubblesnap.daemon")

_FORMAT = "bubblesnap-durable-1"
_STEP_DIR = re.compile(r"step_(\d+)")
_RANK_META = re.compile(r"rank_(\d+)\.json")


@dataclasses.dataclass(frozen=True)
class DurableOptions:
    """When and where snapshots are written to durable storage.

    Attributes:
      directory: where checkpoints go (a shared filesystem or a bucket mount
        all hosts see). Empty: no durable tier.
      every_steps: write steps that are multiples of this. Every daemon picks
        the same steps, so each one is whole for the job. 0: off.
      every_seconds: also write the next committed step once this long has
        passed since the last write. 0: off. Hosts decide independently, so a
        step chosen this way may be whole only once every host wrote it.
      keep: whole steps (written by every rank) kept; a rank's older steps are
        deleted. Default 2.
    """

    directory: str = ""
    every_steps: int = 0
    every_seconds: float = 0.0
    keep: int = 2

    def __post_init__(self):
        if self.every_steps < 0 or self.every_seconds < 0:
            raise ValueError("--durable-every-steps and --durable-every-seconds must be >= 0")
        if self.keep < 1:
            raise ValueError("--durable-keep must be at least 1")
        if self.directory and not (self.every_steps or self.every_seconds):
            raise ValueError("--durable-dir needs --durable-every-steps or "
                             "--durable-every-seconds to say how often to write")

    @property
    def enabled(self) -> bool:
        return bool(self.directory)


def should_write(step: int, seconds_since_last: float, options: DurableOptions) -> bool:
    """Whether a newly committed step goes to the durable tier."""
    if options.every_steps and step % options.every_steps == 0:
        return True
    return bool(options.every_seconds) and seconds_since_last >= options.every_seconds


def rank_path(directory: str, job: str, step: int, rank: int) -> str:
    return os.path.join(directory, job, f"step_{step}", f"rank_{rank}")


class DurableTier:
    """Writes chosen steps in a background thread; finds and loads them on restore."""

    def __init__(self, options: DurableOptions, store):
        self.options = options
        self._store = store
        self._queue: queue.Queue = queue.Queue()  # wake-ups; the work is in _waiting
        # (job, rank) -> step -> its copy, pinned so retention cannot free it first
        self._waiting: dict[tuple[str, int], dict[int, object]] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._last_write: dict[tuple[str, int], float] = {}
        self._thread = threading.Thread(target=self._run, name="durable", daemon=True)
        os.makedirs(options.directory, exist_ok=True)
        _orbax()  # JAX and Orbax take seconds to import: at startup, not in the first write
        logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every file at INFO

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finishes the write in progress, drops the ones still waiting."""
        self._stopping.set()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for copies in waiting.values():
            for pinned in copies.values():
                self._store.unpin(pinned)
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            log.warning("durable: a write is still running at shutdown; its directory stays "
                        "unfinished (no .json) and is ignored")

    def committed(self, job: str, rank: int, step: int) -> None:
        """A trainer committed (job, rank, step) here; write it if the policy says so."""
        since = time.monotonic() - self._last_write.get((job, rank), float("-inf"))
        if not should_write(step, since, self.options):
            return
        try:
            pinned = self._store.pin(job, rank, step)
        except DaemonError:
            return  # already freed: a newer step replaced it
        self._last_write[(job, rank)] = time.monotonic()
        with self._lock:
            self._waiting.setdefault((job, rank), {})[step] = pinned
        self._queue.put(job)

    def steps(self, job: str, world_size: int) -> list[int]:
        """Steps whose every rank is fully written, oldest first."""
        job_dir = os.path.join(self.options.directory, job)
        return sorted(step for step in _step_numbers(job_dir)
                      if self._whole(os.path.join(job_dir, f"step_{step}"), world_size))

    def _whole(self, step_dir: str, world_size: int) -> bool:
        """Every rank is written, itself or as its replica group's copier."""
        written = {int(m[1]) for m in map(_RANK_META.fullmatch, _listdir(step_dir)) if m}
        missing = set(range(world_size)) - written
        if not missing:
            return True
        for rank in written:  # only a grouped job (or an unfinished step) reads metadata
            try:
                meta = self._meta(os.path.join(step_dir, f"rank_{rank}"))
            except DaemonError:
                continue
            missing -= set(meta.get("replica_group", ()))
        return not missing

    def forget_after(self, job: str, step: int) -> None:
        """Drops queued writes of ``job``'s steps after ``step`` (an abandoned run's)."""
        with self._lock:
            for key in [k for k in self._waiting if k[0] == job]:
                for later in [s for s in self._waiting[key] if s > step]:
                    self._store.unpin(self._waiting[key].pop(later))

    def discard_after(self, job: str, step: int) -> int:
        """Deletes written steps of ``job`` newer than ``step`` (an abandoned run's)."""
        dropped = 0
        for later in _step_numbers(os.path.join(self.options.directory, job)):
            if later > step:
                shutil.rmtree(os.path.join(self.options.directory, job, f"step_{later}"),
                              ignore_errors=True)
                dropped += 1
        return dropped

    def world_size(self, job: str) -> int:
        """The world size the newest written rank of ``job`` recorded; 0: none written."""
        for step in sorted(_step_numbers(os.path.join(self.options.directory, job)),
                           reverse=True):
            step_dir = os.path.join(self.options.directory, job, f"step_{step}")
            for name in _listdir(step_dir):
                if name.endswith(".json"):
                    return int(self._meta(os.path.join(step_dir, name[:-5]))["world_size"])
        return 0

    def replica_group(self, job: str, rank: int, step: int) -> tuple[int, ...]:
        """The replica group a written rank declared (the ranks its copy holds)."""
        meta = self._meta(rank_path(self.options.directory, job, step, rank))
        return tuple(meta.get("replica_group", ())) or (rank,)

    def whole_layout(self, job: str, rank: int, step: int):
        """A layout with each tensor whole (one shard), as written."""
        meta = self._meta(rank_path(self.options.directory, job, step, rank))
        return layout_lib.Layout(tuple(
            layout_lib.Tensor(t["name"], t["dtype"], tuple(t["shape"]), (layout_lib.Shard(
                tuple((0, d) for d in t["shape"]),
                math.prod(t["shape"]) * layout_lib.ITEMSIZE[t["dtype"]]),))
            for t in meta["tensors"]))

    def _meta(self, path: str) -> dict:
        try:
            with open(path + ".json") as f:
                return json.load(f)
        except FileNotFoundError as err:
            raise NotFound(f"the durable tier has no {path}") from err
        except (OSError, ValueError) as err:
            raise DataLoss(f"{path}.json is unreadable: {err}") from err

    def _written_slots(self, path: str) -> list[int] | None:
        """Slot checksums of the copy written at ``path``; None if none is readable."""
        try:
            return self._meta(path).get("slot_checksums")
        except DaemonError:
            return None

    def load(self, job: str, rank: int, step: int, layout):
        """Reads a written rank and cuts it into ``layout``'s shards.

        Returns ``(fill, checksums)`` for :meth:`SnapshotStore.install`.
        Every tensor is verified against the checksum written beside it;
        DataLoss when one does not match or the checkpoint cannot be read.
        """
        path = rank_path(self.options.directory, job, step, rank)
        meta = self._meta(path)
        expected = {t["name"]: t for t in meta["tensors"]}
        registered = {t.name: (t.dtype, list(t.global_shape)) for t in layout.tensors}
        written = {name: (t["dtype"], list(t["shape"])) for name, t in expected.items()}
        if written != registered:
            differ = sorted(n for n in set(written) | set(registered)
                            if written.get(n) != registered.get(n))
            raise FailedPrecondition(
                f"{path} does not hold the registered state: tensors {differ[:4]} differ in "
                "name, dtype or shape")
        try:
            tree = _orbax().StandardCheckpointer().restore(os.path.abspath(path))
        except Exception as err:  # Orbax raises many types for damaged files
            raise DataLoss(f"{path} cannot be read by Orbax: {err}") from err
        arrays = {}
        for name, meta_t in expected.items():
            array = np.ascontiguousarray(_lookup(tree, name))
            if checksum(array) != meta_t["checksum"]:
                raise DataLoss(f"{path}: tensor {name!r} does not match its checksum")
            arrays[name] = array
        pieces, checksums = [], []
        for t_index, s_index, offset, nbytes in layout.slots():
            tensor = layout.tensors[t_index]
            index = tensor.shards[s_index].index
            piece = np.ascontiguousarray(arrays[tensor.name][tuple(slice(a, b) for a, b in index)])
            pieces.append((offset, nbytes, piece))
            checksums.append(checksum(piece))

        def fill(view, slots):
            for offset, nbytes, piece in pieces:
                view[offset:offset + nbytes] = piece.reshape(-1).view(np.uint8)
            return tuple(checksums)  # of the arrays just verified and copied

        return fill, tuple(checksums)

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        while self._queue.get() is not None:
            # Writes that fell behind collapse into the roundest waiting step of
            # each rank (group_view.roundest): every host then writes common steps.
            with self._lock:
                waiting, self._waiting = self._waiting, {}
            for (job, rank), copies in sorted(waiting.items()):
                chosen = group_view.roundest(copies)
                for step, pinned in copies.items():
                    if step != chosen or self._stopping.is_set():
                        self._store.unpin(pinned)
                if self._stopping.is_set():
                    continue
                try:
                    self._write(copies[chosen])
                except Exception:
                    log.exception("durable write of step %d of rank %d of %s failed", chosen,
                                  rank, job)

    def _write(self, pinned) -> None:
        job, rank, step = pinned.job, pinned.rank, pinned.step
        path = rank_path(self.options.directory, job, step, rank)
        try:
            if self._written_slots(path) == list(pinned.checksums):
                return  # this very copy is on disk already
            arrays = _assemble(pinned)
        finally:
            self._store.unpin(pinned)
        if os.path.exists(path + ".json"):  # another run's step of the same number
            os.unlink(path + ".json")
        if os.path.exists(path):  # that, or an unfinished write of a killed daemon
            shutil.rmtree(path)
        started = time.perf_counter()
        checkpointer = _orbax().StandardCheckpointer()
        checkpointer.save(os.path.abspath(path), _nest(arrays))
        checkpointer.wait_until_finished()
        checkpointer.close()
        meta = {"format": _FORMAT, "job": job, "rank": rank, "step": step,
                "world_size": pinned.world_size, "slot_checksums": list(pinned.checksums),
                "replica_group": list(pinned.group),
                "tensors": [{"name": name, "dtype": str(a.dtype), "shape": list(a.shape),
                             "checksum": checksum(a)} for name, a in arrays.items()]}
        tmp = path + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path + ".json")
        nbytes = sum(a.nbytes for a in arrays.values())
        log.info("durable: wrote step %d of rank %d of %s (%.1f MB in %.2f s) to %s", step, rank,
                 job, nbytes / 1e6, time.perf_counter() - started, path)
        self._retire(job, rank, pinned.world_size)

    def _retire(self, job: str, rank: int, world_size: int) -> None:
        """Deletes this rank's steps older than the ``keep`` newest steps every rank wrote.

        Counting only this rank's steps would be wrong: hosts that fall behind
        write different steps, and the step all ranks share could go.
        """
        whole = self.steps(job, world_size)
        if not whole:
            return
        floor = whole[-self.options.keep:][0]
        written = sorted(
            step for step in _step_numbers(os.path.join(self.options.directory, job))
            if os.path.exists(rank_path(self.options.directory, job, step, rank) + ".json"))
        for step in [s for s in written if s < floor]:
            path = rank_path(self.options.directory, job, step, rank)
            os.unlink(path + ".json")
            shutil.rmtree(path, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(path))  # the last rank out removes the step
            except OSError:
                pass


def _assemble(pinned) -> dict[str, np.ndarray]:
    """The rank's tensors as whole numpy arrays, from the shards in its segment.

    Each shard is verified first: the commit trusted the client's checksums,
    and a copy damaged in memory must not become a checkpoint with a fresh,
    matching checksum.
    """
    dtypes = {}
    arrays = {}
    for i, (t_index, s_index, offset, nbytes) in enumerate(pinned.slots):
        if checksum(pinned.segment.view[offset:offset + nbytes]) != pinned.checksums[i]:
            raise DataLoss(f"step {pinned.step} of rank {pinned.rank}: a shard of "
                           f"{pinned.layout.tensors[t_index].name!r} no longer matches its "
                           "checksum in memory; not written")
        tensor = pinned.layout.tensors[t_index]
        if tensor.name not in arrays:
            dtypes[tensor.name] = _numpy_dtype(tensor.dtype)
            arrays[tensor.name] = np.zeros(tensor.global_shape, dtypes[tensor.name])
        index = tensor.shards[s_index].index
        shape = tuple(b - a for a, b in index)
        piece = pinned.segment.view[offset:offset + nbytes].view(dtypes[tensor.name])
        arrays[tensor.name][tuple(slice(a, b) for a, b in index)] = piece.reshape(shape)
    return arrays


def _numpy_dtype(name: str) -> np.dtype:
    import ml_dtypes  # bfloat16 and float8, which numpy lacks (a dependency of JAX)

    return np.dtype(getattr(ml_dtypes, name, name))


def _nest(arrays: dict[str, np.ndarray]) -> dict:
    """Tensor names split at "/" as nested dicts (what a Flax/optax state looks like)."""
    tree: dict = {}
    for name, array in arrays.items():
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise FailedPrecondition(f"tensor {name!r} nests under another tensor's name; "
                                         "the durable tier cannot write this state")
        if leaf in node or not leaf:
            raise FailedPrecondition(f"tensor name {name!r} cannot be a path of a nested "
                                     "checkpoint (empty part or used twice)")
        node[leaf] = array
    return tree


def _lookup(tree, name: str):
    node = tree
    for part in name.split("/"):
        node = node[part]
    return node


def _step_numbers(job_dir: str) -> list[int]:
    return [int(m[1]) for m in map(_STEP_DIR.fullmatch, _listdir(job_dir)) if m]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise SystemExit("the durable tier writes through Orbax: pip install "
                         "'bubblesnap[jax]' (orbax-checkpoint) on this host") from err
    return ocp
