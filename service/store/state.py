"""What the store's parts share: the jobs, the memory, the options. Used with the lock held."""

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from bubblesnap.protos.checksum import checksum
from bubblesnap.service.errors import ResourceExhausted
from bubblesnap.service.store import persistence, retention
from bubblesnap.service.store.memory import Memory
from bubblesnap.service.store.model import Job, Rank, RankStep
from bubblesnap.service.store.options import StoreOptions
from bubblesnap.service.store.segments import Segment


@dataclasses.dataclass
class StoreState:
    """The store's state; every function of store/ that takes it runs under the store's lock.

    ``grouped``: peers decide what is committed (``Job.group_committed``).
    ``on_retained(job, step)`` hear the oldest committed step retention keeps,
    each time it runs, with the lock held: they must not call the store.
    """

    options: StoreOptions
    memory: Memory
    grouped: bool
    hashers: ThreadPoolExecutor
    jobs: dict[str, Job] = dataclasses.field(default_factory=dict)
    on_retained: list = dataclasses.field(default_factory=list)
    #: (job, rank) -> segments served with its restores' answers (assembled, or a
    #: peer's copy pulled whole), freed at its next restore or commit (its trainer
    #: mapped them by then) or with the job.
    served: dict = dataclasses.field(default_factory=dict)
    #: Served segments a restore is still filling (RestoreSegments.served).
    filling: set = dataclasses.field(default_factory=set)

    def release_served(self, job: str, rank: int | None = None) -> None:
        """Frees what was assembled for ``rank``'s restores (every rank's: None). A
        rank's segments still being filled stay (another restore of the same rank, in
        flight: freeing them would pull its memory from under it); its next release
        frees them."""
        for key in [k for k in self.served if k[0] == job and rank in (None, k[1])]:
            kept = [s for s in self.served[key] if rank is not None and s in self.filling]
            for segment in self.served.pop(key):
                if segment not in kept:
                    self.memory.drop(segment)
            if kept:
                self.served[key] = kept

    def new_job(self, name: str, world_size: int) -> Job:
        entry = self.jobs[name] = Job(world_size,
                                      group_committed=[] if self.grouped else None)
        return entry

    def record(self, name: str, entry: Job, rank: int, held: Rank, step: int,
               rank_step: RankStep, checksums: tuple[int, ...]) -> None:
        """Writes beside its segment what a restarted daemon needs to serve this copy,
        which is becoming LOCAL with ``checksums`` (persistence.py). One that cannot be
        recorded is dropped: ResourceExhausted."""
        record = persistence.CopyRecord(name, entry.world_size, rank, step,
                                        rank_step.world_size, rank_step.group, held.replica,
                                        rank_step.replicated, rank_step.layout, checksums)
        try:
            persistence.write(rank_step.segment.path, record)
        except OSError as err:
            self.memory.free(held, step)
            raise ResourceExhausted(
                f"step {step} of rank {rank} of job {name!r} could not be recorded beside its "
                f"segment ({err}), so it would not survive a daemon restart; the copy was "
                "dropped. Free space in --shm-dir and snapshot again") from err

    def retain(self, name: str, entry: Job) -> None:
        """Frees what retention lets go of ``entry``'s copies (nothing while adopted
        copies wait for the group's committed steps)."""
        if entry.awaiting_group:
            return
        committed = entry.committed_steps()
        keep = self.options.keep_steps
        now = entry.gathered_at if self.grouped else time.monotonic()
        for held in entry.ranks.values():
            for step in retention.steps_to_free(held.steps, committed, keep, self.grouped, now,
                                                self.options.uncommitted_grace_seconds):
                self.memory.free(held, step)
        floor = retention.oldest_kept(committed, keep)
        if floor >= 0:
            for listener in self.on_retained:
                listener(name, floor)

    def hash(self, segment: Segment, slots) -> tuple[int, ...]:
        """Checksums of ``slots`` of ``segment``, one task per slot."""
        views = [segment.view[off:off + n] for _, _, off, n in slots]
        return tuple(self.hashers.map(checksum, views))
