"""The hooks a pipeline runtime calls: the Protocol, the no-op hooks, the log-then-wait wrapper."""

import time

import numpy as np
import pytest

from bubblesnap.clients import (
    BoundaryLog,
    ClientOptions,
    LogError,
    LoggedSteps,
    NoSnapshots,
    NumpyClient,
    PipelineHooks,
)
from bubblesnap.clients.jax import BubbleSnapshotter, SnapshotClient

NOWHERE = ClientOptions(daemon="127.0.0.1:1")  # nothing is sent by what these tests call
STATE = {"w": np.zeros(4, np.float32)}  # what the logging ranks register


def test_no_snapshots_satisfies_the_protocol_and_only_waits():
    hooks = NoSnapshots()
    assert isinstance(hooks, PipelineHooks)
    hooks.begin_iteration(0)
    hooks.no_bubble(0)
    assert hooks.bubble(1, lambda: ("tensor", time.perf_counter()), lambda: False) == "tensor"
    hooks.end_iteration(0, {"w": np.ones(2)})
    hooks.flush()
    hooks.close()


def test_the_bubble_snapshotter_and_the_wrapper_satisfy_the_protocol():
    client = SnapshotClient("hooks", options=NOWHERE)
    snap = BubbleSnapshotter(client, stage=0)
    assert isinstance(snap, PipelineHooks)
    assert isinstance(LoggedSteps(client, hooks=snap), PipelineHooks)
    assert not isinstance(object(), PipelineHooks)
    client.close()


def test_the_snapshotter_says_which_iteration_it_is_in():
    client = SnapshotClient("hooks", options=NOWHERE)
    snap = BubbleSnapshotter(client, stage=0)
    assert snap.iteration == -1
    snap.begin_iteration(3)  # before any registration: nothing goes to the daemon
    assert snap.iteration == 3
    with pytest.raises(AttributeError):
        snap.iteration = 4
    client.close()


class Recording(NoSnapshots):
    """Hooks that note what the daemon holds for this rank when they are called."""

    def __init__(self, reader: NumpyClient):
        self.reader, self.seen = reader, []

    def begin_iteration(self, iteration: int) -> None:
        self.seen.append(("begin", iteration))

    def end_iteration(self, iteration: int, state) -> None:
        held = [step for step, _ in self.reader.read_log(iteration - 1, until_step=iteration)]
        boundary = self.reader.read_log(iteration - 1, stream="act/mb0", until_step=iteration)
        self.seen.append(("end", iteration, held, [step for step, _ in boundary], state))


def test_logged_steps_hold_each_record_before_the_wrapped_hooks_hear_the_end(daemon):
    options = ClientOptions(daemon=daemon.address)
    client, reader = NumpyClient("logged", options=options), NumpyClient("logged", options=options)
    client.register(STATE)  # a rank logs once registered
    inner = Recording(reader)
    hooks = LoggedSteps(client, lambda it: f"batch of step {it}".encode(), inner)
    boundary_log = BoundaryLog(client, [0], lambda stage: options)
    for iteration in range(3):
        hooks.begin_iteration(iteration)
        assert hooks.bubble(0, lambda: ("x", time.perf_counter())) == "x"
        hooks.no_bubble(1)
        boundary_log.write(0, ("act", iteration, 0), np.full(4, iteration, np.float32))
        hooks.end_iteration(iteration, f"state {iteration}")
        assert hooks.copies == 1  # one daemon, no peers
    assert inner.seen == [entry for it in range(3) for entry in (
        ("begin", it), ("end", it, [it], [it], f"state {it}"))]
    assert reader.read_log(-1) == [(it, f"batch of step {it}".encode()) for it in range(3)]
    assert boundary_log.bytes_by_boundary[0] > 0
    assert boundary_log.logged(1, 0) and not boundary_log.logged(1, 2)
    np.testing.assert_array_equal(boundary_log.read(0, 1, ("act", 2, 0)),
                                  np.full(4, 2, np.float32))
    hooks.flush()
    hooks.close()
    boundary_log.close()
    for c in (client, reader):
        c.close()


def test_a_rank_without_records_still_waits_for_its_boundary_records(daemon):
    options = ClientOptions(daemon=daemon.address)
    client = NumpyClient("boundary-only", rank=1, world_size=2, options=options)
    client.register(STATE)
    hooks = LoggedSteps(client)
    boundary_log = BoundaryLog(client, [0], lambda stage: options)
    hooks.begin_iteration(5)
    boundary_log.write(0, ("grad", 5, 1), np.arange(3.0))
    hooks.end_iteration(5, None)
    assert hooks.copies == 0  # no training-log record was pending
    assert client.read_log(-1) == []
    receiver = NumpyClient("boundary-only", rank=0, world_size=2, options=options)
    receiving = BoundaryLog(receiver, [0], lambda stage: options)  # stage 0 reads stage 1's
    np.testing.assert_array_equal(receiving.read(1, 0, ("grad", 5, 1)), np.arange(3.0))
    receiving.close()
    for c in (client, receiver):
        c.close()


def test_a_record_the_daemon_refuses_ends_the_step_with_log_error(daemon):
    client = NumpyClient("refused", options=ClientOptions(daemon=daemon.address))
    client.register(STATE)
    inner = Recording(client)
    hooks = LoggedSteps(client, lambda it: b"x" * (65 << 10), inner)  # over the 64 KiB limit
    hooks.begin_iteration(0)
    with pytest.raises(LogError, match="INVALID_ARGUMENT"):
        hooks.end_iteration(0, None)
    assert inner.seen == [("begin", 0)]  # the step did not count as done
    client.close()
