"""Writing the durable tier, in the background: copies held in shared memory written as
Orbax checkpoints.

Two kinds of write, one thread:

- **Persist** (a CheckpointManager's item its policy keeps): the trainer names the
  folder; every copy asked for is written, in the order asked, none skipped
  (item_writer.py). Orbax, in the trainer, finalizes the step; if the trainer dies
  first, the daemon holding its primary process's part does (save_finisher.py).
- **The daemon's own policy** (``--durable-every-steps``/``-seconds``, bubblesnap's own
  clients): each daemon writes the ranks its trainers committed (never the replicas it
  holds for peers) into the step's partial folder, then a sidecar; the daemon that finds
  a step's sidecars whole finalizes it; any daemon retires steps older than the
  ``keep`` newest finalized ones. Writes that fall behind collapse into one waiting step
  of each rank (policy.step_to_write): the roundest, so every host writes common steps,
  or the newest when every rank of the job is on this daemon.

Every write reads the pinned copy straight from its segment, verified in memory before
and after.
"""

import logging
import time

from bubblesnap.service.background import CoalescingWorker
from bubblesnap.service.checks import is_folder_job
from bubblesnap.service.durable import (
    checkpoint,
    copy_plan,
    finalizer,
    policy,
    storage,
)
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable.finalizer import Finalizer
from bubblesnap.service.durable.item_writer import ItemWriter, Persist, verify, written_rank
from bubblesnap.service.durable.reader import DurableReader
from bubblesnap.service.durable.save_finisher import SaveFinisher
from bubblesnap.service.durable.sidecar import WrittenRank
from bubblesnap.service.errors import DaemonError, bounded
from bubblesnap.service.log_once import warn_once
from bubblesnap.service.progress import Progress

log = logging.getLogger("bubblesnap.daemon")

#: How long a stopping daemon lets the write in progress finish.
_STOP_SECONDS = 30.0
#: How often steps this daemon wrote, not yet whole, are looked at again: the
#: sidecar that completes a step may be another host's, written when this
#: daemon last looked (or its finalizer may have died).
_RECHECK_SECONDS = 5.0


