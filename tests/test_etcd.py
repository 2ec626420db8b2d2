"""The etcd coordination backend against a real etcd server: membership from leases,
holdings and commits as keys, host loss, replacement, re-replication, and etcd itself
restarted under a running ring. Daemons are processes on loopback; hosts die by SIGKILL.
"""

import logging
import socket
import subprocess
import sys

import pytest
from etcd3gw.client import Etcd3Client

from bubblesnap.service.coordination import keys as keys_lib
from bubblesnap.service.coordination.etcd_kv import EtcdKV, parse_endpoints
from bubblesnap.testing import free_port, wait_for
from tests.test_peers import assert_restores, committed, job_status, snapshot_steps

JOB = "ring"
FLAGS = ("--replicas", "1", "--dead-after", "2")


def keys(etcd, prefix: str) -> dict[str, bytes]:
    return EtcdKV(parse_endpoints(etcd.url)).range(prefix)[1]


def slots(etcd, prefix: str) -> dict[int, str]:
    return {int(k.rsplit("/", 1)[1]): v.decode()
            for k, v in keys(etcd, f"{prefix}/slots/").items()}


def holders(etcd, prefix: str, rank: int, step: int) -> set[int]:
    found = keys(etcd, f"{prefix}/holdings/{JOB}/{rank:012d}/{step:012d}/")
    return {int(k.rsplit("/", 1)[1]) for k in found}


def test_a_ring_over_etcd_commits_loses_a_host_and_takes_a_replacement(start_etcd_ring, etcd):
    ring = start_etcd_ring(3, *FLAGS)
    prefix = start_etcd_ring.prefix
    assert slots(etcd, prefix) == dict(enumerate(ring.peers))
    snapshot_steps(ring, range(4))
    wait_for(lambda: committed(ring.daemons[0], 3), "step 3 committed through etcd")
    # each rank's copy is published by the daemon holding it and its ring successor
    assert [holders(etcd, prefix, rank, 3) for rank in range(3)] == [{0, 1}, {1, 2}, {2, 0}]

    ring.daemons[1].kill()
    # no daemon asks: etcd drops host 1's slot and copies when its lease runs out
    wait_for(lambda: 1 not in slots(etcd, prefix), "host 1's lease to run out", timeout=30)

    def back_to_two_copies():
        rows = [(r.rank, s.step, r.copies) for s in job_status(ring.daemons[2]).steps
                for r in s.ranks if s.step == 3]
        return sorted(rows) == [(0, 3, 2), (1, 3, 2), (2, 3, 2)] and rows
    wait_for(back_to_two_copies, "re-replication after host 1 died")
    assert holders(etcd, prefix, 0, 3) == {0, 2}

    replacement = ring.replace(1)  # not told its index: it takes the free position
    assert replacement.ready["peer_index"] == 1
    assert slots(etcd, prefix)[1] == ring.peers[1]
    assert_restores(replacement, 1, 3, "peer")
    assert_restores(ring.daemons[0], 0, 3, "memory")
    assert_restores(ring.daemons[2], 2, 3, "memory")


def test_etcd_restarted_under_a_running_ring(start_etcd_ring, etcd):
    ring = start_etcd_ring(3, *FLAGS)
    prefix = start_etcd_ring.prefix
    snapshot_steps(ring, range(2))
    wait_for(lambda: committed(ring.daemons[0], 1), "step 1 committed")
    etcd.kill()
    try:
        # Without etcd the daemons keep what they hold, take new snapshots, and a
        # restore finds the job's step by asking the peers etcd listed last.
        snapshot_steps(ring, [2])
        assert not committed(ring.daemons[0], 2)  # no agreement without etcd
        assert_restores(ring.daemons[0], 0, 2, "memory")
    finally:
        etcd.start()
    # leases and keys survive the restart; new steps commit again
    assert slots(etcd, prefix) == dict(enumerate(ring.peers))
    snapshot_steps(ring, [3])
    wait_for(lambda: committed(ring.daemons[0], 3), "step 3 committed after etcd came back")
    for rank in range(3):
        assert_restores(ring.daemons[rank], rank, 3, "memory")


