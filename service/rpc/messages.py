"""Wire messages <-> the daemon's values, and validation of what enters from the wire.

Requests are checked here, once, as they enter (names, ranks, steps,
layouts, replica groups); the parts below trust what they are handed.
Answers are built here from the parts' plain values.
"""

import math

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import checks
from bubblesnap.service.bubbles.plans import BubbleEvent, check_seconds
from bubblesnap.service.durable import persist as persist_lib
from bubblesnap.service.errors import InvalidArgument
from bubblesnap.service.peers import data_channel
from bubblesnap.service.peers.addresses import check_address
from bubblesnap.service.restore.region_plan import AnswerForm, Asked
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store.model import BubbleUsage, CopyState

#: Steps one DeleteSnapshots names, records one log append carries, logs one
#: AppendLogs carries: far more than a client sends, bounded so that one request
#: cannot hold the daemon's attention for long.
MAX_STEPS_NAMED = 1 << 16
MAX_RECORDS = 1 << 16
MAX_LOGS = 1 << 14


# -- what enters -----------------------------------------------------------------------------

def job(name: str, optional: bool = False) -> str:
    """A job name as the parts may use it (empty allowed when ``optional``: all jobs)."""
    if name or not optional:
        checks.check_job_name(name)
    return name


def job_rank(request) -> tuple[str, int]:
    checks.check_job_name(request.job)
    checks.check_rank(request.rank)
    return request.job, request.rank


def job_rank_step(request) -> tuple[str, int, int]:
    checks.check_step(request.step)
    return (*job_rank(request), request.step)


def world(world_size: int) -> int:
    """A caller's world size: 0 (not said) or a valid number of ranks."""
    if world_size:
        checks.check_world(0, world_size)
    return world_size


def optional_step(request, field: str = "step") -> int | None:
    if not request.HasField(field):
        return None
    step = getattr(request, field)
    checks.check_step(step)
    return step


def registration(request) -> tuple:
    """(job, rank, world size, layout, replica group) of a RegisterRequest."""
    checks.check_job_name(request.job)
    checks.check_world(request.rank, request.world_size)
    layout = layout_lib.build_layout(request.tensors)
    group = checks.check_replica_group(request.rank, request.world_size,
                                           request.replica_group)
    return request.job, request.rank, request.world_size, layout, group


def commit(request) -> tuple:
    """(job, rank, step, checksums, usage, next step, staged as) of a CommitStepRequest."""
    checks.check_count("checksums", len(request.checksums), checks.MAX_SLOTS)
    return (*job_rank_step(request), tuple(request.checksums), usage(request.usage),
            optional_step(request, "next_step"), optional_step(request, "staged_as"))


def persist(request) -> tuple[str, int, int, str, str]:
    """(job, rank, step, folder, record) of a PersistRequest (the folder's place in the
    durable tier is the writer's to check: durable/persist.py; the record's, the save
    finisher's)."""
    record = persist_lib.check_path(request.record) if request.record else ""
    return (*job_rank_step(request), persist_lib.check_path(request.directory), record)


def finish_save(request) -> tuple[str, bool]:
    """(record, drop) of a FinishSaveRequest."""
    return persist_lib.check_path(request.record), request.drop


def drop_after(request) -> tuple[str, int]:
    """(job, step) of a DropAfterRequest (-1: every step)."""
    if request.step != -1:
        checks.check_step(request.step)
    return job(request.job), request.step


def restore(request) -> tuple:
    """(job, rank, step, replica group, alone, world size, regions) of a RestoreRequest
    (the replica group is checked against the job's world size where it is known)."""
    checks.check_count("ranks in replica_group", len(request.replica_group), checks.MAX_RANKS)
    return (*job_rank(request), optional_step(request), tuple(request.replica_group),
            request.alone, world(request.world_size), asked_regions(request))


def answer_form(request, several_segments: bool) -> AnswerForm:
    """How the caller of a RestoreRequest reads the answer (``several_segments``: it
    called RestoreStream)."""
    return AnswerForm(several_segments=several_segments,
                      checksums=not request.skip_answer_checksums)


