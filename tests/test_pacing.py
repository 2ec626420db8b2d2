"""Replication paced into bubbles: the pure decision, then real rings of daemons where a
stage reports bubbles (or stops) and Status tells how the pushes fell."""

import queue
import re
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from bubblesnap.cli.status_command import format_status
from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.peers import data_channel, pacing
from bubblesnap.service.peers.data_server import GATED_PIECE_BYTES, HELD_PIECE_BYTES, DataServer
from bubblesnap.service.peers.idle_windows import IdleWindows
from bubblesnap.service.peers.pacing import StageBubbles, idle_state, idle_windows, push_at
from bubblesnap.testing import wait_for

# -- the decision ------------------------------------------------------------------------------

def test_no_stage_reporting_bubbles_pushes_at_once():
    assert push_at([], now=10.0, deadline=12.0) == 10.0
    stale = StageBubbles(((1.0, 1.5),), period=1.0)  # last seen 9 s ago, 3 periods at most
    assert push_at([stale], now=10.0, deadline=12.0) == 10.0


def test_inside_a_bubble_it_goes_now_and_between_bubbles_it_waits_for_the_next():
    stage = StageBubbles(((10.0, 10.4),), period=1.0)
    assert push_at([stage], now=10.2, deadline=12.0) == 10.2
    assert push_at([stage], now=10.5, deadline=12.0) == pytest.approx(11.0)


def test_a_window_after_the_deadline_is_not_waited_for():
    stage = StageBubbles(((10.0, 10.4),), period=5.0)
    assert push_at([stage], now=10.5, deadline=12.0) == 10.5
    assert push_at([stage], now=10.5, deadline=10.5) == 10.5


def test_unknown_period_waits_for_a_start_until_the_deadline():
    stage = StageBubbles(((10.0, 10.4),))
    assert push_at([stage], now=10.5, deadline=12.0) == 12.0
    assert push_at([stage], now=12.0, deadline=12.0) == 12.0


def test_the_host_is_idle_only_when_every_stage_is_in_a_bubble():
    a = StageBubbles(((10.0, 10.5),), period=1.0)
    b = StageBubbles(((10.3, 10.8),), period=1.0)
    assert idle_windows([a, b], 10.0, 12.0) == [(10.3, 10.5), (11.3, 11.5)]
    assert push_at([a, b], now=10.1, deadline=12.0) == pytest.approx(10.3)
    assert push_at([a, b], now=10.6, deadline=12.0) == pytest.approx(11.3)


def test_idle_state_is_inside_a_window_seen_or_predicted_and_says_until_when():
    stage = StageBubbles(((1.0, 1.5), (2.0, 2.5)), period=1.0)
    assert idle_state([stage], 2.2, 2.3) == (True, 2.5)
    assert idle_state([stage], 3.2, 3.3) == (True, 3.5)  # the next one is predicted
    assert idle_state([stage], 2.7, 4.0) == (False, 3.0)  # until the next one opens
    assert idle_state([stage], 2.7, 2.8) == (False, 2.8)  # ... or the horizon
    assert idle_state([], 2.2, 2.3) == (False, 2.3)


def test_a_tiny_period_cannot_make_the_work_unbounded():
    stage = StageBubbles(((0.0, 1e-9),), period=1e-9)
    assert len(stage.windows(until=3600.0)) <= 300


class RecordingGate:
    def __init__(self, holds_back: bool):
        self.holds_back, self.asked = holds_back, []

    def __call__(self, nbytes: int) -> None:
        self.asked.append(nbytes)


@pytest.mark.parametrize("holds_back, piece", [(False, GATED_PIECE_BYTES),
                                               (True, HELD_PIECE_BYTES)])
def test_a_gated_offer_asks_its_gate_before_every_piece(tmp_path, holds_back, piece):
    """The data channel's end of pacing: a gated offer's bytes go in pieces, each after
    its gate returned (a gate that waits holds the bytes back); smaller ones where the
    gate may hold them back."""
    nbytes = 2 * piece + 12345
    path = tmp_path / "segment"
    path.write_bytes(np.random.default_rng(0).bytes(nbytes))
    gate = RecordingGate(holds_back)
    server = DataServer("127.0.0.1:0")
    try:
        ticket = server.offer(str(path), nbytes, lambda: None, gate=gate)
        [(data, _)] = data_channel.read_ranges(server.address, ticket, [(0, nbytes)], None,
                                               10.0, "a test copy", streams=1)
    finally:
        server.close()
    assert bytes(data) == path.read_bytes()
    assert gate.asked == [piece, piece, 12345]


