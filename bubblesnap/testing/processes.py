"""Child processes as tests start and watch them: free ports, freezing a process (SIGSTOP,
returned once every thread stopped), folders the reaper removes, network namespaces,
and waiting for a condition."""

import os
import random
import signal
import socket
import tempfile
import time
from collections.abc import Callable

import grpc

from bubblesnap.testing import reaper

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
    wait_for(lambda: stopped(pid), f"process {pid} to stop", timeout=timeout,
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


def stopped(pid: int) -> bool:
    """Whether no thread of ``pid`` runs (each stopped, or exiting; or it is gone)."""
    return all(state in ("T", "t", "Z", "X") for state, _ in _threads(pid))


def thread_states(pid: int) -> str:
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


def port_free(host: str, port: int) -> bool:
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
