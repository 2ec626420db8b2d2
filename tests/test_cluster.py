"""bubblesnap.testing.Cluster: hosts in network namespaces, and the faults it makes are the
faults the daemons see (a partition, a frozen daemon, a slow link); nothing it made is
left once it closed, or once the process that made it was SIGKILLed."""

import json
import os
import signal
import subprocess
import sys

import pytest

from bubblesnap.testing import cluster as cluster_module
from bubblesnap.testing import wait_for


def leftovers(tag: str) -> list[str]:
    """Namespaces and links named for cluster ``tag`` that still exist."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in (names + links).splitlines() if tag in line]


def sees(cluster, host: int) -> set[int]:
    return cluster.daemons[host].peers_seen()


def test_a_partition_is_seen_by_both_sides_and_healed(start_cluster):
    cluster = start_cluster(3, "--dead-after", "1")
    cluster.partition([0], [1, 2])
    wait_for(lambda: sees(cluster, 0) == {0} and sees(cluster, 1) == sees(cluster, 2) == {1, 2},
             "each side of the partition to see only itself")
    cluster.heal()
    wait_for(lambda: all(sees(cluster, h) == {0, 1, 2} for h in range(3)),
             "every daemon to see every other one after the heal")


def test_a_frozen_daemon_is_declared_dead_and_seen_again_after_the_thaw(start_cluster):
    cluster = start_cluster(3, "--dead-after", "1")
    cluster.freeze(1)
    assert cluster.daemons[1].alive()  # stopped, not gone
    wait_for(lambda: sees(cluster, 0) == sees(cluster, 2) == {0, 2},
             "the others to declare the frozen daemon dead")
    cluster.thaw(1)
    wait_for(lambda: all(sees(cluster, h) == {0, 1, 2} for h in range(3)),
             "every daemon to see every other one after the thaw")


def test_slow_shapes_the_hosts_link_both_ways_and_back(start_cluster):
    cluster = start_cluster(2, rate="1gbit")
    host = cluster.hosts[1]

    def rates() -> list[str]:
        shown = [subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "show",
                                 "dev", "eth0"], capture_output=True, text=True).stdout,
                 subprocess.run(["tc", "qdisc", "show", "dev", host.link],
                                capture_output=True, text=True).stdout]
        return [word for text in shown for word in text.split() if word.endswith("bit")]
    assert rates() == ["1Gbit", "1Gbit"]
    cluster.slow(1, "100mbit")
    assert rates() == ["100Mbit", "100Mbit"]
    cluster.slow(1, None)
    assert rates() == ["1Gbit", "1Gbit"]


def test_nothing_is_left_after_close(start_cluster):
    cluster = start_cluster(2, etcd=True)
    pids = [d.proc.pid for d in cluster.daemons] + [cluster.etcd.proc.pid]
    assert len(leftovers(cluster.tag)) == 3 + 1 + 3  # namespaces (etcd's too); bridge; veths
    cluster.close()
    assert leftovers(cluster.tag) == []
    assert all(not _running(pid) for pid in pids)


def test_nothing_is_left_when_the_maker_is_killed(start_cluster):
    # start_cluster: skipped where no cluster can be made; this one is made by a child
    maker = subprocess.Popen([sys.executable, "-c", """if True:
        import json, sys, time
        from bubblesnap.testing import Cluster
        cluster = Cluster(2)
        print(json.dumps({"tag": cluster.tag, "pids": [d.proc.pid for d in cluster.daemons],
                          "directory": cluster.directory}), flush=True)
        time.sleep(600)"""], stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(maker.stdout.readline())
        assert leftovers(made["tag"])
    finally:
        maker.send_signal(signal.SIGKILL)
        maker.wait()
    wait_for(lambda: not leftovers(made["tag"]) and not any(map(_running, made["pids"]))
             and not os.path.exists(made["directory"]),
             "the reaper to remove the killed maker's network, daemons and logs")


def test_a_probe_left_by_a_killed_process_is_removed(start_cluster):
    # start_cluster: skipped where no cluster can be made
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs, as a SIGKILLed run's between add and del
    subprocess.run(["ip", "netns", "add", f"bsprobe-{gone.pid}"], check=True)
    try:
        assert cluster_module.unavailable() is None
        assert leftovers(f"bsprobe-{gone.pid}") == []
    finally:
        subprocess.run(["ip", "netns", "del", f"bsprobe-{gone.pid}"], capture_output=True)


def test_without_root_it_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(cluster_module.os, "geteuid", lambda: 1000)
    reason = cluster_module.unavailable()
    assert "root" in reason and "\n" not in reason
    with pytest.raises(cluster_module.ClusterError, match="needs root"):
        cluster_module.Cluster(2)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False
