"""The Persist path of the durable writer: a CheckpointManager item's copy written into the
folder its trainer named, as its rank's process of Orbax's PyTree save writes it.

Every copy asked for is written, in the order asked, none skipped (a backlog makes the
trainer's next save wait, as Orbax's does); the writer's thread runs them
(writer.py). The write waits for the folder (Orbax makes it in the background), says it
began, writes the rank's database aside and moves it in with one rename (a trainer that
stopped waiting for this daemon writes its part the same way: the first rename is the
part, and this write is then dropped and noted), then Orbax's files beside the arrays
from the item's record, last the rank's sidecar (the write is durable) or why not
(persist.py). The Persist of the primary process's part names the step's record: the
save in flight is watched from then on (save_finisher.py).
"""

import dataclasses
import json
import logging
import time

from bubblesnap.protos.checksum import checksum
from bubblesnap.service.checks import is_folder_job
from bubblesnap.service.durable import checkpoint, copy_plan, item_files, persist
from bubblesnap.service.durable.sidecar import WrittenRank
from bubblesnap.service.errors import DaemonError, DataLoss, FailedPrecondition, shown
from bubblesnap.shared import checkpoint_record

log = logging.getLogger("bubblesnap.daemon")

#: How long a Persist waits for its folder: Orbax makes a step's folders in the
#: background, in milliseconds; a trainer that died first never makes them.
_FOLDER_WAIT_SECONDS = 30.0


class _TakenOver(Exception):
    """The rank's part is in the folder already: its trainer wrote it (persist.move_in)."""


@dataclasses.dataclass(frozen=True)
class Persist:
    """A copy to write into the folder its trainer named."""

    pinned: object
    folder: str


class ItemWriter:
    """Writes Persist calls' copies (``store``: pins them; ``saves_in_flight``: the
    SaveFinisher; ``job_layouts``, ``progress``, ``metrics``: as the writer's)."""

    def __init__(self, options, store, saves_in_flight, job_layouts, progress, metrics):
        self._options, self._store, self._saves = options, store, saves_in_flight
        self._job_layouts, self._progress, self._metrics = job_layouts, progress, metrics

    def queued(self, job: str, rank: int, step: int, folder: str, record: str) -> Persist:
        """The write of ``rank``'s committed copy of ``step`` into ``folder``, its copy
        pinned (persist.py checks; it may not exist yet); FailedPrecondition for a folder
        outside the tier, NotFound for a copy not held."""
        target = persist.check_inside(self._options.directory, folder)
        if not is_folder_job(job):
            raise FailedPrecondition(
                f"job {shown(job, 400)} is not a CheckpointManager's item (a job named by its "
                "folder): its steps are written as --durable-every-steps/-seconds say")
        pinned = self._store.pin(job, rank, step)
        if checkpoint_record.TENSOR not in (t.name for t in pinned.layout.tensors):
            self._store.unpin(pinned)
            raise FailedPrecondition(f"job {shown(job, 400)} holds no item record "
                                     f"({checkpoint_record.TENSOR!r}): not an item a "
                                     "CheckpointManager saved")
        if record:
            try:
                self._saves.watch(record)
            except DaemonError:
                self._store.unpin(pinned)
                raise
        return Persist(pinned, target)

    def discard(self, item: Persist) -> None:
        """A queued write that will not run: its copy is let go, its trainer told (it
        must not wait for a write that never comes)."""
        self._store.unpin(item.pinned)
        persist.mark_failed(item.folder, item.pinned.rank,
                            "the daemon stopped before it wrote this copy")

    def write(self, item: Persist, stopping) -> None:
        pinned, folder = item.pinned, item.folder
        started = time.perf_counter()
        try:
            if not persist.wait_for(folder, _FOLDER_WAIT_SECONDS, stopping):
                log.warning("durable: step %d of rank %d of %s not written: its folder %s is "
                            "not there (its trainer died first, or finalized the step without "
                            "this write)", pinned.step, pinned.rank, pinned.job, folder)
                return
            folder = persist.check_target(self._options.directory, folder)
            persist.prepare(folder, pinned.rank)
            with persist.writing(folder, pinned.rank), self._metrics.timed("persist"):
                written = self._write_item(pinned, folder)
                persist.answer(folder, checkpoint_record.persisted_file(pinned.rank),
                               json.dumps(written.to_json()).encode())
            log.info("durable: wrote step %d of rank %d of %s (%.1f MB in %.2f s) to %s",
                     pinned.step, pinned.rank, pinned.job, pinned.layout.nbytes / 1e6,
                     time.perf_counter() - started, folder)
        except Exception as err:
            if not isinstance(err, _TakenOver) and not persist.gone(folder):
                self._failed(pinned, folder, err)
                return
            self._saves.note(
                f"step {pinned.step} of rank {pinned.rank} of {pinned.job}: written by its "
                f"trainer, which stopped waiting for this daemon; this daemon's write of it "
                f"was dropped ({time.perf_counter() - started:.1f} s after it began)")
        finally:
            self._store.unpin(pinned)

    @staticmethod
    def _failed(pinned, folder: str, err: Exception) -> None:
        log.error("durable write of step %d of rank %d of %s into %s failed: %s",
                  pinned.step, pinned.rank, pinned.job, folder, err,
                  exc_info=not isinstance(err, DaemonError))
        try:
            persist.mark_failed(folder, pinned.rank, f"{type(err).__name__}: {err}")
        except OSError as mark_err:
            log.error("durable: could not say so in %s: %s", folder, mark_err)

    def _write_item(self, pinned, folder: str) -> WrittenRank:
        """Writes the copy into ``folder`` as its rank's process of Orbax's PyTree save;
        the sidecar saying what it wrote."""
        known = {r: lay for r, lay in self._job_layouts(pinned.job).items()
                 if r != pinned.rank}
        plan = copy_plan.plan(pinned, known, item=True)
        verify(pinned)
        staging = persist.make_staging(folder, pinned.rank)
        with self._progress.track("persist", pinned.job, pinned.rank, pinned.step,
                                  pinned.layout.nbytes) as written:
            chunks = checkpoint.write_parts(staging, pinned.rank, plan.parts,
                                            self._options.write_batch_bytes, written,
                                            compression=self._options.compression)
        verify(pinned)  # the bytes did not change while TensorStore copied them
        if not persist.move_in(staging, folder, pinned.rank):
            raise _TakenOver(folder)
        if plan.record is not None:
            item_files.write(folder, plan.record, {**plan.grids, **chunks},
                             checkpoint.empty_tree_metadata(), pinned.world_size)
        return written_rank(pinned, copy_plan.with_chunks(plan.tensors, chunks))


def written_rank(pinned, tensors) -> WrittenRank:
    """The sidecar of a pinned copy's write of ``tensors``."""
    return WrittenRank(pinned.job, pinned.step, pinned.rank, pinned.world_size,
                       tuple(pinned.group) or (pinned.rank,), tuple(tensors))


def verify(pinned) -> None:
    """Every slot still matches its checksum in memory: the commit trusted the
    client's checksums, and a copy damaged in memory must not become a checkpoint
    with fresh, matching checksums."""
    for (t_index, _, offset, nbytes), expected in zip(pinned.slots, pinned.checksums,
                                                       strict=True):
        if checksum(pinned.segment.view[offset:offset + nbytes]) != expected:
            raise DataLoss(f"step {pinned.step} of rank {pinned.rank}: a shard of "
                           f"{pinned.layout.tensors[t_index].name!r} no longer matches its "
                           "checksum in memory; not written")
