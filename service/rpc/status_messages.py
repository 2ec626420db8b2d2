"""A daemon's status as the wire carries it (StatusResponse): the part of the servicers'
conversions that is answers only."""

import dataclasses

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.store.model import CopyState

_STATES = {CopyState.STAGING: pb.STAGING, CopyState.LOCAL: pb.LOCAL}


def _pages(pages) -> dict:
    """MemoryStatus's fields of the pages segments get (none when not known)."""
    if pages is None:
        return {}
    return {"shm_filesystem": pages.filesystem, "shm_huge": pages.huge,
            "shm_page_bytes": pages.page_bytes}


def daemon_status(status) -> pb.StatusResponse:
    memory = status.memory
    return pb.StatusResponse(
        jobs=[_job_status(job) for job in status.jobs],
        memory=pb.MemoryStatus(budget_bytes=memory.budget_bytes, used_bytes=memory.used_bytes,
                               pooled_bytes=memory.pooled_bytes, shm_dir=memory.shm_dir,
                               shm_free_bytes=memory.shm_free_bytes,
                               log_bytes=status.log_bytes,
                               log_budget_bytes=status.log_budget_bytes,
                               warm_bytes=memory.warm_bytes,
                               warm_pool_bytes=memory.warm_pool_bytes,
                               warm_segments_taken=memory.warm_taken,
                               **_pages(memory.pages)),
        adoption=_adoption(status.adoption),
        in_flight=[pb.InFlight(kind=w.kind, job=w.job, rank=w.rank, step=w.step,
                               done_bytes=w.done_bytes, total_bytes=w.total_bytes,
                               seconds=w.seconds) for w in status.in_flight],
        durable_directory=status.durable_directory, durable_error=status.durable_error,
        durable_notes=status.durable_notes)


def _adoption(found) -> pb.Adoption:
    def left(files):
        return [pb.LeftFile(path=f.path, reason=f.reason, nbytes=f.nbytes) for f in files]
    return pb.Adoption(
        directories=found.directories, adopted_bytes=found.adopted_bytes,
        adopted=[pb.AdoptedCopy(job=c.job, rank=c.rank, step=c.step, nbytes=c.nbytes,
                                replica=c.replica) for c in found.adopted],
        dropped=left(found.dropped), dropped_bytes=found.dropped_bytes, kept=left(found.kept),
        seconds=found.seconds)


def _job_status(status) -> pb.JobStatus:
    job, durable = status.job, status.durable_steps
    return pb.JobStatus(
        job=job.job, world_size=job.world_size, registered_ranks=job.registered_ranks,
        latest_committed_step=job.latest_committed_step,
        steps=[pb.StepStatus(step=s.step, committed=s.committed, ranks=[
            pb.RankStepStatus(rank=r.rank, state=_STATES[r.state], nbytes=r.nbytes, shards=[
                pb.ShardStatus(tensor=sh.tensor, shard=sh.shard, nbytes=sh.nbytes,
                               checksum=sh.checksum) for sh in r.shards],
                usage=pb.BubbleUsage(**dataclasses.asdict(r.usage)), replica=r.replica,
                copies=status.copies.get((r.rank, s.step), 0), durable=s.step in durable,
                held_for=r.held_for)
            for r in s.ranks]) for s in job.steps],
        plan=_plan_status(status.plan, status.profiles, status.plan_version),
        replicas=status.replicas, durable_steps=durable,
        coverage=pb.Coverage(whole=status.coverage.whole, known=status.coverage.known,
                             missing=[status.coverage.conflict] if status.coverage.conflict
                             else status.coverage.gaps),
        corrupt_copies=[
            pb.CorruptCopy(rank=c.rank, step=c.step, source=c.source, detail=c.detail,
                           unix_time=c.unix_time)
            for c in status.corrupt_copies],
        replication=[pb.Replication(**dataclasses.asdict(r)) for r in status.replication])


def _plan_status(plan, profiles, version) -> pb.PlanStatus:
    if plan is None:
        return pb.PlanStatus()
    return pb.PlanStatus(
        interval=plan.interval, version=version, predicted_overhead=plan.predicted_overhead,
        ranks=[pb.RankPlan(rank=rank, bubbles=rp.usable_bubbles, bubble_seconds=rp.bubble_seconds,
                           copy_bytes_per_second=profiles[rank].copy_bytes_per_second,
                           step_bytes=profiles[rank].step_bytes,
                           predicted_overhead=rp.predicted_overhead,
                           planned_spill_bytes=rp.spill_bytes)
               for rank, rp in sorted(plan.ranks.items())])
