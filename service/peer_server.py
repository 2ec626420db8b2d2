"""The gRPC face daemons show each other: translate, delegate, map errors."""

import logging

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import data_channel, errors
from bubblesnap.service import layout as layout_lib
from bubblesnap.service.layout_messages import tensor_specs
from bubblesnap.service.server import rpc_errors

log = logging.getLogger("bubblesnap.daemon")


class PeerServicer:
    """Implements ``bubblesnap.v1.Peer`` over the store, the group and the data channel."""

    def __init__(self, store, logs, group, data_server, metrics, tiers):
        self._store = store
        self._logs = logs
        self._group = group
        self._data = data_server
        self._metrics = metrics
        self._tiers = tiers

    @rpc_errors
    def Join(self, request, context):
        if not 0 <= request.index < self._group.size or request.index == self._group.index:
            raise errors.InvalidArgument(
                f"ring index {request.index} is not another member of this {self._group.size}-"
                "daemon group; check --index and --peers")
        self._group.set_address(request.index, request.address)
        return ppb.JoinResponse()

    @rpc_errors
    def Holdings(self, request, context):
        return ppb.HoldingsResponse(index=self._group.index, copies=[
            ppb.HeldCopy(job=h.job, rank=h.rank, step=h.step,
                         role=ppb.REPLICA if h.replica else ppb.PRIMARY,
                         world_size=h.world_size, replica_group=h.group)
            for h in self._store.holdings(request.job)])

    @rpc_errors
    def Replicate(self, request, context):
        data_channel.check_address(request.data_address)
        layout = layout_lib.build_layout(request.tensors)
        options = self._group.options
        fill = data_channel.puller(request.data_address, request.ticket,
                                   options.security.client_ssl_context(),
                                   options.transfer_timeout_seconds,
                                   f"step {request.step} of rank {request.rank}")
        self._store.install(request.job, request.world_size, request.rank, request.step, layout,
                            tuple(request.checksums), fill,
                            replica_group=tuple(request.replica_group))
        return ppb.ReplicateResponse()

    @rpc_errors
    def OpenRead(self, request, context):
        layout_lib.check_step(request.step)
        pinned = self._store.pin(request.job, request.rank, request.step)
        ticket = self._data.offer(pinned.segment.path, pinned.segment.nbytes,
                                  lambda: self._store.unpin(pinned))
        return ppb.OpenReadResponse(ticket=ticket, data_address=self._data.address,
                                    segment_bytes=pinned.segment.nbytes,
                                    checksums=pinned.checksums,
                                    tensors=tensor_specs(pinned.layout),
                                    world_size=pinned.world_size)

    @rpc_errors
    def Rollback(self, request, context):
        layout_lib.check_step(request.step)
        return ppb.RollbackResponse(dropped_copies=self._tiers.roll_back_here(request.job,
                                                                              request.step))

    @rpc_errors
    def AppendLogReplica(self, request, context):
        self._logs.append(request.job, request.rank,
                          [(r.step, r.payload) for r in request.records])
        return ppb.LogReplicaResponse()

    @rpc_errors
    def ReadLogReplica(self, request, context):
        return pb.ReadLogResponse(records=[
            pb.LogRecord(step=step, payload=payload)
            for step, payload in self._logs.held_after(
                request.job, request.rank, request.after_step,
                until_step=request.until_step if request.HasField("until_step") else None)])
