"""Writing the durable tier: chosen committed steps into one Orbax checkpoint per step,
in the background.

Each daemon writes the ranks its trainers committed (never the replicas it
holds for peers): their regions, from the pinned shared-memory segment
straight into the step's checkpoint (checkpoint.py), then a sidecar. The
daemon that finds a step's sidecars whole finalizes it; any daemon retires
steps older than the ``keep`` newest finalized ones. Writes that fall behind
collapse into one waiting step of each rank (policy.step_to_write): the
roundest, so every host writes common steps, or the newest when every rank
of the job is on this daemon.
"""

import dataclasses
import logging
import math
import os
import shutil
import time

from bubblesnap import checkpoint_record
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.background import CoalescingWorker
from bubblesnap.service.durable import checkpoint, finalizer, manager_files, orbax_layout, policy
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable.finalizer import Finalizer
from bubblesnap.service.durable.reader import DurableReader
from bubblesnap.service.durable.sidecar import WrittenRank, WrittenTensor
from bubblesnap.service.errors import DaemonError, DataLoss, FailedPrecondition
from bubblesnap.service.progress import Progress

log = logging.getLogger("bubblesnap.daemon")

#: How long a stopping daemon lets the write in progress finish.
_STOP_SECONDS = 30.0
#: How often steps this daemon wrote, not yet whole, are looked at again: the
#: sidecar that completes a step may be another host's, written when this
#: daemon last looked (or its finalizer may have died).
_RECHECK_SECONDS = 5.0