def test_a_daemon_whose_lease_ran_out_takes_its_place_again(start_etcd_ring, etcd):
    ring = start_etcd_ring(2, *FLAGS)
    prefix = start_etcd_ring.prefix
    snapshot_steps(ring, range(2), world=2)
    wait_for(lambda: committed(ring.daemons[0], 1), "step 1 committed")
    gateway = Etcd3Client(port=etcd.client_port, api_path="/v3/")
    (_, meta), = gateway.get(f"{prefix}/slots/{1:012d}", metadata=True)
    gateway.post(gateway.get_url("/kv/lease/revoke"), json={"ID": int(meta["lease"])})
    assert 1 not in slots(etcd, prefix) and holders(etcd, prefix, 1, 1) == {0}
    # Daemon 1 finds its lease gone at the next renewal: it takes position 1 again
    # and publishes its copies and layouts anew.
    wait_for(lambda: holders(etcd, prefix, 1, 1) == {0, 1} and 1 in slots(etcd, prefix),
             "daemon 1 back in etcd", timeout=30)
    assert keys(etcd, f"{prefix}/layouts/{JOB}/")
    snapshot_steps(ring, [2], world=2)
    wait_for(lambda: committed(ring.daemons[1], 2), "step 2 committed")


def daemon_exit(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bubblesnap", "daemon", "--listen",
                           "127.0.0.1:0", "--metrics", "", *flags],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flags, words", [
    (("--coordination", "etcd://127.0.0.1:{port}", "--group-size", "3",
      "--peer-listen", "127.0.0.1:{port2}"), "etcd did not answer"),
    (("--coordination", "etcd://127.0.0.1:{port}", "--peer-listen", "127.0.0.1:{port2}"),
     "--group-size must be 2 or more"),
    (("--coordination", "http://127.0.0.1:{port}", "--group-size", "3"), "--coordination must"),
    (("--coordination", "etcd://127.0.0.1:{port}", "--group-size", "3"),
     "--peer-listen must be the HOST:PORT peers dial"),
    (("--coordination", "etcd://127.0.0.1:{port}", "--peers", "a:1,b:2"),
     "give no --peers"),
])
def test_coordination_flags_that_cannot_work_stop_the_daemon_saying_why(flags, words):
    ports = {"port": free_port(), "port2": free_port()}
    done = daemon_exit(*(f.format(**ports) for f in flags))
    assert done.returncode != 0
    assert words in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_keys_no_daemon_wrote_are_ignored_and_the_group_goes_on(start_etcd_ring, etcd):
    ring = start_etcd_ring(2, *FLAGS)
    prefix = start_etcd_ring.prefix
    kv = EtcdKV(parse_endpoints(etcd.url))
    kv.apply({f"{prefix}/slots/junk": b"x", f"{prefix}/summary/{JOB}": b"{not json",
              f"{prefix}/holdings/{JOB}/{0:012d}/{1:012d}/junk": b"\xff\x00garbage",
              f"{prefix}/layouts/{JOB}/{7:012d}": b"\xff\x00garbage"})
    snapshot_steps(ring, range(2), world=2)
    wait_for(lambda: committed(ring.daemons[0], 1) and committed(ring.daemons[1], 1),
             "step 1 committed despite the junk keys")
    assert_restores(ring.daemons[1], 1, 1, "memory", world=2)


def test_writes_and_reads_past_etcds_transaction_limit_are_batched(etcd):
    kv = EtcdKV(parse_endpoints(etcd.url))
    puts = {f"/test/batched/{i:04d}": bytes([i % 256]) * 3 for i in range(300)}
    kv.apply(puts)  # one transaction would pass etcd's 128 operations
    revision, found = kv.ranges([f"/test/batched/{i:04d}" for i in range(300)])
    assert revision > 0 and [next(iter(f.values())) for f in found] == list(puts.values())
    kv.apply({}, list(puts))
    assert kv.range("/test/batched/")[1] == {}


def test_a_daemon_that_cannot_bind_its_peer_port_publishes_no_slot(etcd, start_etcd_ring):
    # Another process holds the port: peers must never be sent to dial it as ours (a
    # slot published before the bind stayed until its lease ran out, and its peers'
    # pushes went to whatever listened there).
    prefix = start_etcd_ring.prefix
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = daemon_exit("--coordination", etcd.url, "--coordination-prefix", prefix,
                           "--group-size", "2", "--peer-listen", f"127.0.0.1:{port}")
    assert done.returncode != 0 and "cannot listen" in done.stderr, done.stderr[-2000:]
    assert slots(etcd, prefix) == {}


def test_a_key_no_daemon_wrote_is_warned_about_once(caplog):
    # every read of the prefix meets it again (several a second): one line, not one a read
    junk = [("/p/holdings/job/000000000000/000000000001/junk", b"\xff\x00garbage")]
    with caplog.at_level(logging.WARNING, logger="bubblesnap.daemon"):
        for _ in range(3):
            assert keys_lib.parse_holdings(junk) == []
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring etcd key /p/holdings/job/000000000000/000000000001/junk: not a HeldCopy "
        "(said once per key)"]
