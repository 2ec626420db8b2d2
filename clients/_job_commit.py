"""A snapshot that waits for the whole job (``wait="job"``): the daemon asked until the
job committed the step or the deadline passed."""

import dataclasses
import time

import grpc

from bubblesnap.clients.results import SnapshotResult
from bubblesnap.protos import daemon_pb2 as pb


def job_outcome(stub, job: str, options, outcome: SnapshotResult,
                started: float) -> SnapshotResult:
    """``outcome`` once the job committed its step, or ``options.commit_timeout_seconds``
    passed."""
    step, timeout = outcome.step, options.commit_timeout_seconds
    try:
        committed, latest = wait_committed(stub, job, step, timeout, options)
        why = "" if committed else (f"the job did not commit step {step} within "
                                    f"{timeout:g} s (latest committed step: {latest})")
    except grpc.RpcError as err:
        committed = False
        why = (f"waiting for the job to commit step {step}: daemon {options.daemon}: "
               f"{err.code().name}: {err.details()}")
    return dataclasses.replace(
        outcome, committed=committed, waited_for="job",
        reason="; ".join(r for r in (outcome.reason, why) if r),
        stall_seconds=time.perf_counter() - started)


def wait_committed(stub, job: str, step: int, timeout: float, options) -> tuple[bool, int]:
    """Waits until ``step`` is committed for the whole job, at most ``timeout`` seconds;
    (committed, latest committed step). The daemon caps one wait, so this asks again
    until the deadline. Raises grpc.RpcError."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        answer = stub.WaitCommitted(
            pb.WaitCommittedRequest(job=job, step=step, timeout_seconds=left),
            timeout=left + options.rpc_timeout_seconds)
        if answer.committed or time.monotonic() >= deadline:
            return answer.committed, answer.latest_committed_step
