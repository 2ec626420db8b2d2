"""The daemon as a process: shutdown, memory budget, metrics, CLI, and clients when it is gone."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.clients.jax import SnapshotClient
from bubblesnap.protos import daemon_pb2 as pb


def test_sigterm_stops_gracefully_and_frees_shared_memory(daemon):
    client = NumpyClient("bye", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(0, {"x": np.ones(1000)}).committed
    assert os.listdir(daemon.shm_dir)
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.shm_dir)


def test_a_sigterm_another_thread_receives_stops_it_too(daemon):
    """The kernel hands a process's SIGTERM to any of its threads: sent to one of the
    daemon's own (gRPC's, say) it must stop as gracefully (seen: a daemon that never
    logged 'shutting down' and was SIGKILLed after 30 s, under load)."""
    pid = daemon.proc.pid
    other = next(int(t) for t in sorted(os.listdir(f"/proc/{pid}/task")) if int(t) != pid)
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, other, signal.SIGTERM) == 0
    assert daemon.proc.wait(timeout=60) == 0
    assert not os.path.exists(daemon.shm_dir)


def test_memory_budget_holds(start_daemon):
    mib = np.zeros(1 << 18, np.float32)  # 1 MiB per step
    daemon = start_daemon("--memory-budget", "2.5MiB", "--keep", "2")
    client = NumpyClient("budget", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(0, {"x": mib}).committed
    assert client.snapshot(1, {"x": mib + 1}).committed
    refused = client.snapshot(2, {"x": mib + 2})  # two kept + one staging > 2.5 MiB
    assert not refused.taken and "RESOURCE_EXHAUSTED" in refused.reason
    assert "memory budget" in refused.reason
    memory = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.used_bytes + memory.pooled_bytes <= memory.budget_bytes
    step, restored = client.restore()
    assert step == 1 and (restored["x"] == 1).all()  # what it held is intact

    # With one step kept, the older copy is recycled and snapshots go on.
    daemon = start_daemon("--memory-budget", "2.5MiB", "--keep", "1")
    client = NumpyClient("budget", options=ClientOptions(daemon=daemon.address))
    for step in range(6):
        assert client.snapshot(step, {"x": mib + step}).committed, step
    memory = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory
    assert memory.used_bytes + memory.pooled_bytes <= memory.budget_bytes


def test_shm_smaller_than_budget_caps_it(start_daemon):
    small = start_daemon("--memory-budget", "1TiB")
    free = small.ready["shm_free_bytes"]
    assert small.ready["memory_budget_bytes"] < free <= 1 << 40
    assert "budget is capped" in _stop_and_read_stderr(small)


def _stop_and_read_stderr(daemon):
    daemon.stop()
    return daemon.stderr_text()


def test_client_never_hangs_when_daemon_is_gone_or_stuck(daemon):
    options = ClientOptions(daemon=daemon.address, rpc_timeout_seconds=0.5, backoff_seconds=0.0)
    client = SnapshotClient("stuck", options=options)
    state = {"w": jnp.ones((64, 64))}
    assert client.snapshot(0, state, wait=True).committed

    daemon.freeze()  # alive but not answering
    try:
        stuck = client.snapshot(1, state, wait=True)
    finally:
        daemon.thaw()
    assert not stuck.taken and "deadline exceeded" in stuck.reason

    daemon.stop()
    gone = client.snapshot(2, state, wait=True)
    assert not gone.taken and "unavailable" in gone.reason

    backoff = SnapshotClient("gone", options=ClientOptions(daemon=daemon.address,
                                                            backoff_seconds=60))
    # a snapshot that waits backs off once the daemon was unreachable...
    assert "unavailable" in backoff.snapshot(0, state, wait=True).reason
    assert "did not answer recently" in backoff.snapshot(1, state, wait=True).reason
    # ...one that does not is set aside at once, and its failure learnt after
    assert backoff.snapshot(2, state).taken
    assert "unavailable" in backoff.wait().reason
    assert [f.step for f in backoff.session.take_late_failures()] == [2]


def test_sigusr1_logs_every_threads_stack_and_the_daemon_serves_on(daemon):
    dump = daemon.dump_stacks()
    assert dump.startswith("daemon: threads ") and " S " in dump.splitlines()[0]
    assert dump.count("(most recent call first)") >= 3  # gRPC's threads, the main one
    assert 'service/daemon.py", line' in dump and "in run" in dump
    assert daemon.healthy()
    assert daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.budget_bytes > 0


def test_a_daemon_logging_to_its_starters_stderr_dumps_its_stacks_there():
    program = ("from bubblesnap.testing import DaemonProcess\n"
               "with DaemonProcess() as d:\n"
               "    print(d.dump_stacks(), flush=True)\n"
               "    assert d.healthy()\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "written to this process's stderr" in done.stdout
    assert 'service/daemon.py", line' in done.stderr and "(most recent call first)" in done.stderr


def test_metrics_endpoint(daemon):
    client = NumpyClient("metrics", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(9, {"x": np.ones(10)}).committed
    body = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics", timeout=10).read()
    text = body.decode()
    assert 'bubblesnap_latest_committed_step{job="metrics"} 9.0' in text
    assert 'bubblesnap_rpcs_total{code="OK",method="CommitStep"}' in text


def test_status_command_table_and_json(daemon):
    client = NumpyClient("cli", rank=0, world_size=2, options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(4, {"x": np.ones(10)}).taken
    cmd = [sys.executable, "-m", "bubblesnap", "status", "--daemon", daemon.address]
    table = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "job cli: 1/2 ranks registered, latest committed step none" in table
    assert "LOCAL" in table
    assert "coverage not judged yet" in table  # rank 1's layout is not known
    data = json.loads(subprocess.run([*cmd, "--json", "--job", "cli"], capture_output=True,
                                     text=True, check=True).stdout)
    assert data["jobs"][0]["steps"][0]["ranks"][0]["state"] == "LOCAL"
    assert data["jobs"][0]["latestCommittedStep"] == "-1"
    missing = subprocess.run([*cmd, "--job", "nope"], capture_output=True, text=True)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


@pytest.mark.parametrize("flags, words", [
    (["--memory-budget", "lots"], "is not a size"),
    (["--keep", "0"], "--keep must be at least 1"),
    (["--shm-dir", "/nonexistent/dir"], "does not exist"),
    (["--max-interval", "0"], "--max-interval must be at least 1"),
    (["--nice", "40"], "--nice must be between 0 and 19"),
    (["--max-message", "-5"], "is not a size"),
    (["--boundary-log-budget", "0"], "--boundary-log-budget must be at least 1.0 KiB"),
    (["--training-log-budget", "1000"], "--training-log-budget must be at least 1.0 KiB"),
    (["--training-log-budget", "big"], "is not a size"),
])
def test_daemon_rejects_bad_flags(flags, words):
    result = subprocess.run([sys.executable, "-m", "bubblesnap", "daemon", "--listen",
                             "127.0.0.1:0", "--metrics", "", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and words in result.stderr


def test_a_restarted_daemon_gets_the_job_registered_again(start_daemon, tmp_path):
    listen = f"unix://{tmp_path}/daemon.sock"  # the second daemon where the first was
    first = start_daemon("--listen", listen)
    client = NumpyClient("again", options=ClientOptions(daemon=first.address,
                                                        backoff_seconds=0.0))
    assert client.snapshot(0, {"x": np.ones(8)}).committed
    first.stop()
    second = start_daemon("--listen", listen)
    results = [client.snapshot(step, {"x": np.ones(8) * step}) for step in (1, 2, 3)]
    assert results[-1].committed, [r.reason for r in results]
    step, restored = client.restore()
    assert step == 3 and (restored["x"] == 3).all()
    assert second.alive()


def test_second_daemon_on_a_taken_port_fails(daemon):
    result = subprocess.run([sys.executable, "-m", "bubblesnap", "daemon", "--listen",
                             daemon.address, "--metrics", ""], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "cannot listen" in result.stderr


def test_bubble_hooks_never_raise_when_the_daemon_is_gone(daemon):
    from bubblesnap.clients.jax import BubbleSnapshotOptions, BubbleSnapshotter
    client = SnapshotClient("gone", rank=0, world_size=1, options=ClientOptions(
        daemon=daemon.address, rpc_timeout_seconds=0.5, backoff_seconds=0.0))
    snap = BubbleSnapshotter(client, stage=0, options=BubbleSnapshotOptions(warmup_iterations=1))
    state = {"w": jnp.ones((256, 256))}
    receive = lambda: (1, time.perf_counter())  # noqa: E731
    for iteration in range(12):
        if iteration == 5:
            daemon.stop()
        snap.begin_iteration(iteration)
        assert snap.bubble(0, receive, lambda: False) == 1
        snap.no_bubble(1)
        snap.end_iteration(iteration, state)
    snap.close()