def asked_regions(request) -> list[Asked]:
    """The tensors and regions a RestoreRequest asks for (none: the rank's own copy)."""
    checks.check_count("tensors", len(request.tensors), checks.MAX_TENSORS)
    checks.check_count("regions", sum(len(t.regions) for t in request.tensors), checks.MAX_SLOTS)
    asked = []
    for tensor in request.tensors:
        checks.check_tensor_name(tensor.name)
        checks.check_dtype(tensor.name, tensor.dtype)
        shape = checks.check_shape(tensor.name, tensor.dtype, tensor.global_shape)
        if len(tensor.regions) > checks.MAX_SHARDS:
            raise InvalidArgument(f"{len(tensor.regions)} regions of {tensor.name!r} asked; "
                                  f"at most {checks.MAX_SHARDS}")
        boxes = tuple(checks.check_box(tensor.name, shape,
                                           tuple((s.start, s.stop) for s in region.index))
                      for region in tensor.regions)
        asked.append(Asked(tensor.name, tensor.dtype, shape, boxes))
    return asked


def wait_committed(request) -> tuple[str, int, float]:
    """(job, step, timeout) of a WaitCommittedRequest."""
    checks.check_step(request.step)
    return job(request.job), request.step, seconds(request.timeout_seconds)


def deleted(request) -> tuple[str, tuple[int, ...]]:
    """(job, steps) of a DeleteSnapshotsRequest."""
    checks.check_count("steps", len(request.steps), MAX_STEPS_NAMED)
    for step in request.steps:
        checks.check_step(step)
    return job(request.job), tuple(request.steps)


def replica(request) -> tuple:
    """(job, world size, rank, step, layout, checksums, replica group) of a ReplicateRequest."""
    checks.check_job_name(request.job)
    checks.check_world(request.rank, request.world_size)
    checks.check_step(request.step)
    layout = layout_lib.build_layout(request.tensors)
    checks.check_count("checksums", len(request.checksums), checks.MAX_SLOTS)
    group = checks.check_replica_group(request.rank, request.world_size,
                                           request.replica_group)
    return (request.job, request.world_size, request.rank, request.step, layout,
            tuple(request.checksums), group)


def data_source(request) -> tuple[str, bytes]:
    """(data address, ticket) a ReplicateRequest says to pull from."""
    check_address(request.data_address, "data address")
    if len(request.ticket) != data_channel.TICKET_BYTES:
        raise InvalidArgument(f"a ticket of {len(request.ticket)} bytes; tickets have "
                              f"{data_channel.TICKET_BYTES}")
    return request.data_address, request.ticket


def joined(request) -> tuple[int, str]:
    """(ring index, peer address) of a JoinRequest (the index is checked by the group)."""
    check_address(request.address, f"the peer address of ring index {request.index}")
    return request.index, request.address


def slots_asked(request) -> tuple[int, ...]:
    checks.check_count("slots", len(request.slots), checks.MAX_SLOTS)
    return tuple(request.slots)


def rollback(request) -> tuple[str, int, int, bool]:
    """(job, world size, step, resume) of a RollbackRequest (step -1: every copy is
    dropped; never a resume)."""
    if request.step != -1:
        checks.check_step(request.step)
    return job(request.job), world(request.world_size), request.step, \
        request.resume and request.step != -1


def resume_step(request) -> tuple[str, int, int]:
    """(job, world size, rank) of a ResumeStepRequest."""
    world_size = world(request.world_size)
    checks.check_rank(request.rank, world_size or None)
    return job(request.job), world_size, request.rank


def seconds(value: float) -> float:
    """A duration from the wire: finite and not negative."""
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"a duration of {value!r} seconds: send a finite number >= 0")
    return value


def usage(u: pb.BubbleUsage) -> BubbleUsage:
    """How a copy used its bubbles, as the client measured it: bounded numbers."""
    for name in ("offered_seconds", "used_seconds", "spilled_seconds", "overrun_seconds"):
        check_seconds(f"usage.{name}", getattr(u, name))
    for name, most in (("spilled_bytes", checks.MAX_BYTES), ("bubbles", 1 << 31),
                       ("iterations", 1 << 31)):
        if not 0 <= getattr(u, name) < most:
            raise InvalidArgument(f"usage.{name} of {getattr(u, name)}: send 0 or more")
    return BubbleUsage(u.offered_seconds, u.used_seconds, u.spilled_seconds, u.spilled_bytes,
                       u.bubbles, u.iterations, u.overrun_seconds)


def log_records(request) -> tuple[str, int, list[tuple[int, bytes]], str]:
    """(job, rank, records, stream) of an AppendLogRequest."""
    return (*job_rank(request), records(request), request.stream)


def logs(request) -> list[tuple[str, int, list[tuple[int, bytes]], str]]:
    """Every log of an AppendLogsRequest, as :func:`log_records` gives one."""
    checks.check_count("logs", len(request.logs), MAX_LOGS)
    checks.check_count("records", sum(len(log.records) for log in request.logs), MAX_RECORDS)
    return [log_records(log) for log in request.logs]


