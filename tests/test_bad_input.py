"""Bad input gets a precise status code, and the daemon keeps running and keeps its snapshots."""

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from tests.helpers import register, tensor_spec

C = grpc.StatusCode
HELD = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}


@pytest.fixture
def held(start_daemon):
    """A daemon (1 MiB message limit) that already holds a committed snapshot."""
    daemon = start_daemon("--max-message", "1MiB")
    client = NumpyClient("held", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(5, HELD).committed
    yield daemon
    # Whatever the test sent, the daemon is alive and still serves the snapshot intact.
    assert daemon.alive()
    step, restored = client.restore()
    assert step == 5 and restored["w"].tobytes() == HELD["w"].tobytes()
    client.close()


def _code(call, request):
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("request_, code, words", [
    (pb.StatusRequest(job="nope"), C.NOT_FOUND, "no job 'nope'"),
    (pb.StatusRequest(job="../etc"), C.INVALID_ARGUMENT, "not allowed"),
    (pb.StatusRequest(job="a\x00b"), C.INVALID_ARGUMENT, "not allowed"),
])
def test_status_of_bad_job(held, request_, code, words):
    got, details = _code(held.stub.Status, request_)
    assert got == code and words in details


@pytest.mark.parametrize("tensors, words", [
    ([tensor_spec("w", (4, 4), nbytes=63)], "declares 63 bytes"),
    ([tensor_spec("w", (4, 4), dtype="float31")], "unknown dtype"),
    ([tensor_spec("../../etc/passwd", (2,))], "'..' component"),
    ([tensor_spec("w\x00x", (2,))], "NUL"),
    ([tensor_spec("w", (2,)), tensor_spec("w", (2,))], "appears twice"),
    ([pb.TensorSpec(name="w", dtype="float32", global_shape=[4], shards=[
        pb.ShardSpec(index=[pb.Slice(start=2, stop=6)], nbytes=16)])], "covers [2, 6)"),
    ([pb.TensorSpec(name="w", dtype="float32", global_shape=[4, 4], shards=[
        pb.ShardSpec(index=[pb.Slice(start=0, stop=4)], nbytes=16)])], "index dimensions"),
    ([], "no tensors"),
])
def test_register_bad_layout(held, tensors, words):
    got, details = _code(held.stub.Register, pb.RegisterRequest(
        job="bad", rank=0, world_size=1, tensors=tensors))
    assert got == C.INVALID_ARGUMENT and words in details, details


def test_register_bad_job_and_rank(held):
    for job in ("../x", "a/b", "", "x" * 200, "job\x00"):
        got, _ = _code(held.stub.Register, pb.RegisterRequest(
            job=job, rank=0, world_size=1, tensors=[tensor_spec("w", (2,))]))
        assert got == C.INVALID_ARGUMENT, job
    got, details = _code(held.stub.Register, pb.RegisterRequest(
        job="ok", rank=3, world_size=2, tensors=[tensor_spec("w", (2,))]))
    assert got == C.INVALID_ARGUMENT and "outside world_size" in details


def test_second_registration_of_a_rank(held):
    first = register(held.stub, job="twice")
    assert not first.reattached
    again = register(held.stub, job="twice")
    assert again.reattached  # a restarted trainer with the same layout
    got, details = _code(held.stub.Register, pb.RegisterRequest(
        job="twice", rank=0, world_size=1, tensors=[tensor_spec("w", (4, 5))]))
    assert got == C.ALREADY_EXISTS and "different state layout" in details
    got, details = _code(held.stub.Register, pb.RegisterRequest(
        job="twice", rank=1, world_size=2, tensors=[tensor_spec("w", (4, 4))]))
    assert got == C.FAILED_PRECONDITION and "world_size 1" in details


def test_steps_of_unknown_jobs_and_ranks(held):
    assert _code(held.stub.BeginStep, pb.BeginStepRequest(job="ghost", rank=0, step=1))[0] == \
        C.NOT_FOUND
    assert _code(held.stub.BeginStep, pb.BeginStepRequest(job="held", rank=7, step=1))[0] == \
        C.NOT_FOUND
    assert _code(held.stub.BeginStep, pb.BeginStepRequest(job="held", rank=0, step=-1))[0] == \
        C.INVALID_ARGUMENT
    assert _code(held.stub.CommitStep, pb.CommitStepRequest(job="held", rank=0, step=99))[0] == \
        C.NOT_FOUND
    assert _code(held.stub.Restore, pb.RestoreRequest(job="ghost", rank=0))[0] == C.NOT_FOUND
    assert _code(held.stub.Restore, pb.RestoreRequest(job="held", rank=0, step=4))[0] == \
        C.NOT_FOUND
    assert _code(held.stub.DeleteSnapshots, pb.DeleteSnapshotsRequest(job="held", steps=[1]))[0] \
        == C.NOT_FOUND
    assert _code(held.stub.BeginStep, pb.BeginStepRequest(job="held", rank=0, step=5))[0] == \
        C.FAILED_PRECONDITION  # already committed


def test_commit_with_wrong_checksums(held):
    register(held.stub, job="sums", tensors=[tensor_spec("a", (4,)), tensor_spec("b", (4,))])
    held.stub.BeginStep(pb.BeginStepRequest(job="sums", rank=0, step=1), timeout=10)
    got, details = _code(held.stub.CommitStep, pb.CommitStepRequest(
        job="sums", rank=0, step=1, checksums=[1]))
    assert got == C.INVALID_ARGUMENT and "2 shards" in details
    # Client checksums are trusted at commit, and checked before the copy is served.
    held.stub.CommitStep(pb.CommitStepRequest(job="sums", rank=0, step=1, checksums=[1, 2]),
                         timeout=10)
    got, details = _code(held.stub.Restore, pb.RestoreRequest(job="sums", rank=0))
    assert got == C.DATA_LOSS and "failed its checksum on 'a' shard 0, 'b' shard 0" in details
    assert _code(held.stub.Restore, pb.RestoreRequest(job="sums", rank=0))[0] == C.NOT_FOUND


def test_verify_on_commit_rejects_wrong_checksums(start_daemon):
    daemon = start_daemon("--verify-on-commit")
    register(daemon.stub, job="sums", tensors=[tensor_spec("a", (4,)), tensor_spec("b", (4,))])
    daemon.stub.BeginStep(pb.BeginStepRequest(job="sums", rank=0, step=1), timeout=10)
    got, details = _code(daemon.stub.CommitStep, pb.CommitStepRequest(
        job="sums", rank=0, step=1, checksums=[1, 2]))
    assert got == C.DATA_LOSS and "'a' shard 0" in details
    # The mismatching copy was dropped, not committed.
    got, details = _code(daemon.stub.Restore, pb.RestoreRequest(job="sums", rank=0))
    assert got == C.NOT_FOUND and "no committed step" in details


def test_restore_of_uncommitted_step(held):
    register(held.stub, job="pair", world_size=2)
    register(held.stub, job="pair", rank=1, world_size=2)
    held.stub.BeginStep(pb.BeginStepRequest(job="pair", rank=0, step=3), timeout=10)
    held.stub.CommitStep(pb.CommitStepRequest(job="pair", rank=0, step=3), timeout=10)
    got, details = _code(held.stub.Restore, pb.RestoreRequest(job="pair", rank=0, step=3))
    assert got == C.FAILED_PRECONDITION and "ranks [1] have not finished it" in details
    got, details = _code(held.stub.Restore, pb.RestoreRequest(job="pair", rank=0))
    assert got == C.NOT_FOUND and "no committed step" in details


def test_oversize_message(held):
    huge = [tensor_spec(f"t{i:06d}" + "x" * 900, (1,)) for i in range(2000)]  # ~2 MB > 1 MiB
    got, _ = _code(held.stub.Register, pb.RegisterRequest(job="huge", rank=0, world_size=1,
                                                          tensors=huge))
    assert got == C.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",                       # not protobuf at all
    b"\x0a\x10abc",                            # field 1 claims 16 bytes, has 3
    pb.RegisterRequest(job="cut", rank=0, world_size=1,
                       tensors=[tensor_spec("w", (4,))]).SerializeToString()[:-3],
])
def test_malformed_and_truncated_messages(held, payload):
    raw = held.channel.unary_unary("/bubblesnap.v1.Daemon/Register")
    with pytest.raises(grpc.RpcError) as info:
        raw(payload, timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT
    assert "malformed bubblesnap.v1.RegisterRequest" in info.value.details()


def test_bubble_stream_bad_events(held):
    def events(*kinds, job="held", measured=0.01):
        for kind in kinds:
            yield pb.BubbleEvent(job=job, rank=0, stage=0, step=6, iteration=7, kind=kind,
                                 reports=[pb.BubbleReport(position=1, measured_seconds=measured)])

    # Still profiling: a START gets no plan back, and nothing fails.
    assert list(held.stub.Bubbles(events(pb.BubbleEvent.START, pb.BubbleEvent.REPORT),
                                  timeout=10)) == []
    for bad, code in ((events(pb.BubbleEvent.KIND_UNSPECIFIED), C.INVALID_ARGUMENT),
                      (events(pb.BubbleEvent.REPORT, measured=-1.0), C.INVALID_ARGUMENT),
                      (events(pb.BubbleEvent.REPORT, measured=float("inf")), C.INVALID_ARGUMENT),
                      (events(pb.BubbleEvent.REPORT, measured=float("nan")), C.INVALID_ARGUMENT),
                      (events(pb.BubbleEvent.START, job="ghost"), C.NOT_FOUND),
                      (events(pb.BubbleEvent.START, job="../x"), C.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as info:
            list(held.stub.Bubbles(bad, timeout=10))
        assert info.value.code() == code


def test_corrupted_copy_is_never_served(held):
    register(held.stub, job="flip", tensors=[tensor_spec("w", (256,))])
    staging = held.stub.BeginStep(pb.BeginStepRequest(job="flip", rank=0, step=1), timeout=10)
    held.stub.CommitStep(pb.CommitStepRequest(job="flip", rank=0, step=1), timeout=10)
    with open(staging.segment_path, "r+b") as segment:  # a bit flips in host memory
        segment.seek(staging.slots[0].offset + 17)
        byte = segment.read(1)
        segment.seek(-1, 1)
        segment.write(bytes([byte[0] ^ 0x10]))
    got, details = _code(held.stub.Restore, pb.RestoreRequest(job="flip", rank=0))
    assert got == C.DATA_LOSS and "failed its checksum on 'w' shard 0" in details
    status = held.stub.Status(pb.StatusRequest(job="flip"), timeout=10)
    assert [s.step for s in status.jobs[0].steps] == []


def test_old_step_under_a_reused_job_name(held):
    client = NumpyClient("reuse", options=ClientOptions(daemon=held.address))
    assert client.snapshot(5, HELD).committed
    assert client.snapshot(6, HELD).committed  # steps 5 and 6 are kept
    refused = client.snapshot(0, HELD)          # a new run starting over under the same name
    assert not refused.taken and "FAILED_PRECONDITION" in refused.reason
    assert "older than every step retention keeps" in refused.reason
    client.close()


def test_replica_groups_that_do_not_add_up(held):
    def register_dp(rank, group, tensors=None):
        return pb.RegisterRequest(job="dp", rank=rank, world_size=3, replica_group=group,
                                  tensors=tensors or [tensor_spec("w", (4, 4))])

    got, details = _code(held.stub.Register, register_dp(0, [0, 5]))
    assert got == C.INVALID_ARGUMENT and "names rank 5, outside world_size 3" in details
    held.stub.Register(register_dp(0, [1]), timeout=10)  # itself added: group [0, 1]
    for bad, words in (
            (register_dp(1, [1, 2]), "group [1, 2], but rank 0 was registered with replica "
                                     "group [0, 1]"),
            (register_dp(1, []), "group [1], but rank 0 was registered"),
            (register_dp(2, [0, 2]), "group [0, 2], but rank 0 was registered"),
            (register_dp(0, [0, 2]), "group [0, 2], but it was registered with replica group"),
            (register_dp(1, [0, 1], [tensor_spec("w", (4, 5))]), "state layouts differ")):
        got, details = _code(held.stub.Register, bad)
        assert got == C.FAILED_PRECONDITION and words in details, details
    held.stub.Register(register_dp(1, [0, 1]), timeout=10)
    got, details = _code(held.stub.BeginStep, pb.BeginStepRequest(job="dp", rank=1, step=0))
    assert got == C.FAILED_PRECONDITION and "held through rank 0's copies" in details
    got, details = _code(held.stub.Restore, pb.RestoreRequest(job="dp", rank=1,
                                                              replica_group=[1, 2]))
    assert got == C.FAILED_PRECONDITION and "registered with [0, 1]" in details

    # The refusals changed nothing: the groups stand as registered and commit.
    arrays = {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}
    options = ClientOptions(daemon=held.address)
    c0, c1 = (NumpyClient("dp", r, 3, options, replica_group=(0, 1)) for r in range(2))
    c2 = NumpyClient("dp", 2, 3, options)
    assert c1.snapshot(0, arrays).copied_by == 0
    assert c2.snapshot(0, arrays).taken
    assert c0.snapshot(0, arrays).committed
    step, restored = c1.restore()
    assert step == 0 and restored["w"].tobytes() == arrays["w"].tobytes()
    for c in (c0, c1, c2):
        c.close()


def test_a_callers_group_alone_gets_no_other_ranks_state(held):
    options = ClientOptions(daemon=held.address)
    arrays = {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}
    alone = NumpyClient("solo", 0, 2, options)  # rank 0 declares no replicas
    assert alone.snapshot(0, arrays).taken
    got, details = _code(held.stub.Restore, pb.RestoreRequest(job="solo", rank=1,
                                                              replica_group=[0, 1]))
    assert got == C.FAILED_PRECONDITION, details
    assert "rank 0 declared replica group [0], without rank 1" in details
    # overlapping groups are refused as soon as the second one registers
    spec = [tensor_spec("w", (4, 4))]
    held.stub.Register(pb.RegisterRequest(job="overlap", rank=0, world_size=3,
                                          replica_group=[0, 1], tensors=spec), timeout=10)
    got, details = _code(held.stub.Register, pb.RegisterRequest(
        job="overlap", rank=2, world_size=3, replica_group=[1, 2], tensors=spec))
    assert got == C.FAILED_PRECONDITION and "rank 0 was registered with replica group [0, 1]" \
        in details, details
    job = held.stub.Status(pb.StatusRequest(job="solo"), timeout=10).jobs[0]
    assert [s.step for s in job.steps] == [0]  # what it held is kept
    alone.close()


# -- the problems measured in issue 12, one by one --------------------------------------------

def _status_code(stub, job):
    try:
        stub.Status(pb.StatusRequest(job=job), timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return C.OK


def test_a_layout_past_int64_is_refused_and_not_kept(held):
    # four tensors of 2^61 bytes each: every one fits, their segment passes int64
    huge = [tensor_spec(f"t{i}", (1 << 59,)) for i in range(4)]
    for _ in range(2):  # a retry gets the same answer: nothing was kept
        got, details = _code(held.stub.Register, pb.RegisterRequest(
            job="huge", rank=0, world_size=1, tensors=huge))
        assert got == C.INVALID_ARGUMENT and "at most" in details, details
    assert _status_code(held.stub, "huge") == C.NOT_FOUND
    for shape, words in (((1 << 62,), "passes"), ((1,) * 65, "dimensions"),
                         (((1 << 63) - 1, 0), "passes")):
        got, details = _code(held.stub.Register, pb.RegisterRequest(
            job="huge", rank=0, world_size=1, tensors=[tensor_spec("w", shape, nbytes=0)]))
        assert got == C.INVALID_ARGUMENT and words in details, details


def test_absurd_bubble_reports_are_refused_and_planning_goes_on(held):
    register(held.stub, job="bubbly", tensors=[tensor_spec("w", (1 << 18,))])

    def report(iteration=0, measured=0.01, copied=0, copy_seconds=0.0):
        return pb.BubbleEvent(job="bubbly", rank=0, kind=pb.BubbleEvent.REPORT,
                              iteration=iteration, iteration_seconds=0.1,
                              copied_bytes=copied, copy_seconds=copy_seconds,
                              reports=[pb.BubbleReport(position=p, measured_seconds=measured)
                                       for p in range(2)])

    for bad, words in ((report(measured=1e308), "measured_seconds"),
                       (report(copied=1 << 20, copy_seconds=5e-324), "broken clock"),
                       (report(iteration=(1 << 63) - 1), "iteration"),
                       (report(copied=-1), "copied_bytes")):
        with pytest.raises(grpc.RpcError) as info:
            list(held.stub.Bubbles(iter([bad]), timeout=10))
        assert info.value.code() == C.INVALID_ARGUMENT and words in info.value.details()
    start = pb.BubbleEvent(job="bubbly", rank=0, kind=pb.BubbleEvent.START, iteration=2)
    plans = list(held.stub.Bubbles(iter([report(0), report(1), start]), timeout=10))
    assert len(plans) == 1 and plans[0].interval >= 1 and plans[0].first_step == 4


def test_echoed_input_is_cut_short(held):
    long = "x" * 100_000
    for call, request in (
            (held.stub.Status, pb.StatusRequest(job=long)),
            (held.stub.Register, pb.RegisterRequest(job="ok", rank=0, world_size=1, tensors=[
                tensor_spec("w", (2,), dtype=long)])),
            (held.stub.Register, pb.RegisterRequest(job="ok", rank=0, world_size=1, tensors=[
                tensor_spec("\u00e9" * 2000, (2,))])),
            (held.stub.AppendLog, pb.AppendLogRequest(job="held", rank=0, stream=long,
                                                      records=[pb.LogRecord(step=0)])),
            (held.stub.ReadLog, pb.ReadLogRequest(job="held", rank=0, stream="\u2603" * 9000))):
        got, details = _code(call, request)
        assert got == C.INVALID_ARGUMENT and len(details.encode()) <= 1024, (got, details[:200])


def test_logs_of_unregistered_ranks_are_refused(held):
    before = held.stub.Status(pb.StatusRequest(), timeout=10).memory.log_bytes
    for job, rank in (("invented", 0), ("held", 3)):
        got, details = _code(held.stub.AppendLog, pb.AppendLogRequest(
            job=job, rank=rank, records=[pb.LogRecord(step=0, payload=b"x" * 1000)]))
        assert got == C.NOT_FOUND and "call Register" in details, details
    got, _ = _code(held.stub.AppendLogs, pb.AppendLogsRequest(logs=[
        pb.AppendLogRequest(job="held", rank=0, records=[pb.LogRecord(step=0)]),
        pb.AppendLogRequest(job="invented", rank=0, records=[pb.LogRecord(step=0)])]))
    assert got == C.NOT_FOUND
    memory = held.stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.log_bytes == before  # the batch kept none of its records
    assert memory.log_budget_bytes == 8 << 30


def test_the_log_budget_bounds_all_logs_and_shows(start_daemon):
    import urllib.request
    daemon = start_daemon("--log-budget", "4KiB")
    for job in ("a", "b"):
        register(daemon.stub, job=job)
    daemon.stub.AppendLog(pb.AppendLogRequest(job="a", rank=0, records=[
        pb.LogRecord(step=s, payload=bytes(900)) for s in range(3)]), timeout=10)
    got, details = _code(daemon.stub.AppendLog, pb.AppendLogRequest(
        job="b", rank=0, records=[pb.LogRecord(step=0, payload=bytes(1500))]))
    assert got == C.RESOURCE_EXHAUSTED and "--log-budget" in details, details
    got, details = _code(daemon.stub.AppendLog, pb.AppendLogRequest(
        job="b", rank=0, records=[pb.LogRecord(step=0, payload=bytes(5000))]))
    assert got == C.INVALID_ARGUMENT and "--log-budget is too small" in details, details
    memory = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.log_budget_bytes == 4096 and memory.log_bytes == 3 * (900 + 64)
    metrics = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                     timeout=10).read().decode()
    assert "bubblesnap_log_budget_bytes 4096.0" in metrics
    assert f"bubblesnap_log_bytes {3 * (900 + 64)}.0" in metrics
    # deleting job a frees its records: b logs now
    daemon.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job="a"), timeout=10)
    daemon.stub.AppendLog(pb.AppendLogRequest(
        job="b", rank=0, records=[pb.LogRecord(step=0, payload=bytes(1500))]), timeout=10)


def test_peer_calls_that_fail_keep_nothing(start_ring):
    from bubblesnap.protos import peer_pb2 as ppb
    from bubblesnap.protos import peer_pb2_grpc
    ring = start_ring(2, "--replicas", "1")
    peer = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[1]))
    replicate = dict(job="pulled", world_size=1, rank=0, step=1,
                     tensors=[tensor_spec("w", (4,))], checksums=[7], ticket=bytes(16))
    for address, code in (("a" * 64 + ".example:7000", C.INVALID_ARGUMENT),
                          ("h:\u00b2", C.INVALID_ARGUMENT),
                          ("127.0.0.1:1", C.ABORTED)):  # nothing listens there
        got, details = _code(peer.Replicate, ppb.ReplicateRequest(data_address=address,
                                                                  **replicate))
        assert got == code, (address, got, details)
    assert _status_code(ring.daemons[1].stub, "pulled") == C.NOT_FOUND  # no empty job left
    assert not peer.Holdings(ppb.HoldingsRequest(), timeout=10).copies
    got, _ = _code(peer.Join, ppb.JoinRequest(index=0, address="x" * 5000))
    assert got == C.INVALID_ARGUMENT
    # A copy a trainer made here is never dropped for one a peer offers (which then fails).
    own = NumpyClient("own", options=ClientOptions(daemon=ring.daemons[1].address))
    assert own.snapshot(5, HELD).taken
    got, details = _code(peer.Replicate, ppb.ReplicateRequest(
        job="own", world_size=1, rank=0, step=5, tensors=[tensor_spec("w", (8, 8))],
        checksums=[7], ticket=bytes(16), data_address="127.0.0.1:1"))
    assert got == C.FAILED_PRECONDITION and "own trainer's copy" in details, details
    step, restored = own.restore()
    assert step == 5 and restored["w"].tobytes() == HELD["w"].tobytes()
    own.close()
    # A peer's log records of a job unknown here count in the log memory, and deleting
    # the job frees them.
    before = ring.daemons[1].stub.Status(pb.StatusRequest(), timeout=10).memory.log_bytes
    peer.AppendLogReplica(ppb.LogReplicaRequest(job="elsewhere", rank=0, records=[
        pb.LogRecord(step=0, payload=b"r")]), timeout=10)
    memory = ring.daemons[1].stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.log_bytes == before + 65
    answer = ring.daemons[1].stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job="elsewhere"),
                                                  timeout=10)
    assert answer.deleted_steps == 0
    memory = ring.daemons[1].stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.log_bytes == before
    got, _ = _code(ring.daemons[1].stub.DeleteSnapshots,
                   pb.DeleteSnapshotsRequest(job="elsewhere"))
    assert got == C.NOT_FOUND
    assert ring.daemons[1].healthy()