class DurableWriter:
    """Writes chosen steps on a background thread; finalizes whole steps; deletes what
    the tier no longer keeps.

    ``job_layouts(job) -> {rank: Layout}``: every rank's layout this daemon
    knows (default: the ranks registered here). It picks the chunk grid of a
    job-wide array, which must be the same on every daemon writing it: JAX
    shardings give the same grid from any one rank's regions, other layouts
    need all of them (the group's).
    """

    def __init__(self, options: policy.DurableOptions, store, reader: DurableReader, metrics,
                 job_layouts=None, progress: Progress | None = None):
        self.options = options
        self._progress = progress or Progress()
        self._store = store
        self._metrics = metrics  # times each rank's write
        self._reader = reader
        self._job_layouts = job_layouts or self._registered_layouts
        self._last_write: dict[tuple[str, int], float] = {}
        # (job, step, rank) written here, not final yet -> why the step is not whole
        self._unfinished: dict[tuple[str, int, int], str] = {}
        self._worker = CoalescingWorker("durable", self._write_batch, tick=self._recheck,
                                        every_seconds=_RECHECK_SECONDS, discard=store.unpin)
        self._finalizer = Finalizer(options.directory, reader)
        os.makedirs(options.directory, exist_ok=True)
        fmt.orbax()  # JAX and Orbax take seconds to import: at startup, not in the first write
        logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every file at INFO

    def start(self) -> None:
        self._worker.start()  # its first tick publishes what a daemon finalized, then died

    def stop(self) -> None:
        """Finishes the write in progress, drops the ones still waiting."""
        if not self._worker.stop(_STOP_SECONDS):
            log.warning("durable: a write is still running at shutdown; its step stays "
                        "unfinished (no sidecar for this rank) and is not listed")

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
        """Deletes written steps of ``job`` newer than ``step`` (an abandoned run's), and
        the items a manager saved for them."""
        dropped = 0
        for later in fmt.step_numbers(self.options.directory, job):
            if later > step:
                _delete_step(fmt.step_path(self.options.directory, job, later))
                fmt.remove(fmt.items_path(self.options.directory, job, later))
                dropped += 1
        return dropped

    def _registered_layouts(self, job: str) -> dict:
        return {r.rank: r.layout for r in self._store.layouts(job)}

    def _write_batch(self, batch: dict) -> None:
        for (job, rank), copies in sorted(batch.items()):
            every_rank_here = len(self._registered_layouts(job)) >= copies[-1].world_size
            step = policy.step_to_write([pinned.step for pinned in copies], every_rank_here)
            chosen = [p for p in copies if p.step == step][-1]  # the newest copy of it
            for pinned in copies:
                if pinned is not chosen or self._worker.stopping.is_set():
                    self._store.unpin(pinned)
            if self._worker.stopping.is_set():
                continue
            try:
                with self._metrics.timed("persist"):
                    self._write(chosen)
            except Exception as err:
                log.error("durable write of step %d of rank %d of %s failed: %s", step, rank,
                          job, err, exc_info=not isinstance(err, DaemonError))

    def _write(self, pinned) -> None:
        job, rank, step = pinned.job, pinned.rank, pinned.step
        step_dir = fmt.partial_path(self.options.directory, job, step)
        started = time.perf_counter()
        try:
            if self._reader.written_slots(job, rank, step) == list(pinned.checksums):
                written = None  # this very copy is on disk already
            else:
                self._reopen(job, step, rank, step_dir)
                written = self._write_regions(step_dir, pinned)
        finally:
            self._store.unpin(pinned)
        if written is not None:
            fmt.write_json(fmt.sidecar_path(step_dir, rank), written.to_json())
            log.info("durable: wrote step %d of rank %d of %s (%.1f MB in %.2f s) to %s", step,
                     rank, job, pinned.layout.nbytes / 1e6, time.perf_counter() - started,
                     step_dir)
        self._unfinished.setdefault((job, step, rank), "")
        self._finish(job, step, rank)
        self._retire(job)

    def _write_regions(self, step_dir: str, pinned) -> WrittenRank:
        """Writes the copy's regions (verified in memory before and after) into its
        rank's database of the step (and, holding a CheckpointManager's step record,
        the record and the scalars it holds); the sidecar that records them."""
        parts, tensors, record = self._plan(pinned)
        _verify(pinned)
        fmt.remove_rank(step_dir, pinned.rank)  # an unfinished write, or another run's
        try:
            with self._progress.track("persist", pinned.job, pinned.rank, pinned.step,
                                      pinned.layout.nbytes) as written:
                chunks = checkpoint.write_parts(step_dir, pinned.rank, parts,
                                                self.options.write_batch_bytes, written)
            _verify(pinned)  # the bytes did not change while TensorStore copied them
            if record is not None:
                manager_files.write_record(step_dir, record)
        except BaseException:
            fmt.remove_rank(step_dir, pinned.rank)
            raise
        return WrittenRank(pinned.job, pinned.step, pinned.rank, pinned.world_size,
                           tuple(pinned.group) or (pinned.rank,), tuple(
                               dataclasses.replace(t, chunks=chunks.get(
                                   (t.item, t.location("")[1]), ())) for t in tensors))

    def _plan(self, pinned):
        """What to write: an ArrayPart per tensor with regions here (numpy views of the
        segment, no copy), the sidecar fields of every tensor and, for a
        CheckpointManager's step whose record this copy holds, the record (its
        scalars become parts too). FailedPrecondition for a state the checkpoint
        cannot hold."""
        layout, rank, world = pinned.layout, pinned.rank, pinned.world_size
        known = {r: lay for r, lay in self._job_layouts(pinned.job).items() if r != rank}
        managed = orbax_layout.is_manager_layout([t.name for t in layout.tensors])

        def key_of(t, r):
            if managed:
                return orbax_layout.item_key(t.name, r, world, t.job_wide)
            return orbax_layout.tree_key(t.name, r, world, t.job_wide)
        leaves = [orbax_layout.leaf(key_of(t, r), r, t.job_wide)
                  for r, lay in [(rank, layout), *known.items()] for t in lay.tensors]
        why = orbax_layout.conflict(leaves)
        if why is not None:
            raise FailedPrecondition(f"the state's names cannot be one checkpoint: {why}; "
                                     "not written")
        views = {}
        for t_index, s_index, offset, nbytes in pinned.slots:
            views.setdefault(t_index, []).append((s_index, offset, nbytes))
        parts, tensors, record = [], [], None
        for t_index, tensor in enumerate(layout.tensors):
            if math.prod(tensor.global_shape) == 0:
                raise FailedPrecondition(f"tensor {tensor.name!r} has no elements (shape "
                                         f"{tensor.global_shape}): Orbax cannot save it")
            key = key_of(tensor, rank)
            item = key[0] if managed else ""
            if item == orbax_layout.RECORD_ITEM and tensor.name != checkpoint_record.TENSOR:
                raise FailedPrecondition(f"tensor {tensor.name!r}: only the step record lives "
                                         f"under {item}/; not written")
            if item and item != orbax_layout.RECORD_ITEM:
                try:  # the item becomes a folder of the step
                    checkpoint_record.check_item_name(item)
                except ValueError as err:
                    raise FailedPrecondition(f"tensor {tensor.name!r}: {err}; not written") \
                        from None
            boxes = [s.index for s in tensor.shards]
            if tensor.job_wide:
                boxes += [s.index for lay in known.values() for t in lay.tensors
                          if t.job_wide and t.name == tensor.name for s in t.shards]
            dtype = fmt.numpy_dtype(tensor.dtype)
            regions = tuple(
                (tensor.shards[s].index, pinned.segment.view[offset:offset + nbytes].view(dtype)
                 .reshape(tuple(b - a for a, b in tensor.shards[s].index)))
                for s, offset, nbytes in views.get(t_index, ()))
            if regions:
                written = WrittenTensor(tensor.name, tensor.dtype, tensor.global_shape,
                                        tensor.job_wide, key, (), (), (), item)
                parts.append(checkpoint.ArrayPart(
                    written.location("")[1], tensor.dtype, tensor.global_shape,
                    orbax_layout.write_shape(tensor.global_shape, boxes), regions, item))
                if managed and item == orbax_layout.RECORD_ITEM:
                    record = manager_files.decode(regions[0][1])
            tensors.append(WrittenTensor(
                tensor.name, tensor.dtype, tensor.global_shape, tensor.job_wide, key, (),
                tuple(s.index for s in tensor.shards),
                tuple(c for slot, c in zip(pinned.slots, pinned.checksums, strict=True)
                      if slot[0] == t_index), item))
        if record is not None:
            parts += [checkpoint.ArrayPart(param, array.dtype.name, (), (), (((), array),), item)
                      for item, param, array in manager_files.scalars(record)]
        return parts, tensors, record

    def _reopen(self, job: str, step: int, rank: int, partial: str) -> None:
        """A step finalized with another copy of this rank is taken back into its partial
        folder (the other ranks' writes stay) to be written again."""
        final = fmt.finalized_steps(self.options.directory, job).get(step)
        if final is None and not fmt.is_finalized(partial):
            return
        log.warning("durable: step %d of %s was finalized with another copy of rank %d; it "
                    "is written again", step, job, rank)
        if final is not None:
            if os.path.isdir(partial):
                _delete_step(final)  # a newer write of the step is under way already
            else:
                fmt.remove(fmt.marker_path(final))  # unlisted first, then moved back
                os.rename(final, partial)
        finalizer.reopen(partial)

    def _finish(self, job: str, step: int, rank: int) -> None:
        """Finalizes the step if its sidecars are whole and gives it its folder; forgets
        it once it is there."""
        try:
            why = self._finalizer.finish(job, step, rank)
        except Exception as err:  # tried again at the next recheck
            why = f"finalizing failed: {err!r}"
        if why is None:
            self._unfinished.pop((job, step, rank), None)
        elif self._unfinished.get((job, step, rank)) != why:  # each reason once
            log.info("durable: step %d of %s is not whole yet: %s", step, job, why)
            self._unfinished[(job, step, rank)] = why

    def _recheck(self) -> None:
        for job, step, rank in sorted(self._unfinished):
            self._finish(job, step, rank)
        self._finalizer.publish_unpublished()

    def _retire(self, job: str) -> None:
        """Deletes steps (finished or not) older than the ``keep`` newest finalized ones,
        but for the finalized steps of a CheckpointManager, which its preservation
        policy retires."""
        directory = self.options.directory
        finalized = fmt.finalized_steps(directory, job)
        for step in policy.steps_to_retire(fmt.step_numbers(directory, job),
                                           self._reader.steps(job), self.options.keep):
            if step in finalized and _managed(finalized[step]):
                continue
            _delete_step(finalized.get(step) or fmt.partial_path(directory, job, step))


def _delete_step(step_dir: str) -> None:
    """The marker first: a step half deleted is never listed."""
    fmt.remove(fmt.marker_path(step_dir))
    shutil.rmtree(step_dir, ignore_errors=True)


def _managed(step_dir: str) -> bool:
    """Whether a finalized step is a CheckpointManager's, kept as its policy says."""
    try:
        return bool(fmt.read_json(fmt.marker_path(step_dir)).get("managed"))
    except DaemonError:
        return False


def _verify(pinned) -> None:
    """Every slot still matches its checksum in memory: the commit trusted the
    client's checksums, and a copy damaged in memory must not become a checkpoint
    with fresh, matching checksums."""
    for (t_index, _, offset, nbytes), expected in zip(pinned.slots, pinned.checksums,
                                                       strict=True):
        if checksum(pinned.segment.view[offset:offset + nbytes]) != expected:
            raise DataLoss(f"step {pinned.step} of rank {pinned.rank}: a shard of "
                           f"{pinned.layout.tensors[t_index].name!r} no longer matches its "
                           "checksum in memory; not written")