class DurableWriter:
    """Writes copies on a background thread; finalizes whole steps of the daemon's own
    policy; deletes what that policy no longer keeps.

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
                                        every_seconds=_RECHECK_SECONDS, discard=self._discard)
        self._finalizer = Finalizer(options.directory, reader)
        #: the CheckpointManager saves in flight whose trainer may die before finalizing
        self.saves_in_flight = SaveFinisher(options.directory)
        self._items = ItemWriter(options, store, self.saves_in_flight, self._job_layouts,
                                 self._progress, metrics)
        # failed writes in a row, when the next may start, and why the last one failed
        self._failures, self._retry_at, self._trouble = 0, 0.0, ""
        where = storage.at(options.directory)
        where.make_folder(options.directory)
        try:
            where.names(options.directory)  # a store that refuses us says so at start
        except OSError as err:
            self._failed(f"the durable tier {options.directory} cannot be listed: {err}")
        fmt.orbax()  # JAX and Orbax take seconds to import: at startup, not in the first write
        logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every file at INFO

    def start(self) -> None:
        self._worker.start()  # its first tick publishes what a daemon finalized, then died
        self.saves_in_flight.start()

    def stop(self) -> None:
        """Finishes the write in progress, drops the ones still waiting."""
        self.saves_in_flight.stop()
        if not self._worker.stop(_STOP_SECONDS):
            log.warning("durable: a write is still running at shutdown; its step stays "
                        "unfinished (no sidecar for this rank) and is not listed")

    def committed(self, job: str, rank: int, step: int) -> None:
        """A trainer committed (job, rank, step) here; write it if the daemon's own policy
        says so (never a job named by its folder: its manager says what persists)."""
        if is_folder_job(job) or time.monotonic() < self._retry_at:
            return  # (a tier that failed is not written again until its back-off ends)
        since = time.monotonic() - self._last_write.get((job, rank), float("-inf"))
        if not policy.should_write(step, since, self.options):
            return
        try:
            pinned = self._store.pin(job, rank, step)  # retention must not free it first
        except DaemonError:
            return  # already freed: a newer step replaced it
        self._last_write[(job, rank)] = time.monotonic()
        self._worker.submit((job, rank), pinned)

    def persist(self, job: str, rank: int, step: int, folder: str, record: str = "") -> None:
        """Queues the write of ``rank``'s committed copy of ``step`` into ``folder``
        (item_writer.py; it may not exist yet); FailedPrecondition for a folder outside
        the tier, NotFound for a copy not held. The copy stays pinned until it is
        written. ``record``: the step's save in flight (the primary process's part),
        watched from now on."""
        self._worker.submit(("persist", job, rank),
                            self._items.queued(job, rank, step, folder, record))

    def forget_after(self, job: str, step: int) -> None:
        """Drops queued writes of ``job``'s steps after ``step`` (an abandoned run's), and
        publishes none of them from now on."""
        self._finalizer.fence(job, step)
        self._worker.drop(lambda key, item: key[0] != job or isinstance(item, Persist)
                          or item.step <= step)

    def discard_after(self, job: str, step: int) -> int:
        """Deletes written steps of ``job`` newer than ``step`` (an abandoned run's)."""
        dropped = 0
        for later in fmt.step_numbers(self.options.directory, job):
            if later > step:
                _delete_step(fmt.step_path(self.options.directory, job, later))
                dropped += 1
        return dropped

    def _registered_layouts(self, job: str) -> dict:
        return {r.rank: r.layout for r in self._store.layouts(job)}

    def _discard(self, item) -> None:
        """A queued write that will not run: its copy is let go (a Persist's trainer told)."""
        if isinstance(item, Persist):
            self._items.discard(item)
        else:
            self._store.unpin(item)

    def _write_batch(self, batch: dict) -> None:
        for key, items in sorted(batch.items(), key=lambda kv: str(kv[0])):
            if key[0] == "persist":
                for item in items:
                    if self._worker.stopping.is_set():
                        self._discard(item)
                    else:
                        self._items.write(item, self._worker.stopping)
            else:
                self._write_newest(items)

    def _write_newest(self, copies: list) -> None:
        """The daemon's own policy: one of a rank's waiting copies is written."""
        job, rank = copies[-1].job, copies[-1].rank
        every_rank_here = len(self._registered_layouts(job)) >= copies[-1].world_size
        step = policy.step_to_write([pinned.step for pinned in copies], every_rank_here)
        chosen = [p for p in copies if p.step == step][-1]  # the newest copy of it
        for pinned in copies:
            if pinned is not chosen or self._worker.stopping.is_set():
                self._store.unpin(pinned)
        if self._worker.stopping.is_set():
            return
        try:
            with self._metrics.timed("persist"):
                self._write_step(chosen)
        except Exception as err:
            self._failed(f"writing step {step} of rank {rank} of {job} failed: "
                         f"{type(err).__name__}: {err}", exc_info=not isinstance(
                             err, (DaemonError, OSError, ValueError)))
        else:
            self._recovered(f"step {step} of rank {rank} of {job} written")

    def _recovered(self, what: str) -> None:
        """The storage took a write (or a finalize) again: the failure is over."""
        if self._failures:
            log.warning("durable: %s after %d failed writes", what, self._failures)
        self._failures, self._trouble = 0, ""

    def trouble(self) -> str:
        """Why the tier's last write failed, while no write has succeeded since ("":
        none); Status shows it."""
        return self._trouble

    def _failed(self, why: str, exc_info: bool = False) -> None:
        """A write failed: said in the log and Status; the next waits out a back-off."""
        self._failures += 1
        wait = policy.retry_after(self._failures)
        self._retry_at = time.monotonic() + wait
        self._trouble = bounded(f"{why} ({self._failures} failed in a row; the next write "
                                f"in {wait:.0f} s or later)", 1000)
        log.error("durable: %s", self._trouble, exc_info=exc_info)

    # -- the daemon's own policy: a step of bubblesnap's own clients ----------------------

    def _write_step(self, pinned) -> None:
        job, rank, step = pinned.job, pinned.rank, pinned.step
        step_dir = fmt.partial_path(self.options.directory, job, step)
        started, began = time.perf_counter(), time.time()
        try:
            if self._reader.written_slots(job, rank, step) == list(pinned.checksums):
                written = None  # this very copy is on disk already
            else:
                self._reopen(job, step, rank, step_dir)
                written = self._write_regions(step_dir, pinned)
        finally:
            self._store.unpin(pinned)
        if written is not None and self._finalizer.abandoned(job, step, began):
            fmt.remove_rank(step_dir, rank)  # its job went back meanwhile: never published
            return
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
        rank's database of the step; the sidecar that records them."""
        known = {r: lay for r, lay in self._job_layouts(pinned.job).items()
                 if r != pinned.rank}
        plan = copy_plan.plan(pinned, known, item=False)
        verify(pinned)
        fmt.remove_rank(step_dir, pinned.rank)  # an unfinished write, or another run's
        try:
            with self._progress.track("persist", pinned.job, pinned.rank, pinned.step,
                                      pinned.layout.nbytes) as written:
                chunks = checkpoint.write_parts(step_dir, pinned.rank, plan.parts,
                                                self.options.write_batch_bytes, written,
                                            compression=self.options.compression)
            verify(pinned)  # the bytes did not change while TensorStore copied them
        except BaseException:
            fmt.remove_rank(step_dir, pinned.rank)
            raise
        return written_rank(pinned, copy_plan.with_chunks(plan.tensors, chunks))

    def _reopen(self, job: str, step: int, rank: int, partial: str) -> None:
        """A step finalized with another copy of this rank is taken back into its partial
        folder (the other ranks' writes stay) to be written again."""
        final = fmt.finalized_steps(self.options.directory, job).get(step)
        if final is None and not fmt.is_finalized(partial):
            return
        log.warning("durable: step %d of %s was finalized with another copy of rank %d; it "
                    "is written again", step, job, rank)
        if final is not None and final != partial:  # published by a rename
            where = storage.at(partial)
            if where.holds_any(partial):
                _delete_step(final)  # a newer write of the step is under way already
            else:
                fmt.remove(fmt.marker_path(final))  # unlisted first, then moved back
                where.rename(final, partial)
        finalizer.reopen(partial)  # the marker first: unlisted while written again

    def _finish(self, job: str, step: int, rank: int) -> None:
        """Finalizes the step if its sidecars are whole and gives it its folder; forgets
        it once it is there."""
        try:
            why = self._finalizer.finish(job, step, rank)
        except Exception as err:  # tried again at the next recheck
            why = f"finalizing failed: {err!r}"
        if why is None:
            if self._unfinished.pop((job, step, rank), None) is not None:
                self._recovered(f"step {step} of {job} finalized")
        elif self._unfinished.get((job, step, rank)) != why:  # each reason once
            log.info("durable: step %d of %s is not whole yet: %s", step, job, why)
            self._unfinished[(job, step, rank)] = why

    def _recheck(self) -> None:
        if time.monotonic() < self._retry_at:
            return  # the storage failed lately: its back-off holds the rechecks too
        for job, step, rank in sorted(self._unfinished):
            self._finish(job, step, rank)
        try:
            self._finalizer.publish_unpublished()
        except OSError as err:  # the storage is down: the writes say so, in Status too
            warn_once(log, f"recheck {err}", "durable: steps left unpublished are not "
                      "looked for: %s", err)

    def _retire(self, job: str) -> None:
        """Deletes steps (finished or not) older than the ``keep`` newest finalized ones."""
        directory = self.options.directory
        finalized = fmt.finalized_steps(directory, job)
        # (listed here, on the writer's thread, as long as the storage takes: the reader's
        # listing is bounded for Status and restores, and gives up)
        for step in policy.steps_to_retire(fmt.step_numbers(directory, job),
                                           sorted(finalized), self.options.keep):
            _delete_step(finalized.get(step) or fmt.partial_path(directory, job, step))


def _delete_step(step_dir: str) -> None:
    """The marker first: a step half deleted is never listed."""
    fmt.remove(fmt.marker_path(step_dir))
    fmt.remove(step_dir)
