"""Fixtures that start real daemons as separate processes on loopback ports."""

import json
import os
import signal
import socket
import subprocess
import sys

# Four CPU devices so sharded layouts can be tested; must precede any jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import grpc
import pytest

from bubblesnap.protos import daemon_pb2_grpc


class DaemonProcess:
    """A ``bubblesnap daemon`` child process and a stub to talk to it."""

    def __init__(self, *flags: str, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bubblesnap", "daemon", "--listen", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", "--log-level", "WARNING", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=None if env is None else {**os.environ, **env})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon did not start: {self.proc.stderr.read()}")
        self.ready = json.loads(line)
        self.address = self.ready["address"]
        self.shm_dir = self.ready["shm_dir"]
        self.channel = grpc.insecure_channel(self.address)
        self.stub = daemon_pb2_grpc.DaemonStub(self.channel)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the host is gone, with everything in its memory."""
        self.channel.close()
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        self.channel.close()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def start_daemon():
    """Starts daemons with the given flags; all are stopped after the test."""
    started = []

    def start(*flags: str, env=None) -> DaemonProcess:
        daemon = DaemonProcess(*flags, env=env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()


def free_port() -> int:
    """A port free right now (peers must know each other's addresses before they start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ring:
    """Daemons that replicate to each other, one per simulated host."""

    def __init__(self, start_daemon, size: int, *flags: str, env=None):
        self._start = start_daemon
        self._flags = flags
        self._env = env
        self.peers = [f"127.0.0.1:{free_port()}" for _ in range(size)]
        self.daemons = [self._launch(i) for i in range(size)]

    def _launch(self, index: int) -> DaemonProcess:
        return self._start("--peers", ",".join(self.peers), "--index", str(index),
                           *self._flags, env=self._env)

    def replace(self, index: int) -> DaemonProcess:
        """A fresh daemon (new port, empty memory) takes a dead host's place."""
        self.peers[index] = f"127.0.0.1:{free_port()}"
        self.daemons[index] = self._launch(index)
        return self.daemons[index]


@pytest.fixture
def start_ring(start_daemon):
    def start(size: int, *flags: str, env=None) -> Ring:
        return Ring(start_daemon, size, *flags, env=env)
    return start
