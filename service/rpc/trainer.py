"""The gRPC face trainers and tools see (``bubblesnap.v1.Daemon``): convert, call, convert back."""

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service import answer_segment
from bubblesnap.service.errors import DeadlineExceeded, FailedPrecondition, shown
from bubblesnap.service.rpc import messages, status_messages
from bubblesnap.service.rpc.status_codes import late, streaming, unary

#: The pools (lanes) of the calls that do not run in "calls": those that may wait long (a
#: restore pulling from a peer or the durable tier, a wait for the job's commit) so that
#: they never hold up stagings and commits, and Status so that it answers under any load.
LANES = {"Restore": "waits", "RestoreStream": "waits", "WaitCommitted": "waits",
         "FinishSave": "waits", "Status": "status"}


_SAVE_STATES = {"watching": pb.FinishSaveResponse.WATCHING,
                "finalized": pb.FinishSaveResponse.FINALIZED,
                "dropped": pb.FinishSaveResponse.DROPPED,
                "alive": pb.FinishSaveResponse.TRAINER_ALIVE}


def _release_if_late(context, release) -> None:
    """A reservation answered after the caller's deadline is released (``release()``) at
    once: the caller gave up on it, and its staging memory would stay held until the
    rank's next BeginStep."""
    if late(context):
        release()
        raise DeadlineExceeded("the caller's deadline passed while its staging was reserved; "
                               "the reservation was released")


class DaemonServicer:
    """Each method converts its request, calls one method of a part, converts the answer.

    ``token`` (``trainer_token.TrainerToken``) guards the calls that drop snapshots;
    ``durable``: the durable tier's writer (None: the daemon has none).
    """

    def __init__(self, store, layouts, plans, restorer, logs, status, metrics, token,
                 heartbeat_path: str = "", durable=None):
        self._token = token
        self._durable = durable
        self._heartbeat_path = heartbeat_path
        self._store = store
        self._layouts = layouts  # peers.layouts.GroupLayouts
        self._plans = plans
        self._restorer = restorer
        self._logs = logs  # peers.log_replication.LogReplication
        self._status = status
        self.metrics = metrics

    @unary
    def Register(self, request, context):
        reg = self._layouts.register(*messages.registration(request))
        return pb.RegisterResponse(reattached=reg.reattached,
                                   latest_local_step=reg.latest_local_step,
                                   step_bytes=reg.step_bytes,
                                   heartbeat_path=self._heartbeat_path)

    @unary
    def BeginStep(self, request, context):
        job, rank, step = messages.job_rank_step(request)
        with self.metrics.timed("stage"):
            staging = self._store.begin_step(job, rank, step)
        _release_if_late(context, lambda: self._store.abort_step(job, rank, step))
        self.metrics.staged(job, rank, step)
        return messages.staging(staging)

    @unary(run_late=True)
    def CommitStep(self, request, context):
        job, rank, step, checksums, usage, next_step, staged_as = messages.commit(request)
        self.metrics.fetched(job, rank, step if staged_as is None else staged_as)
        with self.metrics.timed("commit"):
            commit = self._store.commit_step(job, rank, step, checksums, usage, next_step,
                                             staged_as)
        if commit.newly_local:  # a repeated commit reported its bubbles already
            self.metrics.bubbles(usage)
        if commit.next:  # the commit stands; only the next step's staging goes
            _release_if_late(context, lambda: self._store.abort_step(job, rank, next_step))
            self.metrics.staged(job, rank, next_step)
        return pb.CommitStepResponse(
            job_committed=commit.job_committed, latest_committed_step=commit.latest_committed_step,
            next=messages.staging(commit.next) if commit.next else None)

    @unary(run_late=True)
    def AbortStep(self, request, context):
        self._store.abort_step(*messages.job_rank_step(request))
        return pb.AbortStepResponse()

    @unary
    def Restore(self, request, context):
        return self._restore(request, context, several_segments=False)

    @unary
    def RestoreStream(self, request, context):
        def early(path: str, nbytes: int) -> None:
            context.send(pb.RestoreUpdate(segment=pb.AnswerSegment(path=path, nbytes=nbytes)))

        with answer_segment.listening(early):
            return pb.RestoreUpdate(restored=self._restore(request, context,
                                                           several_segments=True))

    def _restore(self, request, context, several_segments: bool) -> pb.RestoreResponse:
        if not request.alone:
            self._token.check(context, "Restore (not alone: it drops every later step of the "
                              "job, on every daemon of the ring)")
        with self.metrics.timed("restore"):
            restored = self._restorer.restore(
                *messages.restore(request),
                answer=messages.answer_form(request, several_segments))
        self.metrics.restores.labels(restored.source).inc()
        return messages.restored(restored)

    @unary
    def Persist(self, request, context):
        job, rank, step, folder, record = messages.persist(request)
        self._durable_tier(folder).persist(job, rank, step, folder, record)
        return pb.PersistResponse()

    @unary
    def FinishSave(self, request, context):
        record, drop = messages.finish_save(request)
        if drop:  # a finalize of it (and the work it holds) is given up
            self._token.check(context, "FinishSave with drop")
        state, why = self._durable_tier(record).saves_in_flight.finish(record, drop)
        return pb.FinishSaveResponse(state=_SAVE_STATES[state], detail=why)

    def _durable_tier(self, folder: str):
        if self._durable is None:
            raise FailedPrecondition(f"this daemon has no durable tier, so it cannot write "
                                     f"{shown(folder, 400)}: start it with --durable-dir at "
                                     "or above that folder")
        return self._durable

    @unary
    def DropAfter(self, request, context):
        self._token.check(context, "DropAfter")
        return pb.DropAfterResponse(dropped_copies=self._restorer.rollbacks.everywhere(
            *messages.drop_after(request)))

    @unary
    def WaitCommitted(self, request, context):
        committed, latest = self._status.wait_committed(*messages.wait_committed(request))
        return pb.WaitCommittedResponse(committed=committed, latest_committed_step=latest)

    @unary
    def Status(self, request, context):
        return status_messages.daemon_status(
            self._status.status(messages.job(request.job, optional=True)))

    @unary
    def ListSnapshots(self, request, context):
        return pb.ListSnapshotsResponse(snapshots=messages.snapshot_summaries(
            self._store.jobs(messages.job(request.job, optional=True))))

    @unary
    def DeleteSnapshots(self, request, context):
        self._token.check(context, "DeleteSnapshots")
        return pb.DeleteSnapshotsResponse(deleted_steps=self._store.delete(
            *messages.deleted(request)))

    @unary(run_late=True)
    def AppendLog(self, request, context):
        [(last, copies)] = self._logs.append([messages.log_records(request)])
        return pb.AppendLogResponse(last_step=last, copies=copies)

    @unary(run_late=True)
    def AppendLogs(self, request, context):
        answers = self._logs.append(messages.logs(request))
        return pb.AppendLogsResponse(logs=[pb.AppendLogResponse(last_step=last, copies=copies)
                                           for last, copies in answers])

    @unary
    def ReadLog(self, request, context):
        job, rank, after, until = messages.log_read(request)
        records, source = self._logs.read(job, rank, after, request.stream, until)
        return pb.ReadLogResponse(records=[pb.LogRecord(step=s, payload=p) for s, p in records],
                                  source=source)

    @streaming
    def Bubbles(self, event, context):
        found = self._plans.handle(messages.bubble_event(event))
        return messages.fetch_plan(found) if found is not None else None
