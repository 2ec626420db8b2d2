"""bubblesnap.testing: the daemon processes every test, example and benchmark starts."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import DaemonError, DaemonProcess, Ring, free_port, wait_for


def test_a_daemon_is_ready_healthy_and_stops_cleanly_with_its_own_shm_dir(tmp_path):
    log = tmp_path / "daemon.log"
    with DaemonProcess("--keep", "1", own_shm_dir=True, stderr=log, log_level="INFO") as daemon:
        assert daemon.ready["event"] == "ready" and daemon.ready["pid"] == daemon.proc.pid
        assert os.path.dirname(daemon.shm_dir) == daemon.own_shm_dir
        assert daemon.healthy()
        assert daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.shm_dir == \
            daemon.shm_dir
    assert daemon.exit_code == 0
    assert not daemon.healthy(timeout=1)
    assert not os.path.exists(daemon.own_shm_dir)
    assert "shutting down" in daemon.stderr_text()


def test_stop_kills_a_daemon_that_ignores_sigterm():
    daemon = DaemonProcess(own_shm_dir=True)
    daemon.proc.send_signal(signal.SIGSTOP)  # SIGTERM stays pending
    started = time.monotonic()
    assert daemon.stop(timeout=1) == -signal.SIGKILL
    assert time.monotonic() - started < 20


def test_kill_is_sigkill_and_leaves_nothing_in_its_own_shm_dir():
    daemon = DaemonProcess(own_shm_dir=True)
    assert daemon.kill() == -signal.SIGKILL
    assert not daemon.alive() and not os.path.exists(daemon.own_shm_dir)


def test_a_free_port_is_one_no_outgoing_connection_can_take():
    """Below the kernel's ephemeral range (where it leaves room), free, and never one
    given before (a ring draws all its ports before a daemon binds one)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    if ephemeral_low <= 10000:
        pytest.skip(f"the ephemeral range starts at {ephemeral_low}: no room below it")
    ports = {free_port() for _ in range(200)}
    assert len(ports) == 200
    assert all(port < ephemeral_low for port in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_daemon_that_cannot_start_raises_with_its_log(tmp_path):
    port = free_port()
    with DaemonProcess("--listen", f"127.0.0.1:{port}"), \
            pytest.raises(DaemonError, match=r"(?s)exited with code \d+: .*cannot listen"):
        DaemonProcess("--listen", f"127.0.0.1:{port}", stderr=tmp_path / "second.log")


def test_a_ring_replaces_a_host_and_stops_every_daemon_it_started():
    ring = Ring(2, "--replicas", "1")
    try:
        first = ring.daemons[1]
        first.kill()
        replacement = ring.replace(1)
        assert replacement is ring.daemons[1] and replacement.alive()
        assert ring.addresses == [d.address for d in ring.daemons]
        assert ring.peers[1] == replacement.ready["peer_address"]
        assert wait_for(ring.daemons[0].healthy, "daemon 0 healthy", timeout=30)
    finally:
        ring.stop()
    assert [d.exit_code for d in ring.started] == [0, -signal.SIGKILL, 0]


def test_wait_for_returns_what_it_awaited_and_names_it_when_it_gives_up():
    answers = iter([None, grpc.RpcError(), "there"])

    def check():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_for(check, "an answer", interval=0.01) == "there"
    with pytest.raises(TimeoutError, match="waiting for nothing"):
        wait_for(lambda: False, "nothing", timeout=0.1, interval=0.01)
    with pytest.raises(RuntimeError, match="while waiting for x: it broke"):
        wait_for(lambda: False, "x", failed=lambda: "it broke")


_STARTER = """
import json, os, signal, sys
from bubblesnap.testing import DaemonProcess, EtcdServer, Ring
etcd = EtcdServer(sys.argv[1])
ring = Ring(2, "--replicas", "1")
lone = DaemonProcess(own_shm_dir=True)
lone.proc.send_signal(signal.SIGSTOP)  # a frozen host dies too
daemons = [*ring.daemons, lone]
print(json.dumps({"pids": [d.proc.pid for d in daemons] + [etcd.proc.pid],
                  "dirs": [d.shm_dir for d in daemons] + [lone.own_shm_dir]}), flush=True)
signal.pause()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie awaits its reaping
    except FileNotFoundError:
        return True


def test_what_a_process_started_dies_with_it_even_when_it_is_sigkilled(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(starter.stdout.readline())
        assert all(os.path.isdir(d) for d in started["dirs"])
        assert not any(_gone(pid) for pid in started["pids"])
    finally:
        starter.kill()
        starter.wait()
    wait_for(lambda: all(_gone(pid) for pid in started["pids"]),
             "the daemons and etcd to die with their starter", timeout=60)
    wait_for(lambda: not any(os.path.exists(d) for d in started["dirs"]),
             "their shared-memory folders to be removed", timeout=60)


# A benchmark as restore.py is one: daemons in a ring holding a step's copies (shared
# memory in their folders), and a work folder of its own in /dev/shm (the durable tier,
# Orbax's checkpoint), made with reaped_tempdir.
_BENCHMARK_LIKE = """
import json, os, signal, sys
import numpy as np
from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.testing import Ring, reaped_tempdir, wait_for
work = reaped_tempdir("bubblesnap-test-bench-", "/dev/shm")
with open(os.path.join(work, "checkpoint"), "wb") as f:
    f.write(os.urandom(1 << 20))
ring = Ring(2, "--replicas", "1")
client = NumpyClient("bench", options=ClientOptions(daemon=ring.daemons[0].address))
assert client.snapshot(1, {"w": np.arange(1 << 18, dtype=np.float32)}, wait=True).taken
segments = [os.path.join(d.shm_dir, n) for d in ring.daemons for n in os.listdir(d.shm_dir)
            if n.startswith("seg-")]
print(json.dumps({"pids": [d.proc.pid for d in ring.daemons],
                  "dirs": [d.own_shm_dir for d in ring.daemons] + [work],
                  "segments": segments}), flush=True)
signal.pause()
"""


def test_a_sigkilled_benchmark_leaves_no_daemon_and_no_shared_memory():
    bench = subprocess.Popen([sys.executable, "-c", _BENCHMARK_LIKE], stdout=subprocess.PIPE,
                             text=True)
    try:
        line = bench.stdout.readline()
        assert line, "the benchmark-like process printed nothing"
        held = json.loads(line)
        # both daemons hold the step (the copy and its replica) in segments of their own
        assert len(held["segments"]) >= 2 and all(os.path.isfile(p) for p in held["segments"])
        assert all(os.path.isdir(d) for d in held["dirs"])
    finally:
        bench.kill()  # SIGKILL: no finally, no atexit runs in it
        bench.wait()
    wait_for(lambda: all(_gone(pid) for pid in held["pids"]),
             "the daemons to die with the benchmark", timeout=60)
    wait_for(lambda: not any(os.path.exists(p) for p in held["dirs"] + held["segments"]),
             "their shared memory and the benchmark's work folder to be removed", timeout=60)
