"""The trainer API: this user's Unix socket by default, the token over TCP, and calls that
neither streams nor late callers can starve or leak.

Real daemon processes; their sockets in temporary folders, except the test of the
default socket itself.
"""

import os
import queue
import socket
import stat
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bubblesnap.clients import ClientOptions, NumpyClient, RestoreError
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import daemon_pb2_grpc
from bubblesnap.service import DaemonOptions
from bubblesnap.shared.trainer_api import DEFAULT_ADDRESS, TOKEN_ENV, socket_path
from bubblesnap.testing import DAEMON_SERVICE, DaemonError, wait_for
from tests.helpers import register

X = {"x": np.arange(256, dtype=np.float32)}
ROOT = os.getuid() == 0
NOBODY = 65534


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def test_the_default_socket_is_where_clients_look_and_only_its_owner_opens_it(start_daemon):
    assert DaemonOptions().listen == ClientOptions().daemon == DEFAULT_ADDRESS
    path = socket_path(DEFAULT_ADDRESS)
    if _answers(path):
        pytest.skip(f"a daemon of this user already listens on {path}")
    daemon = start_daemon("--listen", DEFAULT_ADDRESS, own_shm_dir=True)
    assert daemon.address == DEFAULT_ADDRESS
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    folder = os.stat(os.path.dirname(path))
    assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) & 0o077 == 0

    client = NumpyClient("default")  # no address given: it finds this user's daemon
    assert client.snapshot(3, X).committed
    assert client.restore()[0] == 3
    client.close()
    status = subprocess.run([sys.executable, "-m", "bubblesnap", "status", "--job", "default"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "job default: 1/1 ranks registered" in status.stdout
    if ROOT:  # another user can neither reach the folder nor open the socket
        other = subprocess.run(["python3", "-I", "-c", "import socket, sys; "
                                "socket.socket(socket.AF_UNIX).connect(sys.argv[1])", path],
                               user=NOBODY, capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "PermissionError" in other.stderr


def test_a_killed_daemons_socket_is_taken_over_and_a_foreign_folder_refused(start_daemon,
                                                                            tmp_path):
    listen = f"unix://{tmp_path}/daemon.sock"
    start_daemon("--listen", listen).kill()
    assert stat.S_ISSOCK(os.lstat(tmp_path / "daemon.sock").st_mode)  # left behind
    assert start_daemon("--listen", listen).healthy()
    if ROOT:
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, NOBODY, NOBODY)
        with pytest.raises(DaemonError, match="not a folder of this user's"):
            start_daemon("--listen", f"unix://{foreign}/daemon.sock")


def _delete(address: str, token: str = "") -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        try:
            daemon_pb2_grpc.DaemonStub(channel).DeleteSnapshots(
                pb.DeleteSnapshotsRequest(job="tcp", steps=[1]), timeout=10, metadata=metadata)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_over_tcp_the_calls_that_drop_snapshots_need_the_token(start_daemon, tmp_path,
                                                              monkeypatch):
    no_token = start_daemon("--listen", "127.0.0.1:0")
    client = NumpyClient("tcp", options=ClientOptions(daemon=no_token.address))
    assert client.snapshot(1, X).committed  # staging and committing need no token
    with pytest.raises(RestoreError, match=r"UNAUTHENTICATED.*--trainer-token-file"):
        client.restore()
    assert client.restore(alone=True)[0] == 1  # drops nothing
    assert _delete(no_token.address) == grpc.StatusCode.UNAUTHENTICATED

    token_file = tmp_path / "token"
    token_file.write_text("trainer-s3cret\n")
    guarded = start_daemon("--listen", "127.0.0.1:0", "--trainer-token-file", str(token_file))
    client = NumpyClient("tcp", options=ClientOptions(daemon=guarded.address,
                                                      token="trainer-s3cret"))
    assert client.snapshot(1, X).committed and client.restore()[0] == 1
    wrong = NumpyClient("tcp", options=ClientOptions(daemon=guarded.address, token="guess"))
    with pytest.raises(RestoreError, match="UNAUTHENTICATED"):
        wrong.restore()
    monkeypatch.setenv(TOKEN_ENV, "trainer-s3cret")  # a client takes it from the environment
    assert NumpyClient("tcp", options=ClientOptions(daemon=guarded.address)).restore()[0] == 1
    assert _delete(guarded.address, "guess") == grpc.StatusCode.UNAUTHENTICATED
    assert _delete(guarded.address, "trainer-s3cret") == grpc.StatusCode.OK

    monkeypatch.delenv(TOKEN_ENV)  # on the Unix socket the same daemon wants no token
    on_socket = start_daemon("--trainer-token-file", str(token_file))
    client = NumpyClient("tcp", options=ClientOptions(daemon=on_socket.address))
    assert client.snapshot(1, X).committed and client.restore()[0] == 1


def test_streams_hold_no_thread_health_and_status_answer_and_the_limit_is_named(start_daemon):
    streams = 40
    daemon = start_daemon("--rpc-threads", "2", "--max-streams", str(streams))
    stub = daemon.stub
    for rank in range(streams):
        register(stub, job="streams", rank=rank, world_size=streams)
    queues, calls = [], []
    for rank in range(streams):  # every stage holds its stream open, as pipelines do
        q = queue.SimpleQueue()
        q.put(pb.BubbleEvent(job="streams", rank=rank, stage=rank, step=-1, iteration=0,
                             kind=pb.BubbleEvent.REPORT,
                             reports=[pb.BubbleReport(position=1, measured_seconds=0.01)]))
        queues.append(q)
        calls.append(stub.Bubbles(iter(q.get, None)))

    def one_too_many() -> bool:
        try:
            list(stub.Bubbles(iter(()), timeout=10))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams" in err.details()
            return True
        return False

    try:
        wait_for(one_too_many, f"all {streams} streams open")
        health = health_pb2_grpc.HealthStub(daemon.channel).Check(
            health_pb2.HealthCheckRequest(service=DAEMON_SERVICE), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert len(stub.Status(pb.StatusRequest(job="streams"), timeout=5).jobs) == 1
        client = NumpyClient("beside", options=ClientOptions(daemon=daemon.address))
        assert client.snapshot(0, X).committed  # calls of other ranks go through too
    finally:
        for q in queues:
            q.put(None)
    assert all(list(call) == [] for call in calls)  # still profiling: no plan, no error


def test_a_begin_step_that_waited_past_its_deadline_reserves_nothing(start_ring):
    # One calls thread, and a log record whose replication waits on a stopped peer
    # until the test lets it go (the peer call's deadline is far off).
    ring = start_ring(2, "--replicas", "1", "--rpc-threads", "1", "--peer-call-timeout", "120")
    stub = ring.daemons[0].stub
    register(stub, job="late")

    def log_record(step: int):
        return stub.AppendLog.future(pb.AppendLogRequest(
            job="late", rank=0, records=[pb.LogRecord(step=step, payload=b"r")]), timeout=180)

    def calls_thread_busy() -> bool:  # a call in its lane is not started within 0.3 s
        try:
            stub.ListSnapshots(pb.ListSnapshotsRequest(job="late"), timeout=0.3)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            return True
        return False

    wait_for(lambda: log_record(0).result().copies == 2, "daemon 1 taking log records")
    ring.daemons[1].freeze()  # log replication waits for it now
    try:
        append = log_record(1)
        wait_for(calls_thread_busy, "the calls thread waiting on the stopped peer")
        with pytest.raises(grpc.RpcError) as info:
            stub.BeginStep(pb.BeginStepRequest(job="late", rank=0, step=0), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        ring.daemons[1].thaw()
    assert append.result().copies == 2  # the peer took it once it ran again
    status = stub.Status(pb.StatusRequest(job="late"), timeout=10)
    assert list(status.jobs[0].steps) == [] and status.memory.used_bytes == 0
    stub.BeginStep(pb.BeginStepRequest(job="late", rank=0, step=0), timeout=10)
    status = stub.Status(pb.StatusRequest(job="late"), timeout=10)  # what it would have held
    assert status.jobs[0].steps[0].ranks[0].state == pb.STAGING
