"""Writing the durable tier: chosen committed steps, as Orbax checkpoints, in the background.

Each daemon writes the ranks its trainers registered (format.py says how);
writes that fall behind collapse into the roundest waiting step of each rank
(group_view.roundest), so every host writes common steps.
"""

import logging
import os
import shutil
import time

import numpy as np

from bubblesnap.protos.checksum import checksum
from bubblesnap.service.background import CoalescingWorker
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import policy
from bubblesnap.service.durable.reader import DurableReader
from bubblesnap.service.errors import DaemonError, DataLoss
from bubblesnap.service.peers import group_view

log = logging.getLogger("bubblesnap.daemon")

#: How long a stopping daemon lets the write in progress finish.
_STOP_SECONDS = 30.0


class DurableWriter:
    """Writes chosen steps on a background thread; deletes what the tier no longer keeps."""

    def __init__(self, options: policy.DurableOptions, store, reader: DurableReader):
        self.options = options
        self._store = store
        self._reader = reader
        self._last_write: dict[tuple[str, int], float] = {}
        self._worker = CoalescingWorker("durable", self._write_batch, discard=store.unpin)
        os.makedirs(options.directory, exist_ok=True)
        fmt.orbax()  # JAX and Orbax take seconds to import: at startup, not in the first write
        logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every file at INFO

    def start(self) -> None:
        self._worker.start()

    def stop(self) -> None:
        """Finishes the write in progress, drops the ones still waiting."""
        if not self._worker.stop(_STOP_SECONDS):
            log.warning("durable: a write is still running at shutdown; its directory stays "
                        "unfinished (no .json) and is ignored")

    def committed(self, job: str, rank: int, step: int) -> None:
        """A trainer committed (job, rank, step) here; write it if the policy says so."""
        since = time.monotonic() - self._last_write.get((job, rank), float("-inf"))
        if not policy.should_write(step, since, self.options):
            return
        try:
            pinned = self._store.pin(job, rank, step)  # retention must not free it first
        except DaemonError:
            return  # already freed: a newer step replaced it
        self._last_write[(job, rank)] = time.monotonic()
        self._worker.submit((job, rank), pinned)

    def forget_after(self, job: str, step: int) -> None:
        """Drops queued writes of ``job``'s steps after ``step`` (an abandoned run's)."""
        self._worker.drop(lambda key, pinned: key[0] != job or pinned.step <= step)

    def discard_after(self, job: str, step: int) -> int:
        """Deletes written steps of ``job`` newer than ``step`` (an abandoned run's)."""
        dropped = 0
        for later in fmt.step_numbers(self.options.directory, job):
            if later > step:
                shutil.rmtree(os.path.join(self.options.directory, job, f"step_{later}"),
                              ignore_errors=True)
                dropped += 1
        return dropped

    def _write_batch(self, batch: dict) -> None:
        for (job, rank), copies in sorted(batch.items()):
            step = group_view.roundest([pinned.step for pinned in copies])
            chosen = [p for p in copies if p.step == step][-1]  # the newest copy of it
            for pinned in copies:
                if pinned is not chosen or self._worker.stopping.is_set():
                    self._store.unpin(pinned)
            if self._worker.stopping.is_set():
                continue
            try:
                self._write(chosen)
            except Exception:
                log.exception("durable write of step %d of rank %d of %s failed", step,
                              rank, job)

    def _write(self, pinned) -> None:
        job, rank, step = pinned.job, pinned.rank, pinned.step
        path = fmt.rank_path(self.options.directory, job, step, rank)
        try:
            if self._reader.written_slots(job, rank, step) == list(pinned.checksums):
                return  # this very copy is on disk already
            arrays = _assemble(pinned)
        finally:
            self._store.unpin(pinned)
        if os.path.exists(path + ".json"):  # another run's step of the same number
            os.unlink(path + ".json")
        if os.path.exists(path):  # that, or an unfinished write of a killed daemon
            shutil.rmtree(path)
        started = time.perf_counter()
        checkpointer = fmt.orbax().StandardCheckpointer()
        checkpointer.save(os.path.abspath(path), fmt.nest(arrays))
        checkpointer.wait_until_finished()
        checkpointer.close()
        meta = {"format": fmt.FORMAT, "job": job, "rank": rank, "step": step,
                "world_size": pinned.world_size, "slot_checksums": list(pinned.checksums),
                "replica_group": list(pinned.group),
                "tensors": [{"name": name, "dtype": str(a.dtype), "shape": list(a.shape),
                             "checksum": checksum(a)} for name, a in arrays.items()]}
        fmt.write_meta(path, meta)
        nbytes = sum(a.nbytes for a in arrays.values())
        log.info("durable: wrote step %d of rank %d of %s (%.1f MB in %.2f s) to %s", step, rank,
                 job, nbytes / 1e6, time.perf_counter() - started, path)
        self._retire(job, rank, pinned.world_size)

    def _retire(self, job: str, rank: int, world_size: int) -> None:
        """Deletes this rank's steps older than the ``keep`` newest steps every rank wrote."""
        directory = self.options.directory
        written = sorted(s for s in fmt.step_numbers(directory, job)
                         if rank in fmt.written_ranks(directory, job, s))
        for step in policy.steps_to_retire(written, self._reader.steps(job, world_size),
                                           self.options.keep):
            path = fmt.rank_path(directory, job, step, rank)
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
            dtypes[tensor.name] = fmt.numpy_dtype(tensor.dtype)
            arrays[tensor.name] = np.zeros(tensor.global_shape, dtypes[tensor.name])
        index = tensor.shards[s_index].index
        shape = tuple(b - a for a, b in index)
        piece = pinned.segment.view[offset:offset + nbytes].view(dtypes[tensor.name])
        arrays[tensor.name][tuple(slice(a, b) for a, b in index)] = piece.reshape(shape)
    return arrays