def test_a_push_gate_judges_again_when_a_bubble_closes():
    """A gate keeps what it judged until it may change: a bubble ending early (END)
    makes the next piece count as sent outside one."""
    windows = IdleWindows()  # pacing off: nothing waits, the bytes are only counted
    windows.observe("j", 0, True, 60.0, 0.0)
    gate = windows.gate(time.monotonic(), threading.Event())
    assert not gate.holds_back
    gate(100)
    gate(10)
    assert gate.idle_bytes == 110
    windows.observe("j", 0, False, 0.0, 0.0)
    gate(1000)
    assert gate.idle_bytes == 110


def test_a_bound_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"PacingOptions\.max_wait_seconds: --pace-max-wait"):
        pacing.PacingOptions(max_wait_seconds=-1.0)


# -- rings of daemons --------------------------------------------------------------------------

JOB = "paced"
STATE = {"w": np.arange(1 << 18, dtype=np.float32)}  # 1 MiB


class Bubbles:
    """A stage's Bubbles stream driven by hand: START (expected length) and END events."""

    def __init__(self, daemon):
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._call = daemon.stub.Bubbles(iter(self._events.get, None))
        threading.Thread(target=self._drain, daemon=True).start()
        self.iteration = 0

    def _drain(self) -> None:
        try:
            list(self._call)  # plans sent back: not used here
        except grpc.RpcError:
            pass  # the daemon stopped at the test's end

    def send(self, kind, **fields) -> None:
        self._events.put(pb.BubbleEvent(job=JOB, rank=0, kind=kind, iteration=self.iteration,
                                        position=1, **fields))

    def close(self) -> None:
        self._events.put(None)


def pushes(daemon, step: int) -> list[pb.Replication]:
    jobs = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs
    return [r for r in jobs[0].replication if r.step == step]


def pushed(daemon, step: int) -> pb.Replication:
    wait_for(lambda: pushes(daemon, step), timeout=30, what=f"the push of step {step}")
    [push] = pushes(daemon, step)
    return push


def snapshot(daemon, step: int) -> None:
    client = NumpyClient(JOB, 0, 1, ClientOptions(daemon=daemon.address))
    try:
        result = client.snapshot(step, STATE)
        assert result.taken, result.reason
    finally:
        client.close()


@pytest.mark.parametrize("paced", [True, False])
def test_replication_goes_inside_the_bubbles_a_stage_reports(start_ring, paced):
    """A stage in a 0.6 s bubble every 1.5 s (the stage's timeline is scripted in real
    time); a step committed just after one ended. Paced, its push waits for the next
    window and every byte goes inside one, as the daemon judged it; unpaced it is not
    held back. No timing is asserted: a late test process only moves the commit."""
    flags = ("--pace-replication", "--pace-max-wait", "5") if paced else ()
    ring = start_ring(2, "--replicas", "1", *flags)
    snapshot(ring.daemons[0], 1)  # registers the rank (bubbles need it) and warms up
    pushed(ring.daemons[0], 1)
    stream = Bubbles(ring.daemons[0])
    try:
        for iteration in range(4):  # profiles the iteration length: windows are predicted
            stream.iteration = iteration
            stream.send(pb.BubbleEvent.START, expected_seconds=0.6)
            time.sleep(0.6)
            stream.send(pb.BubbleEvent.REPORT, iteration_seconds=1.5, reports=[
                pb.BubbleReport(position=1, measured_seconds=0.6)])
            time.sleep(0.9 if iteration < 3 else 0.05)
        committed = time.monotonic()
        snapshot(ring.daemons[0], 2)
        stream.iteration = 4
        time.sleep(max(0.0, committed + 0.7 - time.monotonic()))
        stream.send(pb.BubbleEvent.START, expected_seconds=0.6)
        push = pushed(ring.daemons[0], 2)
    finally:
        stream.close()
    assert push.paced is paced and push.peers == 1 and push.nbytes >= STATE["w"].nbytes
    assert push.push_seconds > 0 and push.idle_bytes <= push.nbytes
    shown = format_status(ring.daemons[0].stub.Status(pb.StatusRequest(job=JOB), timeout=10))
    assert ("replication (paced into bubbles)" if paced else "replication (not paced)") in shown
    if paced:
        assert push.idle_bytes == push.nbytes, push
        assert push.copies_seconds >= push.waited_seconds + push.push_seconds * 0.99
    else:
        assert push.waited_seconds == 0, push


