"""Where copies of a snapshot live: this daemon's memory, peers' memory, durable storage.

Commits fan out from here to the replicator and the durable tier; status
asks here how many copies each step has. Restore goes in tier order: this
daemon's memory, a peer's memory, the durable tier. Every copy is verified
against its checksums before it is served; a copy that fails is dropped,
recorded (status and log) and the next one is tried.
With peers or a durable tier, "the latest step" means the latest step every
rank of the job can get back from some tier, so all ranks restore the same
step; a lone daemon keeps its own committed steps (store.py).
"""

import collections
import dataclasses
import logging
import threading
import time

import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import data_channel, group_view, training_log
from bubblesnap.service import layout as layout_lib
from bubblesnap.service.errors import DaemonError, DataLoss, NotFound, Unavailable

log = logging.getLogger("bubblesnap.daemon")

_CORRUPT_KEPT = 64


@dataclasses.dataclass(frozen=True)
class Restored:
    found: object  # store.Restorable
    source: str    # "memory", "peer" or "durable"
    detail: str


@dataclasses.dataclass(frozen=True)
class CorruptCopy:
    job: str
    rank: int
    step: int
    source: str
    detail: str
    unix_time: float


class Tiers:
    """The tiers beyond the store: replication to peers, the durable tier, restore order."""

    def __init__(self, store, logs, group=None, replicator=None, durable=None):
        self._store = store
        self._logs = logs
        self._group = group
        self._replicator = replicator
        self._durable = durable
        self._corrupt: collections.deque = collections.deque(maxlen=_CORRUPT_KEPT)
        self._lock = threading.Lock()

    @property
    def grouped(self) -> bool:
        return self._group is not None or self._durable is not None

    @property
    def replicas(self) -> int:
        return self._group.options.replicas if self._group is not None else 0

    def committed(self, job: str, rank: int, step: int) -> None:
        """A trainer committed a step here: replicate it, maybe write it durably."""
        if self._replicator is not None:
            self._replicator.committed(job, rank, step)
        if self._durable is not None:
            self._durable.committed(job, rank, step)

    def append_log(self, job: str, rank: int, records,
                   stream: str = training_log.TRAINING) -> tuple[int, int]:
        """Logs records here and, for the training log, at the next ``--replicas`` peers
        before answering, so they survive this host (boundary logs stay here: the
        failed stage's inputs were logged by its surviving neighbours). Returns
        (newest step held, daemons holding them)."""
        last = self._logs.append(job, rank, records, stream)
        copies = 1
        if self._group is not None and stream == training_log.TRAINING:
            request = ppb.LogReplicaRequest(job=job, rank=rank, records=[
                pb.LogRecord(step=s, payload=p) for s, p in records])
            for target in self._group.ring_order_live_first():
                if copies > self._group.options.replicas:
                    break
                try:
                    self._group.call(target, "AppendLogReplica", request)
                    copies += 1
                except grpc.RpcError as err:
                    log.warning("peer %d did not take log records of rank %d of %s: %s",
                                target, rank, job, err.code().name)
        return last, copies

    def append_logs(self, logs) -> list[tuple[int, int]]:
        """:meth:`append_log` for several ``(job, rank, records, stream)`` logs, after
        checking all of them: a bad record anywhere keeps none."""
        logs = [(job, rank, list(records), stream) for job, rank, records, stream in logs]
        for job, rank, records, stream in logs:
            self._logs.check(job, rank, records, stream)
        return [self.append_log(*log) for log in logs]

    def read_log(self, job: str, rank: int, after_step: int,
                 stream: str = training_log.TRAINING,
                 until_step: int | None = None) -> tuple[list, str]:
        """The rank's records after ``after_step``, without gaps. Training-log records
        are gathered from this daemon and every peer (a replacement host starts
        empty; records may have gone to different peers while one was down); a
        step held in several places is the same record: this daemon's copy wins."""
        if self._group is None or stream != training_log.TRAINING:
            return self._logs.read(job, rank, after_step, stream=stream,
                                   until_step=until_step), "memory"
        merged, sources = {}, {}
        for index in reversed(self._group.others()):
            try:
                for step, payload in self._peer_records(index, job, rank, after_step,
                                                        until_step):
                    merged[step] = payload
                    sources[step] = f"peer {self._group.address(index)}"
            except grpc.RpcError as err:
                log.warning("peer %d did not answer for the log of rank %d of %s: %s; the "
                            "records it holds are missing from this read", index, rank, job,
                            err.code().name)
        for step, payload in self._logs.held_after(job, rank, after_step, max_bytes=None,
                                                   until_step=until_step):
            merged[step], sources[step] = payload, "memory"
        found = training_log.contiguous(merged, after_step)
        found = training_log.prefix(found, training_log.READ_BYTES)
        used = sorted({sources[step] for step, _ in found}) or ["memory"]
        return found, ", ".join(used)

    def _peer_records(self, index: int, job: str, rank: int, after_step: int,
                      until_step: int | None):
        """Every record a peer holds after ``after_step`` (through ``until_step``), asked
        for a page at a time."""
        while True:
            answer = self._group.call(index, "ReadLogReplica", pb.ReadLogRequest(
                job=job, rank=rank, after_step=after_step, until_step=until_step))
            if not answer.records:
                return
            for r in answer.records:
                yield r.step, r.payload
            after_step = answer.records[-1].step

    def copies(self, job: str) -> dict[tuple[int, int], int]:
        """(rank, step) -> copies in the group's memory (1 for a lone daemon's own)."""
        if self._replicator is not None:
            return self._replicator.copies(job)
        return {(h.rank, h.step): 1 for h in self._store.holdings(job)}

    def durable_steps(self, job: str) -> list[int]:
        if self._durable is None:
            return []
        return self._durable.steps(job, self._store.world_size(job))

    def corrupt_copies(self, job: str) -> list[CorruptCopy]:
        with self._lock:
            return [c for c in reversed(self._corrupt) if c.job == job]

    def restore(self, job: str, rank: int, step: int | None = None,
                replica_group=(), alone: bool = False) -> Restored:
        """The rank's copy of ``step`` (default: the latest the whole job can restore).

        A member of a replica group gets its copier's copy. With peers or a
        durable tier the rank need not be registered here: a replacement
        host's trainer restores first, naming its ``replica_group``, and
        registers after. Unless the rank goes back ``alone``, the job resumes
        from ``step``: later copies are dropped everywhere.
        """
        if not self.grouped:
            return Restored(self._store.restore(job, rank, step, replica_group=replica_group),
                            "memory", "")
        layout_lib.check_job_name(job)
        holdings = self._holdings(job)
        world = self._world_size(job, holdings)
        layout_lib.check_rank(rank, world)
        copier, group = self._store.copier_of(job, rank, world, replica_group)
        durable = self._durable.steps(job, world) if self._durable is not None else []
        steps = group_view.restorable_steps(world, holdings, durable)
        if step is None:
            if not steps:
                raise NotFound(f"no step of job {job!r} can be restored for every rank: "
                               f"{_describe(holdings, world)}")
            step = steps[-1]
        layout_lib.check_step(step)
        if step not in steps:  # before any rollback: a wrong step number must cost nothing
            raise NotFound(f"step {step} of job {job!r} cannot be restored for every rank; "
                           f"restorable steps: {steps[-20:] or 'none'}")
        if copier != rank:
            for declared in {h.group for h in holdings
                             if h.rank == copier and h.step == step and h.group}:
                layout_lib.check_held_for(job, rank, copier, declared)
        if not alone:
            self._roll_back(job, step, holdings, durable)
        tried, corrupt = [], False

        def served():
            return self._store.restore(job, rank, step, chosen_by_group=True,
                                       replica_group=group)

        try:
            return Restored(served(), "memory", "")
        except DataLoss as err:
            self._record(job, copier, step, "memory", str(err))
            tried.append(f"memory: {err}")
            corrupt = True
        except NotFound:
            pass
        for index in sorted(group_view.holders(holdings).get((copier, step), ())):
            if self._group is None or index == self._group.index:
                continue
            address = self._group.address(index)
            try:
                self._pull_from_peer(index, job, world, copier, step, group)
                return Restored(served(), "peer", address)
            except DataLoss as err:
                self._record(job, copier, step, f"peer {address}", str(err))
                tried.append(f"peer {address}: {err}")
                corrupt = True
            except (DaemonError, grpc.RpcError, OSError) as err:
                tried.append(f"peer {address}: {_reason(err)}")
        if step in durable:
            try:
                self._load_durable(job, world, rank, step, group)
                return Restored(served(), "durable", self._durable.options.directory)
            except DataLoss as err:
                self._record(job, copier, step, "durable", str(err))
                tried.append(f"durable: {err}")
                corrupt = True
        if corrupt:
            raise DataLoss(f"no intact copy of step {step} of rank {rank} of job {job!r}; "
                           f"tried: {'; '.join(tried)}")
        if tried:
            raise Unavailable(f"the copies of step {step} of rank {rank} of job {job!r} could "
                              f"not be fetched now; tried: {'; '.join(tried)}. Try again")
        raise NotFound(f"step {step} of rank {rank} of job {job!r} is held nowhere; restorable "
                       f"steps: {steps or 'none'}")

    def _roll_back(self, job: str, step: int, holdings, durable) -> None:
        """Restoring ``step`` resumes the job from it: later copies, here, at every peer
        and in the durable tier, belong to an abandoned run. Dropped before anything
        is installed, so a resumed run never mixes with them."""
        if not any(h.step > step for h in holdings) and not any(s > step for s in durable):
            return
        log.info("job %s resumes from step %d: dropping later copies in the group", job, step)
        self.roll_back_here(job, step)
        if self._durable is not None:
            self._durable.discard_after(job, step)
        if self._group is not None:
            request = ppb.RollbackRequest(job=job, step=step)
            for index in self._group.others():
                try:
                    self._group.call(index, "Rollback", request)
                except grpc.RpcError as err:
                    log.warning("peer %d did not roll back %s to step %d: %s; a copy of a "
                                "later step it holds may be from the abandoned run", index, job,
                                step, err.code().name)

    def roll_back_here(self, job: str, step: int) -> int:
        """Drops this daemon's copies of ``job`` after ``step``, and queued work on them."""
        if self._replicator is not None:
            self._replicator.forget_after(job, step)
        if self._durable is not None:
            self._durable.forget_after(job, step)
        return self._store.rollback(job, step)

    def _pull_from_peer(self, index: int, job: str, world: int, rank: int, step: int,
                        group: tuple[int, ...]) -> None:
        options = self._group.options
        answer = self._group.call(index, "OpenRead", ppb.OpenReadRequest(job=job, rank=rank,
                                                                         step=step))
        layout = layout_lib.build_layout(answer.tensors)
        if layout.segment_bytes != answer.segment_bytes:
            raise DataLoss(f"peer {index} offered {answer.segment_bytes} bytes for a "
                           f"{layout.segment_bytes}-byte layout")
        fill = data_channel.puller(answer.data_address, answer.ticket,
                                   options.security.client_ssl_context(),
                                   options.transfer_timeout_seconds,
                                   f"step {step} of rank {rank}")
        self._store.install(job, world, rank, step, layout, tuple(answer.checksums), fill,
                            for_restore=True, replica_group=group)

    def _load_durable(self, job: str, world: int, rank: int, step: int,
                      group: tuple[int, ...]) -> None:
        """Installs the copy of ``rank`` (its group's copier's, ``group[0]``) from disk,
        cut into the layout the copier registered here (whole tensors if none did),
        once the copier's written group names ``rank``."""
        copier = group[0]
        if copier != rank:
            layout_lib.check_held_for(job, rank, copier,
                                     self._durable.replica_group(job, copier, step))
        try:
            layout = self._store.layout_of(job, copier)
        except NotFound:  # not registered here yet: whole tensors, the client reshards
            layout = self._durable.whole_layout(job, copier, step)
        fill, checksums = self._durable.load(job, copier, step, layout)
        self._store.install(job, world, copier, step, layout, checksums, fill, for_restore=True,
                            replica_group=group)

    def _holdings(self, job: str) -> list[group_view.Holding]:
        if self._replicator is not None:
            return self._replicator.view(job)
        return [group_view.Holding(0, h.rank, h.step, h.replica, h.world_size, h.group)
                for h in self._store.holdings(job)]

    def _world_size(self, job: str, holdings) -> int:
        try:
            return self._store.world_size(job)
        except NotFound:
            pass
        sizes = {h.world_size for h in holdings if h.world_size}
        if self._durable is not None and not sizes:
            sizes = {self._durable.world_size(job)} - {0}
        if len(sizes) != 1:
            raise NotFound(f"no peer and no durable checkpoint knows job {job!r}"
                           if not sizes else f"peers disagree on the world size of job "
                           f"{job!r}: {sorted(sizes)}")
        return sizes.pop()

    def _record(self, job: str, rank: int, step: int, source: str, detail: str) -> None:
        log.warning("corrupt copy skipped: step %d of rank %d of %s from %s: %s", step, rank,
                    job, source, detail)
        with self._lock:
            self._corrupt.append(CorruptCopy(job, rank, step, source, detail, time.time()))


def _reason(err) -> str:
    if isinstance(err, grpc.RpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err)


def _describe(holdings, world: int) -> str:
    """Which ranks hold nothing (themselves or through their replica group's copier),
    and what the others hold; bounded for huge jobs."""
    per_rank: dict[int, list[int]] = {}
    for rank, step in group_view.holders(holdings):
        per_rank.setdefault(rank, []).append(step)
    copier = group_view.copiers(holdings)
    empty = [r for r in range(min(world, 1 << 16)) if copier.get(r, r) not in per_rank]
    held = {r: sorted(per_rank[r])[-4:] for r in sorted(per_rank)[:8]}
    return (f"{len(empty)} of {world} ranks hold no copy (e.g. {empty[:10]}); newest steps "
            f"held: {held}{' ...' if len(per_rank) > 8 else ''}")

