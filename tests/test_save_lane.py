"""Saves that do not wait never wait on a sick daemon (clients/save_lane.py): the next step's
segment is reserved at each commit and used under a later step's number (``staged_as``); a
frozen daemon (SIGSTOP) is told from a busy one by its heartbeat and skipped without a
call (its heartbeat file: the kernel says it is stopped); a daemon killed and started
again gets the next save, whatever the back-off."""

import os
import signal

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import heartbeat_file
from bubblesnap.testing import wait_for
from tests.helpers import register, tensor_spec

C = grpc.StatusCode


def arrays(step: int) -> dict[str, np.ndarray]:
    return {"w": np.arange(4096, dtype=np.float32) + step, "n": np.full((3,), step)}


def _code(call, request):
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value.code(), info.value.details()


def test_a_segment_reserved_by_a_commit_is_committed_under_a_later_step(daemon):
    stub = daemon.stub
    register(stub, job="res", tensors=[tensor_spec("w", (4, 4))])
    stub.BeginStep(pb.BeginStepRequest(job="res", rank=0, step=1), timeout=10)
    answer = stub.CommitStep(pb.CommitStepRequest(job="res", rank=0, step=1, next_step=2),
                             timeout=10)
    assert answer.next.segment_path  # step 2 reserved
    stub.CommitStep(pb.CommitStepRequest(job="res", rank=0, step=5, staged_as=2), timeout=10)

    # Bad input: precise codes, and nothing held is lost.
    got, details = _code(stub.CommitStep, pb.CommitStepRequest(job="res", rank=0, step=6,
                                                               staged_as=7))
    assert got == C.INVALID_ARGUMENT and "comes after step 6" in details
    got, details = _code(stub.CommitStep, pb.CommitStepRequest(job="res", rank=0, step=9,
                                                               staged_as=6))
    assert got == C.NOT_FOUND and "no step 6 being staged" in details
    got, _ = _code(stub.CommitStep, pb.CommitStepRequest(job="res", rank=0, step=9,
                                                         staged_as=-1))
    assert got == C.INVALID_ARGUMENT
    [job] = stub.Status(pb.StatusRequest(job="res"), timeout=10).jobs
    assert [(s.step, s.committed) for s in job.steps] == [(1, True), (5, True)]


def test_saves_that_do_not_wait_copy_into_the_reserved_segment(daemon):
    client = NumpyClient("lane", options=ClientOptions(daemon=daemon.address))
    results = [client.snapshot(step, arrays(step), wait=False) for step in range(0, 30, 3)]
    assert client.wait().committed is not None
    # the first save has no reservation: set aside, handed over by the lane's thread; every
    # later one copied straight into the segment the last commit reserved (no round trip)
    assert [sorted(r.phases) for r in results] == [["aside"]] + [["copy"]] * 9
    assert all(r.taken for r in results)
    step, restored = client.restore()
    assert step == 27 and all(np.array_equal(restored[k], v) for k, v in arrays(27).items())
    assert client.session.take_late_failures() == []
    client.close()


def test_a_frozen_daemon_is_skipped_without_a_call_and_the_first_save_after_it_is_taken(daemon):
    # A short call deadline, so that the save in flight when it froze fails meanwhile.
    client = NumpyClient("frozen", options=ClientOptions(daemon=daemon.address,
                                                         rpc_timeout_seconds=1.0))
    assert client.snapshot(0, arrays(0), wait="rank").taken
    daemon.freeze()
    try:
        step, skipped, late = 1, [], []

        def frozen_long_enough() -> bool:
            nonlocal step
            result = client.snapshot(step, arrays(step), wait=False)
            step += 1
            if not result.taken:
                skipped.append(result.reason)
            late.extend(client.session.take_late_failures())
            return len(skipped) >= 3 and late
        wait_for(frozen_long_enough, "saves skipped, and the call in flight given up")
    finally:
        daemon.thaw()
    # told by the heartbeat, not by a call's deadline
    assert all("has not answered" in reason for reason in skipped), skipped
    assert "deadline exceeded" in late[0].reason
    thawed = step

    def a_save_after_the_thaw_committed() -> bool:
        nonlocal step
        client.snapshot(step, arrays(step), wait=False)
        step += 1
        return client.status().latest_committed_step >= thawed
    wait_for(a_save_after_the_thaw_committed, "a save committed after the thaw")
    client.wait()
    latest, restored = client.restore()
    assert latest >= thawed and np.array_equal(restored["w"], arrays(latest)["w"])
    client.close()


def test_a_daemon_started_again_gets_the_next_save_whatever_the_back_off(start_daemon,
                                                                          tmp_path):
    listen = ("--listen", f"unix://{tmp_path}/daemon.sock")
    first = start_daemon(*listen)
    # An hour of back-off: only a lane that tries again when the daemon is back passes.
    client = NumpyClient("again", options=ClientOptions(daemon=first.ready["address"],
                                                        backoff_seconds=3600))
    assert client.snapshot(0, arrays(0), wait="rank").taken
    first.kill()
    for step in range(1, 4):  # the daemon is gone: no snapshot
        client.snapshot(step, arrays(step), wait=False)
    step = 4
    assert not client.wait().taken
    start_daemon(*listen)

    def taken_again() -> bool:
        nonlocal step
        result = client.snapshot(step, arrays(step), wait=False)
        step += 1
        return result.taken and client.wait().taken
    wait_for(taken_again, "a save taken by the daemon started again")
    latest, restored = client.restore()
    assert latest == step - 1 and np.array_equal(restored["w"], arrays(latest)["w"])
    client.close()


def test_the_heartbeat_tells_a_stopped_daemon_and_never_trusts_a_reused_pid(daemon, tmp_path):
    fd = os.open(os.path.join(daemon.ready["shm_dir"], "lock"), os.O_RDONLY)
    try:
        assert heartbeat_file.read(fd).stopped is False
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: heartbeat_file.read(fd).stopped, "the kernel to say: stopped")
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        wait_for(lambda: heartbeat_file.read(fd).stopped is False, "running again")
    finally:
        os.close(fd)
    # a pid that is not the writer's (another start time: reused, or another namespace's)
    # says nothing; the clock alone is left
    own_start = heartbeat_file.process_state(os.getpid())[1]
    fake = tmp_path / "lock"
    fake.write_bytes(heartbeat_file.pack(0.0, os.getpid(), own_start + 1))
    fd = os.open(fake, os.O_RDONLY)
    try:
        beat = heartbeat_file.read(fd)
        assert beat.stopped is None and beat.silence > 0
    finally:
        os.close(fd)
