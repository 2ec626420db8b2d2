"""The training log: records beside the snapshots, replicated, read back after failures."""

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, LogError, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from tests.test_peers import client, snapshot_steps, wait_for

#: What a logging rank registers: the daemon keeps records only of registered ranks.
STATE = {"w": np.zeros(4, np.float32)}


def logger(daemon, job: str, **options) -> NumpyClient:
    """A registered rank 0 of ``job`` on ``daemon``."""
    c = NumpyClient(job, options=ClientOptions(daemon=daemon.address, **options))
    c.register(STATE)
    return c


def record(rank: int, step: int) -> bytes:
    return f'{{"rank": {rank}, "step": {step}, "batch": [{step * 7}, {step * 7 + 1}]}}'.encode()


def test_log_outlives_the_trainer_and_gaps_end_the_replay(daemon):
    c = logger(daemon, "logged")
    for step in range(6):
        c.log(step, record(0, step))
        assert c.wait_log() == 1
    c.log(3, record(0, 3))  # a replayed step logs the same record again
    c.wait_log()
    del c  # the trainer is gone; a new one reads what it logged
    fresh = NumpyClient("logged", options=ClientOptions(daemon=daemon.address))
    assert fresh.read_log(2) == [(s, record(0, s)) for s in range(3, 6)]
    fresh.log(8, record(0, 8))  # 6 and 7 never logged: replay stops at the gap
    fresh.wait_log()
    assert [s for s, _ in fresh.read_log(-1)] == [0, 1, 2, 3, 4, 5]


