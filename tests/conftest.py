"""Fixtures that start real daemons as separate processes on loopback ports."""

import json
import os
import signal
import subprocess
import sys

# Four CPU devices so sharded layouts can be tested; must precede any jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import grpc
import pytest

from bubblesnap.protos import daemon_pb2_grpc


class DaemonProcess:
    """A ``bubblesnap daemon`` child process and a stub to talk to it."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bubblesnap", "daemon", "--listen", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", "--log-level", "WARNING", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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

    def start(*flags: str) -> DaemonProcess:
        daemon = DaemonProcess(*flags)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()
