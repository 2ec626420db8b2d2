"""The gRPC face daemons show each other (``bubblesnap.v1.Peer``): convert, call, convert back."""

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.rpc import messages
from bubblesnap.service.rpc.status_codes import unary


class PeerServicer:
    """Implements ``bubblesnap.v1.Peer`` over the store, the group, transfers and the logs."""

    def __init__(self, store, logs, group, transfers, restorer, metrics):
        self._store = store
        self._logs = logs  # logs.TrainingLogs: replicas of training logs are this daemon's
        self._group = group
        self._transfers = transfers
        self._restorer = restorer
        self.metrics = metrics

    @unary
    def Join(self, request, context):
        self._group.join(*messages.joined(request))
        return ppb.JoinResponse()

    @unary
    def Holdings(self, request, context):
        job = messages.job(request.job, optional=True)
        return ppb.HoldingsResponse(index=self._group.index, copies=[
            ppb.HeldCopy(job=h.job, rank=h.rank, step=h.step,
                         role=ppb.REPLICA if h.replica else ppb.PRIMARY,
                         world_size=h.world_size, replica_group=h.group)
            for h in self._store.holdings(job)], committed=[
            ppb.JobSteps(job=name, steps=self._store.committed(name))
            for name in ([job] if job else self._store.job_names())])

    @unary
    def Replicate(self, request, context):
        self._transfers.pull(*messages.data_source(request), *messages.replica(request))
        return ppb.ReplicateResponse()

    @unary
    def OpenRead(self, request, context):
        pinned, ticket = self._transfers.offer(*messages.job_rank_step(request),
                                               messages.slots_asked(request))
        return messages.open_read(pinned, ticket, self._transfers.data_address)

    @unary
    def Describe(self, request, context):
        copy = self._store.describe(*messages.job_rank_step(request))
        return messages.open_read(copy, b"", self._transfers.data_address)

    @unary
    def Layouts(self, request, context):
        return ppb.LayoutsResponse(ranks=[
            ppb.RankLayout(rank=r.rank, world_size=r.world_size,
                           tensors=messages.tensor_specs(r.layout), replica_group=r.group)
            for r in self._store.layouts(messages.job(request.job))])

    @unary
    def Rollback(self, request, context):
        job, world, step, resume = messages.rollback(request)
        self._store.resume(job, world, step)
        return ppb.RollbackResponse(dropped_copies=self._restorer.rollbacks.here(
            job, step, resume))

    @unary
    def ResumeStep(self, request, context):
        return ppb.ResumeStepResponse(step=self._restorer.resumes.decide(
            *messages.resume_step(request)))

    @unary
    def AppendLogReplica(self, request, context):
        self._logs.append(*messages.job_rank(request),
                          messages.records(request))
        return ppb.LogReplicaResponse()

    @unary
    def ReadLogReplica(self, request, context):
        job, rank, after, until = messages.log_read(request)
        return pb.ReadLogResponse(records=[
            pb.LogRecord(step=step, payload=payload)
            for step, payload in self._logs.held_after(job, rank, after, until_step=until)])
