"""One daemon as a child process: ``python -m bubblesnap daemon`` started as a host would
start it, its ready line read, its gRPC services and signals the only ways in."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bubblesnap.protos import daemon_pb2, daemon_pb2_grpc
from bubblesnap.shared import huge_malloc
from bubblesnap.testing import reaper
from bubblesnap.testing.processes import freeze, in_netns, stopped, thread_states, wait_for

#: The name the daemon reports SERVING under in the gRPC health service.
DAEMON_SERVICE = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"].full_name


class DaemonError(RuntimeError):
    """The daemon exited, or printed no ready line in time."""


def _daemon_environment(env: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``env`` added, and glibc's huge-page tunable
    unless ``env`` names GLIBC_TUNABLES (``DaemonProcess``)."""
    full = {**os.environ, **env}
    if huge_malloc.ENV in env:
        return full
    return huge_malloc.this_environment(full) or full


class DaemonProcess:
    """A ``bubblesnap daemon`` child process, started and ready when the constructor returns.

    It listens on a Unix socket of its own (as daemons do by default, in a
    fresh temporary folder that is removed once it ended); ``flags`` are
    appended to the command line (a flag given twice: the last one wins, so
    ``"--listen", "127.0.0.1:0"`` puts it on a free loopback port). ``metrics`` is the
    ``--metrics`` address ("" disables it, "127.0.0.1:0" picks a port),
    ``env`` is added to this process's environment, which gets glibc's huge-page
    tunable as ``bubblesnap daemon`` would (:mod:`bubblesnap.shared.huge_malloc`), so that
    the daemon need not execute itself again, unless ``env`` names ``GLIBC_TUNABLES``
    itself. ``stderr`` is where the
    daemon's log goes: None inherits this process's stderr,
    ``subprocess.PIPE`` or ``subprocess.DEVNULL`` as for Popen, or a path,
    written from the start (see :meth:`stderr_text`). With ``own_shm_dir``
    (the default) the daemon gets a fresh ``--shm-dir`` in /dev/shm that is
    removed once it stopped or was killed, segments and all: a daemon adopts
    the copies a killed one left in its --shm-dir, and one started later by
    another test or program must not find this one's. A ``--shm-dir`` flag
    names a directory that outlives it instead (a restart on the same shared
    memory); ``own_shm_dir=False`` runs it on the daemon's default /dev/shm, and a
    path makes the fresh folder there instead of in /dev/shm (a tmpfs mounted with
    huge pages, say).
    ``name`` labels it in errors. ``netns`` runs it inside that network
    namespace (``ip netns exec``: a host of a :class:`~bubblesnap.testing.cluster.Cluster`);
    its Unix socket is reached from any namespace.

    Raises DaemonError (with the end of its log where it can be read) if the
    daemon exits or prints no ready line within ``ready_timeout`` seconds; it
    is killed then, so nothing is left behind. A context manager: leaving
    the block stops it.
    """

    def __init__(self, *flags: str, metrics: str = "", log_level: str = "WARNING",
                 env: dict[str, str] | None = None, stderr=None, own_shm_dir: bool | str = True,
                 name: str = "daemon", ready_timeout: float = 120.0, netns: str | None = None):
        self.name = name
        self.stderr_path = None if stderr is None or isinstance(stderr, int) else str(stderr)
        self._stderr_inherited = stderr is None  # writes where this process's stderr goes
        parent = own_shm_dir if isinstance(own_shm_dir, str) else "/dev/shm"
        self.own_shm_dir = (tempfile.mkdtemp(prefix="bubblesnap-testing-", dir=parent)
                            if own_shm_dir else None)
        self._channel: grpc.Channel | None = None
        self._reaped: int | None = None  # its token with this process's reaper
        self._socket_dir = tempfile.mkdtemp(prefix="bubblesnap-socket-")
        shm = ["--shm-dir", self.own_shm_dir] if own_shm_dir else []
        command = [*in_netns(netns), sys.executable, "-m", "bubblesnap", "daemon",
                   "--listen", f"unix://{self._socket_dir}/daemon.sock",
                   "--metrics", metrics, "--log-level", log_level, *shm, *flags]
        try:
            self.proc = self._spawn(command, stderr, _daemon_environment(env or {}))
        except BaseException:
            self._remove_own_dirs()
            raise
        self._reaped = reaper.adopt(self.proc.pid, [self._socket_dir] + (
            [self.own_shm_dir] if self.own_shm_dir else []))
        self.ready: dict = self._await_ready(ready_timeout)
        reaper.add_paths(self._reaped, [self.ready["shm_dir"]])

    def _spawn(self, command: list[str], stderr, env) -> subprocess.Popen:
        if self.stderr_path is None:
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env=env)
        with open(self.stderr_path, "w") as log_file:  # the child keeps its own descriptor
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                    env=env)

    def _await_ready(self, timeout: float) -> dict:
        """The ready line's JSON; else the daemon is killed and DaemonError says why."""
        try:
            readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if readable else ""
            if line:
                return json.loads(line)
            if readable:  # end of file: it closed stdout on its way out
                self.proc.wait(timeout=30)
        except BaseException:
            self.kill()
            raise
        exited = self.proc.poll()
        self.kill()
        why = (f"exited with code {exited}" if exited is not None
               else f"printed no ready line within {timeout:.0f} s")
        logged = self.stderr_text() or (self.proc.stderr.read() if self.proc.stderr else "")
        tail = logged[-3000:].strip()
        raise DaemonError(f"{self.name} {why}" + (f": {tail}" if tail else ""))

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """Its gRPC address for trainers and tools: ``unix:///...`` or host:port."""
        return self.ready["address"]

    @property
    def shm_dir(self) -> str:
        """The directory of its shared-memory segments (one per daemon, inside --shm-dir)."""
        return self.ready["shm_dir"]

    @property
    def channel(self) -> grpc.Channel:
        """One gRPC channel to it, opened on first use and closed by stop() and kill()."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> daemon_pb2_grpc.DaemonStub:
        """A ``bubblesnap.v1.Daemon`` stub on :attr:`channel`."""
        return daemon_pb2_grpc.DaemonStub(self.channel)

    @property
    def exit_code(self) -> int | None:
        """None while it runs; its exit status (negative: the signal) once it ended."""
        return self.proc.poll()

    def alive(self) -> bool:
        """Whether the process still runs (it may be stopped with SIGSTOP)."""
        return self.proc.poll() is None

    def freeze(self, timeout: float = 30.0) -> None:
        """SIGSTOP: alive, holding its sockets, answering nothing; see :func:`freeze`."""
        freeze(self.proc.pid, timeout)

    def thaw(self) -> None:
        """SIGCONT of a frozen daemon."""
        os.kill(self.proc.pid, signal.SIGCONT)

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether the standard gRPC health service reports it SERVING within ``timeout``."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=DAEMON_SERVICE), timeout=timeout)
            except grpc.RpcError:
                return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def peers_seen(self, timeout: float = 5.0) -> set[int]:
        """The ring positions it sees alive now, its own included (its metrics'
        ``bubblesnap_peer_alive``; it must serve ``metrics``)."""
        return peers_seen(self._metrics(timeout))

    def ring_index(self, timeout: float = 5.0) -> int:
        """Its ring position now (its metrics' ``bubblesnap_ring_index``): with etcd it
        may differ from the ready line's ``peer_index`` (it took another after its lease
        ran out), and is -1 while it holds none."""
        return ring_index(self._metrics(timeout))

    def restores_served(self, timeout: float = 5.0) -> dict[str, int]:
        """The restores it served, by the tier the bytes came from (``memory``, ``peer``,
        ``durable``: its metrics' ``bubblesnap_restores_total``; it must serve ``metrics``)."""
        return {source: int(float(count)) for source, count in re.findall(
            r'^bubblesnap_restores_total\{source="(\w+)"\} (\S+)$', self._metrics(timeout),
            re.M)}

    def _metrics(self, timeout: float) -> str:
        if not self.ready.get("metrics"):
            raise DaemonError(f"{self.name} serves no metrics: start it with metrics=...")
        with urllib.request.urlopen(f"http://{self.ready['metrics']}/metrics",
                                    timeout=timeout) as answer:
            return answer.read().decode()

    def stderr_text(self) -> str:
        """What it logged so far, when its stderr goes to a file ("" otherwise)."""
        if self.stderr_path is None:
            return ""
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def dump_stacks(self, timeout: float = 5.0) -> str:
        """What the daemon is doing now, for a report on one that stopped answering: every
        thread's Python stack (SIGUSR1: the daemon writes them to its log, and runs on) and
        each thread's state in the kernel (``R`` running, ``S`` waiting, ``D`` in the kernel
        uninterruptibly, ``T`` stopped, with the kernel function it waits in). "" once it
        ended. The stacks come back when its log goes to a file; with this process's
        stderr, they are written there; not into a pipe (one nobody reads could block
        the daemon), nor while it is frozen (it would write them once thawed)."""
        if self.proc.poll() is not None:
            return ""
        states = f"{self.name}: threads {thread_states(self.proc.pid)}\n"
        if stopped(self.proc.pid):
            return states
        if self._stderr_inherited:
            self.proc.send_signal(signal.SIGUSR1)
            return states + "(its stacks: written to this process's stderr)\n"
        if self.stderr_path is None:
            return states
        before = len(self.stderr_text())
        self.proc.send_signal(signal.SIGUSR1)
        try:  # done at the main thread's outermost frame, written last (python -m)
            wait_for(lambda: "in _run_module_as_main" in self.stderr_text()[before:],
                     f"{self.name}'s stacks", timeout=timeout, interval=0.05)
        except TimeoutError:
            pass  # what was written so far says something too
        return states + self.stderr_text()[before:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (it finishes in-flight calls and frees its memory), SIGKILL after
        ``timeout`` seconds; returns the exit status. Does nothing to an ended process."""
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self._reap()

    def kill(self) -> int:
        """SIGKILL: the host is gone, with everything in its memory. Returns the exit status."""
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.kill()
        return self._reap()

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _reap(self) -> int:
        code = self.proc.wait()
        self.proc.stdout.close()
        self._remove_own_dirs()
        if self._reaped is not None:
            reaper.release(self._reaped)
            self._reaped = None
        return code

    def _remove_own_dirs(self) -> None:
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self.own_shm_dir is not None:
            shutil.rmtree(self.own_shm_dir, ignore_errors=True)

def peers_seen(metrics: str) -> set[int]:
    return {int(peer) for peer in
            re.findall(r'^bubblesnap_peer_alive\{peer="(\d+)"\} 1\.0$', metrics, re.M)}


def ring_index(metrics: str) -> int:
    found = re.search(r"^bubblesnap_ring_index (-?\d+)\.0$", metrics, re.M)
    return int(found.group(1)) if found else -1
