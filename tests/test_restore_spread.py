"""A copy several peers hold is pulled from all of them at once, each its share of the slots;
a holder that breaks off or sends bad bytes hands its share to another.

The ring tests run four daemons as processes on loopback ports with
``--replicas 2``: rank 0's copy lives on daemons 0, 1 and 2, and daemon 3,
which lacks it, restores it (over plain TCP and over mutual TLS). The bytes
each holder's data channel sent come from its metrics. The ``SpreadPull``
tests feed it holders whose failures are exact.
"""

import socket
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.errors import Aborted
from bubblesnap.service.peers import data_channel
from bubblesnap.service.peers.spread import SpreadPull, groups
from bubblesnap.testing import wait_for
from tests.test_peer_tls import make_certificates

JOB = "spread"
WORLD = 4


def state(rank: int, mib: int = 1) -> dict[str, np.ndarray]:
    """Rank 0 has six tensors (slots to deal out), the others one small one."""
    if rank:
        return {"w": np.full(1024, rank, dtype=np.float32)}
    n = mib << 18
    return {f"t{i}": np.arange(n, dtype=np.float32) * (i + 1) for i in range(6)}


def snapshot(ring, mib: int = 1) -> None:
    # Every daemon must see every peer first: a peer missed at start-up (a loaded
    # machine) is passed over, and rank 0's replicas would land on daemon 3, which is
    # to restore it from peers.
    wait_for(lambda: all(metric(d, "bubblesnap_peers_alive") == WORLD for d in ring.daemons),
             "every daemon sees the whole ring")
    clients = [NumpyClient(JOB, r, WORLD, ClientOptions(daemon=ring.daemons[r].address))
               for r in range(WORLD)]
    for rank, client in enumerate(clients):
        assert client.snapshot(1, state(rank, mib)).taken
    for client in clients:
        client.close()
    wait_for(lambda: any(s.step == 1 and s.committed for s in ring.daemons[0].stub.Status(
        pb.StatusRequest(job=JOB), timeout=10).jobs[0].steps), "step 1 committed, 3 copies")


def metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                  timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name)


def sent(daemon) -> float:
    """What the daemon's data channel sent so far, from its metrics."""
    return metric(daemon, "bubblesnap_data_sent_bytes_total")


def restore_rank_0(daemon, mib: int = 1) -> pb.RestoreResponse:
    """Rank 0's step-1 copy restored at ``daemon``; its bytes checked against the state."""
    found = daemon.stub.Restore(pb.RestoreRequest(job=JOB, rank=0, world_size=WORLD),
                                timeout=60)
    assert (found.step, found.source) == (1, "peer")
    with open(found.segment_path, "rb") as f:
        segment = f.read()
    for slot in found.slots:
        expected = state(0, mib)[found.tensors[slot.tensor].name]
        assert segment[slot.offset:slot.offset + slot.nbytes] == expected.tobytes()
    return found


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_copy_three_peers_hold_comes_from_all_three(start_ring, tmp_path, tls):
    flags = []
    if tls:  # peer calls and the data channel over mutual TLS, with a token
        certs = make_certificates(tmp_path)
        flags = ["--peer-tls-cert", certs["host.pem"], "--peer-tls-key", certs["host.key"],
                 "--peer-tls-ca", certs["ca.pem"], "--peer-tls-client-auth"]
    ring = start_ring(WORLD, "--replicas", "2", *flags, env={"BUBBLESNAP_PEER_TOKEN": "tok"})
    snapshot(ring)
    before = [sent(d) for d in ring.daemons]
    found = restore_rank_0(ring.daemons[3])
    after = [sent(d) for d in ring.daemons]
    shares = [b - a for a, b in zip(before, after, strict=True)]
    # Each holder sent its share, every byte of the copy once; the restorer sent nothing.
    assert all(share > 0 for share in shares[:3]), shares
    assert sum(shares) == sum(s.nbytes for s in found.slots) and shares[3] == 0, shares
    assert found.source_detail.split(", ") == ring.peers[:3]
    assert "open" in {p.name for p in found.phases}


def _block_sends(ring, index: int) -> list[socket.socket]:
    """Takes every send slot of daemon ``index``'s data channel: connections with good
    tickets for its copy of rank 0 that never read, so what it sends next waits.
    Returns once each of them is sending."""
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[index]))
    held = []
    for _ in range(64):
        opened = stub.OpenRead(ppb.OpenReadRequest(job=JOB, rank=0, step=1), timeout=10)
        host, port = opened.data_address.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.sendall(data_channel.HEADER.pack(opened.ticket, 0, opened.segment_bytes))
        held.append(conn)
    # A connection holds a send slot once its first bytes come: until then the selector
    # may not have admitted it, and the restorer's connection could take its slot.
    for conn in held:
        conn.settimeout(60)
        assert conn.recv(1, socket.MSG_PEEK), "a held connection was closed before sending"
    return held


