"""The gRPC face of the daemon: translate messages, delegate, map errors to codes."""

import dataclasses
import functools
import logging

import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service import errors
from bubblesnap.service.layout_messages import slots, tensor_specs
from bubblesnap.service.store import BubbleUsage, CopyState

log = logging.getLogger("bubblesnap.daemon")

_CODES = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}
_STATES = {CopyState.STAGING: pb.STAGING, CopyState.LOCAL: pb.LOCAL}


def rpc_errors(method):
    """Maps store errors to status codes and counts every answer."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            response = method(self, request, context)
        except errors.DaemonError as err:
            code = _CODES[type(err)]
            self._metrics.rpcs.labels(method.__name__, code.name).inc()
            log.info("%s refused: %s: %s", method.__name__, code.name, err)
            context.abort(code, str(err))
        self._metrics.rpcs.labels(method.__name__, "OK").inc()
        return response

    return wrapper


def _staging(staging):
    return pb.BeginStepResponse(segment_path=staging.segment_path,
                                segment_bytes=staging.segment_bytes, slots=slots(staging.slots))


class DaemonServicer:
    """Implements ``bubblesnap.v1.Daemon`` over a :class:`SnapshotStore`."""

    def __init__(self, store, plans, metrics, tiers, logs):
        self._store = store
        self._plans = plans
        self._metrics = metrics
        self._tiers = tiers
        self._logs = logs

    @rpc_errors
    def Register(self, request, context):
        reg = self._store.register(request.job, request.rank, request.world_size,
                                   request.tensors, request.replica_group)
        return pb.RegisterResponse(reattached=reg.reattached,
                                   latest_local_step=reg.latest_local_step,
                                   step_bytes=reg.step_bytes)

    @rpc_errors
    def BeginStep(self, request, context):
        return _staging(self._store.begin_step(request.job, request.rank, request.step))

    @rpc_errors
    def CommitStep(self, request, context):
        u = request.usage
        usage = BubbleUsage(u.offered_seconds, u.used_seconds, u.spilled_seconds,
                            u.spilled_bytes, u.bubbles, u.iterations, u.overrun_seconds)
        commit = self._store.commit_step(
            request.job, request.rank, request.step, tuple(request.checksums), usage,
            request.next_step if request.HasField("next_step") else None)
        if commit.newly_local:
            self._tiers.committed(request.job, request.rank, request.step)
        return pb.CommitStepResponse(
            job_committed=commit.job_committed, latest_committed_step=commit.latest_committed_step,
            next=_staging(commit.next) if commit.next else None)

    @rpc_errors
    def AbortStep(self, request, context):
        self._store.abort_step(request.job, request.rank, request.step)
        return pb.AbortStepResponse()

    @rpc_errors
    def Restore(self, request, context):
        step = request.step if request.HasField("step") else None
        restored = self._tiers.restore(request.job, request.rank, step,
                                       tuple(request.replica_group), request.alone)
        found = restored.found
        self._metrics.restores.labels(restored.source).inc()
        return pb.RestoreResponse(step=found.step, segment_path=found.segment_path,
                                  slots=slots(found.slots), checksums=found.checksums,
                                  tensors=tensor_specs(found.layout), source=restored.source,
                                  source_detail=restored.detail)

    @rpc_errors
    def Status(self, request, context):
        memory = self._store.memory()
        return pb.StatusResponse(
            jobs=[self._job_status(job) for job in self._store.jobs(request.job)],
            memory=pb.MemoryStatus(budget_bytes=memory.budget_bytes,
                                   used_bytes=memory.used_bytes,
                                   pooled_bytes=memory.pooled_bytes,
                                   shm_dir=memory.shm_dir,
                                   shm_free_bytes=memory.shm_free_bytes,
                                   log_bytes=self._logs.bytes_held()))

    @rpc_errors
    def ListSnapshots(self, request, context):
        return pb.ListSnapshotsResponse(snapshots=[
            pb.SnapshotSummary(
                job=job.job, step=step.step, committed=step.committed,
                local_ranks=[r.rank for r in step.ranks if r.state is CopyState.LOCAL],
                nbytes=sum(r.nbytes for r in step.ranks))
            for job in self._store.jobs(request.job) for step in job.steps])

    @rpc_errors
    def DeleteSnapshots(self, request, context):
        deleted = self._store.delete(request.job, tuple(request.steps))
        if not request.steps:
            self._plans.forget(request.job)
            self._logs.forget(request.job)
        return pb.DeleteSnapshotsResponse(deleted_steps=deleted)

    @rpc_errors
    def AppendLog(self, request, context):
        last, copies = self._tiers.append_log(request.job, request.rank,
                                              [(r.step, r.payload) for r in request.records],
                                              request.stream)
        return pb.AppendLogResponse(last_step=last, copies=copies)

    @rpc_errors
    def AppendLogs(self, request, context):
        answers = self._tiers.append_logs(
            (log.job, log.rank, [(r.step, r.payload) for r in log.records], log.stream)
            for log in request.logs)
        return pb.AppendLogsResponse(logs=[pb.AppendLogResponse(last_step=last, copies=copies)
                                           for last, copies in answers])

    @rpc_errors
    def ReadLog(self, request, context):
        records, source = self._tiers.read_log(
            request.job, request.rank, request.after_step, request.stream,
            request.until_step if request.HasField("until_step") else None)
        return pb.ReadLogResponse(records=[pb.LogRecord(step=s, payload=p) for s, p in records],
                                  source=source)

    def Bubbles(self, events, context):
        for event in events:
            try:
                answer = self._bubble(event)
            except errors.DaemonError as err:
                self._metrics.rpcs.labels("Bubbles", _CODES[type(err)].name).inc()
                context.abort(_CODES[type(err)], str(err))
            except Exception as err:  # a bug: say so, keep the daemon and its snapshots
                log.exception("Bubbles failed on %s", event)
                context.abort(grpc.StatusCode.INTERNAL, f"daemon error: {err!r}")
            if answer is not None:
                yield answer

    def _bubble(self, event):
        self._store.slot_bytes(event.job, event.rank)  # the rank must be registered
        if event.kind == pb.BubbleEvent.START:
            found = self._plans.answer_start(event.job, event.rank, event.plan_version,
                                             event.iteration)
            if found is None:
                return None
            return pb.FetchPlan(interval=found.interval, plan_version=found.version,
                                first_step=found.first_step, assignments=[
                pb.Assignment(offset=offset, position=position, commit=(offset, position)
                              == found.commit_at,
                              chunks=[pb.Chunk(tensor=t, shard=s, start=a, stop=b)
                                      for t, s, a, b in chunks])
                for (offset, position), chunks in sorted(found.chunks.items())])
        if event.kind == pb.BubbleEvent.END:
            self._plans.record_end(event.job, event.rank, event.iteration, event.position,
                                   event.measured_seconds, event.iteration_seconds)
            self._plans.record_bandwidth(event.job, event.rank, event.copied_bytes,
                                         event.copy_seconds)
            return None
        if event.kind == pb.BubbleEvent.REPORT:
            for r in event.reports:
                self._plans.record_end(event.job, event.rank, event.iteration, r.position,
                                       r.measured_seconds, event.iteration_seconds)
            self._plans.record_bandwidth(event.job, event.rank, event.copied_bytes,
                                         event.copy_seconds)
            return None
        raise errors.InvalidArgument("bubble event without a kind: send START, END or REPORT")

    def _job_status(self, job):
        plan, profiles, version = self._plans.plan_of(job.job)
        copies = self._tiers.copies(job.job)
        durable = self._tiers.durable_steps(job.job)
        return pb.JobStatus(
            job=job.job, world_size=job.world_size, registered_ranks=job.registered_ranks,
            latest_committed_step=job.latest_committed_step,
            steps=[pb.StepStatus(step=s.step, committed=s.committed, ranks=[
                pb.RankStepStatus(rank=r.rank, state=_STATES[r.state], nbytes=r.nbytes, shards=[
                    pb.ShardStatus(tensor=sh.tensor, shard=sh.shard, nbytes=sh.nbytes,
                                   checksum=sh.checksum) for sh in r.shards],
                    usage=pb.BubbleUsage(**dataclasses.asdict(r.usage)), replica=r.replica,
                    copies=copies.get((r.rank, s.step), 0), durable=s.step in durable,
                    held_for=r.held_for)
                for r in s.ranks]) for s in job.steps],
            plan=_plan_status(plan, profiles, version), replicas=self._tiers.replicas,
            durable_steps=durable, corrupt_copies=[
                pb.CorruptCopy(rank=c.rank, step=c.step, source=c.source, detail=c.detail,
                               unix_time=c.unix_time)
                for c in self._tiers.corrupt_copies(job.job)])


def _plan_status(plan, profiles, version):
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