def test_bad_log_records_are_refused_and_nothing_is_lost(daemon):
    c = logger(daemon, "logged")
    c.log(0, b"ok")
    c.wait_log()
    c.log(1, b"x" * (65 << 10))
    with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*at most"):
        c.wait_log()
    c.log(-1, b"negative")
    with pytest.raises(LogError, match="INVALID_ARGUMENT"):
        c.wait_log()
    with pytest.raises(grpc.RpcError) as info:
        daemon.stub.AppendLog(pb.AppendLogRequest(job="../etc", rank=0), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.read_log(-1) == [(0, b"ok")]


def test_log_survives_the_loss_of_its_host(start_ring):
    ring = start_ring(3, "--replicas", "1")
    snapshot_steps(ring, range(2))
    logger = client(ring.daemons[1], 1)
    for step in range(2, 5):  # steps after the last snapshot: only the log has them
        logger.log(step, record(1, step))
        assert logger.wait_log() == 2  # host 1 and its successor
    ring.daemons[1].kill()
    replacement = ring.replace(1)
    fresh = client(replacement, 1)
    step, _ = fresh.restore()
    assert step == 1
    records, source = fresh._session.read_log(step)
    assert records == [(s, record(1, s)) for s in range(2, 5)]
    assert source.startswith("peer ") and ring.peers[1] not in source
    assert fresh.read_log(step, until_step=3) == [(s, record(1, s)) for s in (2, 3)]


def test_a_long_log_is_read_back_whole_in_pages(daemon):
    c = logger(daemon, "paged")
    payloads = [bytes([s % 251]) * (60 << 10) for s in range(200)]  # 12 MB, > any one answer
    for step, payload in enumerate(payloads):
        c.log(step, payload)
    assert c.wait_log() == 1
    assert c.read_log(-1) == list(enumerate(payloads))


def test_peers_answer_every_record_and_the_reader_finds_the_gaps():
    from bubblesnap.service.logs import LogOptions, TrainingLogs, contiguous
    one, two = TrainingLogs(), TrainingLogs()
    one.append("j", 0, [(s, b"a") for s in (1, 2, 3, 6, 7)])  # down while 4 and 5 were logged
    two.append("j", 0, [(4, b"a"), (5, b"a")])
    held = dict(one.held_after("j", 0, 0)) | dict(two.held_after("j", 0, 0))
    assert [s for s, _ in contiguous(held, 0)] == [1, 2, 3, 4, 5, 6, 7]
    assert [s for s, _ in one.read("j", 0, 0)] == [1, 2, 3]
    small = TrainingLogs(LogOptions(max_rank_bytes=64 * 20))
    small.append("j", 0, [(s, b"") for s in range(100)])  # empty records cost bookkeeping too
    assert [s for s, _ in small.held_after("j", 0, -1)] == list(range(80, 100))


def test_a_ranks_boundary_streams_share_one_bound_and_the_oldest_steps_go_first():
    from bubblesnap.service.logs import LogOptions, TrainingLogs
    logs = TrainingLogs(LogOptions(max_boundary_rank_bytes=(100 + 64) * 10))
    for step in range(8):
        for stream in ("act/mb0", "grad/mb0"):
            logs.append("j", 0, [(step, bytes(100))], stream)
    logs.append("j", 0, [(0, b"t")])  # the training log is bounded apart
    logs.append("j", 1, [(0, bytes(100))], "act/mb0")  # and every rank on its own
    for stream in ("act/mb0", "grad/mb0"):
        assert logs.read("j", 0, -1, stream=stream) == []  # step 0 is gone
        assert [s for s, _ in logs.read("j", 0, 2, stream=stream)] == [3, 4, 5, 6, 7]
    assert [s for s, _ in logs.read("j", 0, -1)] == [0]
    assert [s for s, _ in logs.read("j", 1, -1, stream="act/mb0")] == [0]


def test_a_budget_that_drops_records_a_replay_needs_says_so_once(caplog):
    from bubblesnap.service.logs import LogOptions, TrainingLogs
    logs = TrainingLogs(LogOptions(max_boundary_rank_bytes=(100 + 64) * 10))
    logs.drop_boundary_through("j", 2)  # snapshots from step 2 on are kept
    with caplog.at_level("WARNING", logger="bubblesnap.daemon"):
        logs.append("j", 0, [(s, bytes(100)) for s in range(3, 13)], "act/mb0")
        assert not caplog.records  # all ten fit
        logs.append("j", 0, [(s, bytes(100)) for s in range(13, 16)], "act/mb0")
    assert [s for s, _ in logs.read("j", 0, 5, stream="act/mb0")] == list(range(6, 16))
    assert len(caplog.records) == 1 and "--boundary-log-budget" in caplog.text
    assert "dropped step 3" in caplog.text


def test_boundary_streams_are_separate_logs_held_on_the_senders_host(start_ring):
    ring = start_ring(2, "--replicas", "1")
    sender = client(ring.daemons[0], 0)
    sender.register(STATE)

    def peer_takes_records() -> bool:  # a peer just started may refuse for a moment
        sender.log(0, record(0, 0))
        return sender.wait_log() == 2
    wait_for(peer_takes_records, "the peer takes training-log records")
    activation = bytes(range(256)) * 512  # 128 KiB: more than a training-log record may hold
    for step in range(3):
        sender.log(step, record(0, step))
        sender.log(step, activation + bytes([step]), stream="act/mb0")
        sender.log(step, b"grad" + bytes([step]), stream="grad/mb0")
    assert sender.wait_log() == 2  # the training records; boundary records stay here
    assert sender.read_log(-1, stream="act/mb0") == [(s, activation + bytes([s]))
                                                     for s in range(3)]
    assert sender.read_log(0, stream="grad/mb0") == [(1, b"grad\x01"), (2, b"grad\x02")]
    assert sender.read_log(-1) == [(s, record(0, s)) for s in range(3)]
    memory = ring.daemons[0].stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.log_bytes >= 3 * len(activation), memory  # shown, not hidden
    # the peer holds the training log, not the boundary streams
    ring.daemons[0].kill()
    assert client(ring.daemons[1], 0).read_log(-1, stream="act/mb0") == []
    assert client(ring.daemons[1], 0).read_log(-1) == [(s, record(0, s)) for s in range(3)]


def test_bad_boundary_records_are_refused_and_nothing_is_lost(daemon):
    c = logger(daemon, "bounded")
    c.log(0, b"kept", stream="act/mb0")
    c.wait_log()
    c.log(1, b"x" * ((16 << 20) + 1), stream="act/mb0")
    with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*'act/mb0'.*at most 16777216"):
        c.wait_log()
    for bad in ("../up", "/abs", "a" * 65, "sp ace"):
        c.log(1, b"x", stream=bad)
        with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*log stream"):
            c.wait_log()
    with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*log stream"):
        c.read_log(-1, stream="../up")
    with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*until_step 0 must come after"):
        c._session.read_log(0, stream="act/mb0", until_step=0)
    assert c.read_log(-1, stream="act/mb0", until_step=0) == [(0, b"kept")]
    # a step's boundary records go in one call: one bad record keeps none of them
    c.log(1, b"good", stream="act/mb0")
    c.log(1, b"bad", stream="no spaces")
    with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*'no spaces'"):
        c.wait_log()
    assert c.read_log(-1, stream="act/mb0") == [(0, b"kept")]


def test_boundary_records_older_than_every_kept_snapshot_are_dropped(start_daemon):
    daemon = start_daemon("--keep", "2")
    stage = NumpyClient("trimmed", options=ClientOptions(daemon=daemon.address))
    stage.register({"w": np.full(64, 0, np.float32)})  # the layout it snapshots
    other = logger(daemon, "other-job")
    activation = bytes(4096)
    for step in range(6):
        stage.log(step, record(0, step))
        stage.log(step, activation, stream="act/mb0")
        other.log(step, activation, stream="act/mb0")
    stage.wait_log()
    other.wait_log()
    held = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.log_bytes
    for step in range(4):  # with --keep 2 the oldest kept snapshot is then step 2
        assert stage.snapshot(step, {"w": np.full(64, step, np.float32)}).committed
    assert stage.read_log(-1, stream="act/mb0") == []  # steps 0-2 are gone
    assert [s for s, _ in stage.read_log(2, stream="act/mb0")] == [3, 4, 5]
    assert [s for s, _ in stage.read_log(-1)] == list(range(6))  # the training log stays
    assert [s for s, _ in other.read_log(-1, stream="act/mb0")] == list(range(6))
    after = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.log_bytes
    assert after <= held - 3 * len(activation)


def test_the_boundary_log_budget_bounds_a_rank_and_refuses_what_cannot_fit(start_daemon):
    daemon = start_daemon("--boundary-log-budget", "2KiB")
    c = logger(daemon, "small")
    for step in range(8):  # 464 B a record with bookkeeping: four fit in 2 KiB
        c.log(step, bytes(400), stream="act/mb0")
    c.wait_log()
    assert [s for s, _ in c.read_log(3, stream="act/mb0")] == [4, 5, 6, 7]
    c.log(8, bytes(4096), stream="act/mb0")
    with pytest.raises(LogError, match=r"INVALID_ARGUMENT.*--boundary-log-budget is too small"):
        c.wait_log()
    assert [s for s, _ in c.read_log(3, stream="act/mb0")] == [4, 5, 6, 7]


def test_the_log_budget_refuses_what_would_pass_it_and_counts_a_ranks_own_drops():
    from bubblesnap.service.errors import ResourceExhausted
    from bubblesnap.service.logs import LogOptions, TrainingLogs
    cost = 100 + 64
    logs = TrainingLogs(LogOptions(max_rank_bytes=max(1024, cost * 4), max_total_bytes=2048))
    per_rank = max(1024, cost * 4) // cost  # records a rank's own budget keeps
    for job in ("a", "b"):
        logs.append(job, 0, [(s, bytes(100)) for s in range(per_rank)])
    assert logs.bytes_held() == 2 * per_rank * cost  # 1968 of 2048
    # both ranks are at their own budgets: each new record drops their oldest, so
    # they log on at the daemon's bound
    for step in range(per_rank, per_rank + 5):
        assert logs.append("a", 0, [(step, bytes(100))]) == step
    with pytest.raises(ResourceExhausted, match="--log-budget"):
        logs.append("c", 0, [(0, bytes(100))])
    with pytest.raises(ResourceExhausted):  # a batch is all or none
        logs.append_all([("a", 0, [(99, bytes(100))], ""), ("c", 0, [(0, bytes(100))], "")])
    assert logs.read("a", 0, 98) == [] and logs.bytes_held() == 2 * per_rank * cost
    assert logs.forget("b") and not logs.forget("b")
    logs.append("c", 0, [(0, bytes(100))])  # room again
