"""The peer side against outsiders: a data-channel ticket is read once and only for its
ranges, silent or slow connections do not hold up a transfer, Join checks its address.

Two daemons in a ring, separate processes on loopback ports; the tickets come from their
peer port (no token here, as in a ring on loopback).
"""

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.service.errors import Aborted
from bubblesnap.service.peers import data_channel
from bubblesnap.testing import wait_for

STATE = {"a": np.arange(1 << 16, dtype=np.float32), "b": np.arange(1 << 12, dtype=np.int32)}


@pytest.fixture
def ring(start_ring):
    """Two daemons; daemon 0 holds step 1 of job "chan", committed (replicated to 1)."""
    ring = start_ring(2, "--replicas", "1")
    client = NumpyClient("chan", options=ClientOptions(daemon=ring.daemons[0].address))
    assert client.snapshot(1, STATE, wait="job").committed
    client.close()
    return ring


def peer_stub(ring) -> peer_pb2_grpc.PeerStub:
    """Daemon 0's peer port."""
    return peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[0]))


def open_read(ring, slots=()) -> ppb.OpenReadResponse:
    return peer_stub(ring).OpenRead(ppb.OpenReadRequest(job="chan", rank=0, step=1, slots=slots),
                         timeout=10)


def read(opened, ranges):
    return data_channel.read_ranges(opened.data_address, opened.ticket, ranges, None, 10, "x")


def test_a_ticket_is_read_once_and_only_for_its_ranges(ring):
    opened = open_read(ring, slots=[1])
    where = [(s.offset, s.offset + s.nbytes) for s in opened.slots]
    with pytest.raises(Aborted):  # slot 0 was not offered
        read(opened, [where[0]])
    [(data, digest)] = read(opened, [where[1]])
    assert digest == opened.checksums[1] and bytes(data) == STATE["b"].tobytes()
    with pytest.raises(Aborted):  # read already: the ticket is spent
        read(opened, [where[1]])

    whole = open_read(ring)  # the whole copy, in parallel ranged pulls
    view = bytearray(whole.segment_bytes)
    fill = data_channel.puller(whole.data_address, whole.ticket, None, 10, "x", streams=2)
    slots = tuple((s.offset, s.nbytes) for s in whole.slots)
    assert fill(view, slots) == tuple(whole.checksums)
    with pytest.raises(Aborted):
        fill(bytearray(whole.segment_bytes), slots)
    half = open_read(ring)
    first = (whole.slots[0].offset, whole.slots[0].offset + whole.slots[0].nbytes)
    read(half, [first])
    with pytest.raises(Aborted):  # overlaps the bytes read by the first connection
        read(half, [(first[1] - 4, first[1] + 4)])


def _outsiders(address: str, count: int) -> tuple[list[socket.socket], threading.Event]:
    """``count`` connections to ``address``: half send nothing, half a byte a second."""
    host, port = address.rsplit(":", 1)
    conns = [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]
    stop = threading.Event()

    def trickle():
        while not stop.wait(1.0):
            for conn in conns[1::2]:
                try:
                    conn.send(b"x")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    return conns, stop


def _closed(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_transfer_goes_through_a_hundred_silent_and_slow_connections(ring):
    """The replica push of daemon 0 to daemon 1 pulls from daemon 0's data channel while
    100 outsiders hold connections to it. They once took all 64 slots, half of them for
    as long as they trickled; the job must commit within its 20 s commit timeout."""
    client = NumpyClient("crowd", options=ClientOptions(daemon=ring.daemons[0].address,
                                                        commit_timeout_seconds=20))
    state = {"w": np.arange(1 << 20, dtype=np.float32)}
    started = time.perf_counter()
    assert client.snapshot(0, state, wait="job").committed
    alone = time.perf_counter() - started
    conns, stop = _outsiders(ring.daemons[0].ready["data_address"], 100)
    try:
        started = time.perf_counter()
        result = client.snapshot(1, state, wait="job")
        crowded = time.perf_counter() - started
        assert result.committed, result.reason
        print(f"\nstep committed (4 MiB replicated) in {alone:.3f} s alone, {crowded:.3f} s "
              "with 100 outsider connections open")
        # the daemon closes every one of them: none sent a ticket in time
        wait_for(lambda: all(_closed(c) for c in conns), "the outsiders closed", timeout=30)
    finally:
        stop.set()
        for conn in conns:
            conn.close()
        client.close()


def test_join_refuses_an_address_that_is_not_host_port(ring):
    peer = peer_stub(ring)
    for address in ("", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "unix:///tmp/x.sock",
                    "http://h:1", "h:1/x", "h :1", "::1:7072", "h:+1", "h:١٢", "a" * 300 + ":1"):
        with pytest.raises(grpc.RpcError) as info:
            peer.Join(ppb.JoinRequest(index=1, address=address), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, address
        assert "ring index 1" in info.value.details() and len(info.value.details()) < 400
    # the ring kept daemon 1's address: it still replicates there
    client = NumpyClient("chan", options=ClientOptions(daemon=ring.daemons[0].address))
    assert client.snapshot(2, STATE, wait="job").committed
    client.close()