def test_a_holder_killed_mid_pull_hands_its_share_to_the_others(start_ring):
    ring = start_ring(WORLD, "--replicas", "2")
    snapshot(ring, mib=8)  # 48 MiB: more than the socket buffers of a blocked send hold
    held = _block_sends(ring, 1)
    before = [sent(d) for d in ring.daemons]
    answer: list = []
    restoring = threading.Thread(target=lambda: answer.append(restore_rank_0(ring.daemons[3], 8)))
    restoring.start()
    # Holders 0 and 2 sent their shares; holder 1's waits for a send slot.
    wait_for(lambda: all(sent(ring.daemons[i]) > before[i] for i in (0, 2)),
             "holders 0 and 2 sent their shares")
    assert restoring.is_alive()
    ring.daemons[1].kill()
    restoring.join(timeout=60)
    for conn in held:
        conn.close()
    [found] = answer
    assert found.source_detail.split(", ") == [ring.peers[0], ring.peers[2]]
    total = sum(s.nbytes for s in found.slots)
    assert sent(ring.daemons[0]) - before[0] + sent(ring.daemons[2]) - before[2] == total


# -- SpreadPull against holders whose failures are exact ---------------------------------

SLOTS = [(i * 64, 64) for i in range(6)]
COPY = bytes(range(256)) + bytes(range(128))


class Holders:
    """Holder i serves ``COPY``; ``broken`` ones close after a few bytes, ``bad`` ones send
    one flipped byte, and those in ``gone`` refuse to offer."""

    def __init__(self, broken=(), bad=(), gone=()):
        self.broken, self.bad, self.gone = set(broken), set(bad), set(gone)
        self.offers: list[tuple[int, list[int]]] = []
        self.corrupt: list[int] = []

    def offer(self, index: int, share: list[int]) -> tuple[str, bytes]:
        if index in self.gone:
            raise Aborted(f"peer {index} is gone")
        self.offers.append((index, share))
        return f"127.0.0.1:{index + 1}", b"t"

    def pull_range(self, address, ticket, view, start, stop, received) -> None:
        index = int(address.rsplit(":", 1)[1]) - 1
        if index in self.broken:
            view[start:start + 8] = COPY[start:start + 8]
            received(start, start + 8)
            raise ConnectionError(f"{address} closed the data channel")
        view[start:stop] = COPY[start:stop]
        if index in self.bad:
            view[start] ^= 0xFF
        received(start, stop)

    def pull(self, holders, streams: int = 2) -> tuple[SpreadPull, bytearray, tuple]:
        checksums = tuple(checksum(COPY[o:o + n]) for o, n in SLOTS)
        spread = SpreadPull(holders, self.offer, self.pull_range, checksums, "the copy",
                            lambda index, detail: self.corrupt.append(index), streams)
        view = bytearray(len(COPY))
        spread.open(SLOTS, len(view))
        return spread, view, spread.fill(view, SLOTS)


def test_groups_are_contiguous_and_whole_slots():
    found = groups(SLOTS, 384, 3)
    assert [list(g.indices) for g in found] == [[0, 1], [2, 3], [4, 5]]
    assert [g.runs() for g in found] == [[(0, 128)], [(128, 256)], [(256, 384)]]
    assert groups([(0, 10), (64, 0), (64, 64)], 128, 1)[0].runs() == [(0, 10), (64, 128)]


def test_every_holder_sends_its_share():
    holders = Holders()
    spread, view, digests = holders.pull([0, 1, 2])
    assert bytes(view) == COPY and digests == tuple(checksum(COPY[o:o + n]) for o, n in SLOTS)
    assert holders.offers == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])]
    assert spread.served == [0, 1, 2]


def test_a_broken_or_bad_holder_hands_its_share_to_another():
    holders = Holders(broken=[1], bad=[2], gone=[3])
    spread, view, _ = holders.pull([0, 1, 2, 3], streams=4)
    assert bytes(view) == COPY and spread.served == [0]
    assert holders.corrupt == [2]  # reported once, though it sent one group


def test_no_holder_left_is_a_precise_error():
    holders = Holders(broken=[0], bad=[1])
    with pytest.raises(Aborted, match=r"could send slots \[0, 1, 2, 3, 4, 5\]|slots \[") as err:
        holders.pull([0, 1])
    assert "peer 0: pulling from 127.0.0.1:1 failed" in str(err.value)
    assert "peer 1: slots" in str(err.value) and "checksums" in str(err.value)