def test_the_wait_bound_is_honoured_when_no_bubbles_come(start_ring):
    """A stage announced a bubble and then none came (its iteration length not known):
    the push waits for one up to --pace-max-wait, then goes: not before the bound,
    by the daemon's own clock (the record's time from commit to acknowledgement)."""
    ring = start_ring(2, "--replicas", "1", "--pace-replication", "--pace-max-wait", "1")
    snapshot(ring.daemons[0], 1)
    # a call of its own: it ends once the daemon has taken both events
    assert list(ring.daemons[0].stub.Bubbles(iter([
        pb.BubbleEvent(job=JOB, rank=0, kind=kind, iteration=0, position=1, **fields)
        for kind, fields in ((pb.BubbleEvent.START, {}),
                             (pb.BubbleEvent.END, {"measured_seconds": 0.05}))]),
        timeout=30)) == []
    snapshot(ring.daemons[0], 2)
    push = pushed(ring.daemons[0], 2)
    assert push.paced and push.peers == 1
    assert push.copies_seconds >= 1.0, push  # the bound, from the commit on
    assert push.idle_bytes == 0, push


def holdings_answered(daemon) -> float:
    """Holdings calls ``daemon`` answered (its peers' gatherings), from its metrics."""
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                  timeout=10).read().decode()
    found = re.search(r'bubblesnap_rpcs_total\{code="OK",method="Holdings"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def steps_held(daemon) -> list[int]:
    jobs = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs
    return [s.step for s in jobs[0].steps if s.ranks] if jobs else []


def bubble_events(daemon, iteration: int, *events) -> None:
    """Hands the daemon (kind, fields) bubble events of rank 0 on a call of their own,
    which ends once it has taken them all."""
    assert list(daemon.stub.Bubbles(iter([
        pb.BubbleEvent(job=JOB, rank=0, kind=kind, iteration=iteration, position=1, **fields)
        for kind, fields in events]), timeout=30)) == []


def test_the_coalescing_pushes_the_roundest_then_the_newest_and_no_other(start_ring):
    """Replication behind training: steps 3, 4 and 5 commit while step 2's push waits
    for a bubble (or with it, when the replicator had not taken 2 yet); the roundest
    (4) is pushed, then the newest (5), which waited for the next round (a run that
    stops after step 5 must not leave its newest step with one copy), and 3 never.
    The periodic refreshes after that (each gathers the peer's holdings) re-replicate
    only copies that lost a holder: 3 is not sent unpaced behind the pacing's back."""
    ring = start_ring(2, "--replicas", "1", "--pace-replication", "--pace-max-wait", "60")
    sender, peer = ring.daemons
    snapshot(sender, 1)  # registers the rank; pushed at once (no bubbles known yet)
    pushed(sender, 1)
    # a bubble seen (closed at once), and the next one due in 50 s: a push waits for
    # it (or a START)
    bubble_events(sender, 0, (pb.BubbleEvent.START, {"expected_seconds": 0.05}),
                  (pb.BubbleEvent.END, {"measured_seconds": 0.0}),
                  (pb.BubbleEvent.REPORT, {"iteration_seconds": 50.0, "reports": [
                      pb.BubbleReport(position=1, measured_seconds=0.05)]}))
    for step in (2, 3, 4, 5):
        snapshot(sender, step)
    assert pushes(sender, 2) == []  # held for a bubble
    bubble_events(sender, 1, (pb.BubbleEvent.START, {"expected_seconds": 60}))  # idle now
    pushed(sender, 4)
    pushed(sender, 5)
    wait_for(lambda: {4, 5} <= set(steps_held(peer)), "steps 4 and 5 on the peer")
    gathered = holdings_answered(peer)
    wait_for(lambda: holdings_answered(peer) >= gathered + 3, "three more gatherings")
    assert pushes(sender, 3) == [] and 3 not in steps_held(peer), steps_held(peer)


# How much of a copy larger than a bubble goes inside the windows, piece by piece, is a
# measurement of stages keeping real time, not a check: benchmarks/overhead.py measures
# it (its paced mode: in_bubbles_fraction) in a running pipeline. Above, the pieces' gate
# (test_a_gated_offer_asks_its_gate_before_every_piece) and its decision (pacing.push_at,
# idle_state) are checked on their own.