def records(request) -> list[tuple[int, bytes]]:
    """The records of an append (their steps and sizes are the logs' to check)."""
    checks.check_count("records", len(request.records), MAX_RECORDS)
    return [(r.step, r.payload) for r in request.records]


def log_read(request) -> tuple[str, int, int, int | None]:
    """(job, rank, after step, until step) of a ReadLogRequest (the logs check the
    stream name)."""
    after, until = request.after_step, optional_step(request, "until_step")
    if not -1 <= after < checks.MAX_STEP:
        raise InvalidArgument(f"after_step {after}: send -1 (the log from step 0 on) to "
                              f"{checks.MAX_STEP - 1}")
    if until is not None and until <= after:
        raise InvalidArgument(f"until_step {until} must come after after_step {after}: the "
                              "read is of steps after_step+1..until_step")
    return (*job_rank(request), after, until)


def bubble_event(event: pb.BubbleEvent) -> BubbleEvent:
    """An END is a report of the one bubble that ended."""
    job_rank(event)
    common = dict(job=event.job, rank=event.rank, iteration=event.iteration)
    if event.kind == pb.BubbleEvent.START:
        return BubbleEvent(start=True, plan_version=event.plan_version, position=event.position,
                           expected_seconds=event.expected_seconds, **common)
    if event.kind == pb.BubbleEvent.END:
        reports = ((event.position, event.measured_seconds),)
        common.update(end=True, position=event.position)
    elif event.kind == pb.BubbleEvent.REPORT:
        reports = tuple((r.position, r.measured_seconds) for r in event.reports)
    else:
        raise InvalidArgument("bubble event without a kind: send START, END or REPORT")
    return BubbleEvent(reports=reports, iteration_seconds=event.iteration_seconds,
                       copied_bytes=event.copied_bytes, copy_seconds=event.copy_seconds,
                       **common)


# -- what goes out ---------------------------------------------------------------------------

def tensor_specs(layout) -> list[pb.TensorSpec]:
    """A validated layout as the wire describes it (daemon and peer protos share it)."""
    return [pb.TensorSpec(
        name=t.name, dtype=t.dtype, global_shape=t.global_shape, job_wide=t.job_wide,
        shards=[pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in s.index],
                             nbytes=s.nbytes) for s in t.shards])
        for t in layout.tensors]


def slots(slot_tuples) -> list[pb.Slot]:
    return [pb.Slot(tensor=t, shard=s, offset=o, nbytes=n) for t, s, o, n in slot_tuples]


def staging(found) -> pb.BeginStepResponse:
    return pb.BeginStepResponse(segment_path=found.segment_path,
                                segment_bytes=found.segment_bytes, slots=slots(found.slots))


def restored(answer) -> pb.RestoreResponse:
    found = answer.found
    answered = slots(found.slots)
    if found.slot_segments:  # else every slot is in segment_path (Slot.segment 0)
        for slot, segment in zip(answered, found.slot_segments, strict=True):
            slot.segment = segment
    return pb.RestoreResponse(step=found.step, segment_path=found.segment_path,
                              other_segments=found.other_segments,
                              slots=answered, checksums=found.checksums,
                              tensors=tensor_specs(found.layout), source=answer.source,
                              source_detail=answer.detail, world_size=found.world_size,
                              phases=[pb.Phase(name=n, seconds=t) for n, t in answer.phases])


def open_read(copy, ticket: bytes, data_address: str) -> ppb.OpenReadResponse:
    """A held copy as a peer sees it (OpenRead with a ticket, Describe without)."""
    return ppb.OpenReadResponse(ticket=ticket, data_address=data_address,
                                segment_bytes=copy.segment.nbytes, checksums=copy.checksums,
                                tensors=tensor_specs(copy.layout), world_size=copy.world_size,
                                slots=slots(copy.slots))


def fetch_plan(found) -> pb.FetchPlan:
    return pb.FetchPlan(interval=found.interval, plan_version=found.version,
                        first_step=found.first_step, assignments=[
        pb.Assignment(offset=offset, position=position,
                      commit=(offset, position) == found.commit_at,
                      chunks=[pb.Chunk(tensor=t, shard=s, start=a, stop=b)
                              for t, s, a, b in chunks])
        for (offset, position), chunks in sorted(found.chunks.items())])


def snapshot_summaries(jobs) -> list[pb.SnapshotSummary]:
    return [pb.SnapshotSummary(
        job=view.job, step=step.step, committed=step.committed,
        local_ranks=[r.rank for r in step.ranks if r.state is CopyState.LOCAL],
        nbytes=sum(r.nbytes for r in step.ranks))
        for view in jobs for step in view.steps]
