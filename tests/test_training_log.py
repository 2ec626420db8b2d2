"""The training log: records beside the snapshots, replicated, read back after failures."""

import grpc
import pytest

from bubblesnap.clients import ClientOptions, LogError, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from tests.test_peers import client, snapshot_steps


def record(rank: int, step: int) -> bytes:
    return f'{{"rank": {rank}, "step": {step}, "batch": [{step * 7}, {step * 7 + 1}]}}'.encode()


def test_log_outlives_the_trainer_and_gaps_end_the_replay(daemon):
    c = NumpyClient("logged", options=ClientOptions(daemon=daemon.address))
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
    c = NumpyClient("logged", options=ClientOptions(daemon=daemon.address))
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
