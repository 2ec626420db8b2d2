"""Peer calls name their group: a daemon of another group that dials a member (an
address reused, a port two tests both chose) is refused and joins nothing.

A two-daemon ring on loopback and a stranger daemon whose --peers list names the
ring's daemon 0 as its own peer 0.
"""

import urllib.request

import grpc
import pytest

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.service.peers import group_name
from bubblesnap.testing import free_port, wait_for
from tests.test_peers import JOB, assert_restores, committed, snapshot_steps


def peers_alive(daemon) -> list[str]:
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                  timeout=10).read().decode()
    return [line for line in text.splitlines() if line.startswith("bubblesnap_peer_alive{")]


def test_a_daemon_of_another_group_that_dials_a_member_is_refused(start_ring, start_daemon,
                                                                   tmp_path):
    ring = start_ring(2, "--replicas", "1")
    # Its Join, at start, would re-point daemon 0's peer 1 at the stranger.
    stranger = start_daemon("--peers", f"{ring.peers[0]},127.0.0.1:{free_port()}",
                            "--index", "1", "--replicas", "1", "--group-name", "other",
                            stderr=tmp_path / "stranger.log")
    assert "refused the join" in stranger.stderr_text()
    assert 'bubblesnap_peer_alive{peer="0"} 0.0' in peers_alive(stranger)
    # The ring goes on with its own peer 1: both daemons take the step, each rank's
    # copy twice, and daemon 0 restores rank 1's copy from its own memory.
    snapshot_steps(ring, [1], world=2)
    wait_for(lambda: committed(ring.daemons[0], 1) and committed(ring.daemons[1], 1),
             "step 1 committed in the ring")
    assert_restores(ring.daemons[0], 1, 1, "memory", world=2)
    # A call that names another group is told why.
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[0]))
    with pytest.raises(grpc.RpcError) as info:
        stub.Holdings(ppb.HoldingsRequest(job=JOB), metadata=group_name.metadata("other"),
                      timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--group-name" in info.value.details() and len(info.value.details()) < 1000
    assert stub.Holdings(ppb.HoldingsRequest(job=JOB), metadata=group_name.metadata(
        ring.group_name), timeout=10) is not None
