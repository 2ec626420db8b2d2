"""Child processes that die with the process that started them, even when it is SIGKILLed.

``bubblesnap.testing`` starts daemons and etcd as child processes. When the
process that started them dies without stopping them (the OOM killer, a CI
timeout, ``kill -9``, a crash), nothing else would: they would keep their
ports and their shared memory, and files in /dev/shm outlive the processes
that wrote them. So a process that starts such children also starts one
reaper: a small process of its own session (no terminal signal reaches it)
holding one end of a socket pair whose other end only the starting process
holds. Each child is handed over as it starts (a pidfd, so a recycled pid is
never signalled, and the paths to remove once it is gone) and released when
its starter ended it itself. Folders the starting process makes for itself
(a benchmark's work files in /dev/shm) are handed over the same way. When
the starting process ends, however it ends, the kernel closes its end: the
reaper reads end-of-file, SIGKILLs every child still handed over (a stopped
one too), waits until each is gone, removes their paths and the folders
handed over, runs the commands it was handed (``ip netns del``: the network
a ``Cluster`` made) and exits.

Runs without the package (``python -I reaper.py FD``): only the standard library.
"""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

#: How long the reaper waits for killed children to be gone before removing their paths.
_GONE_SECONDS = 30.0

_lock = threading.Lock()
_state = {"pid": None, "socket": None, "next": 0}


def adopt(pid: int, paths=()) -> int:
    """Hands child ``pid`` (not yet waited for) to this process's reaper, with ``paths``
    to remove once it is gone; returns the token that :func:`release` and
    :func:`add_paths` take."""
    pidfd = _pidfd(pid)
    try:
        with _lock:
            _state["next"] += 1
            token = _state["next"]
            _send({"op": "adopt", "id": token, "pid": pid, "paths": [str(p) for p in paths]},
                  pidfd)
        return token
    finally:
        if pidfd is not None:
            os.close(pidfd)


def add_paths(token: int, paths) -> None:
    """More paths to remove after child ``token`` is gone (learnt once it started)."""
    with _lock:
        _send({"op": "paths", "id": token, "paths": [str(p) for p in paths]})


def remove_at_end(paths) -> int:
    """Paths (folders or files of this process's own) the reaper removes once this
    process is gone, unless :func:`release` of the returned token came first: what
    must not outlive a process that is SIGKILLed (shared memory stays until removed)."""
    with _lock:
        _state["next"] += 1
        token = _state["next"]
        _send({"op": "remove", "id": token, "paths": [str(p) for p in paths]})
    return token


def run_at_end(commands) -> int:
    """Commands (argument lists) the reaper runs, in order, once this process is gone
    and its children with it, unless :func:`release` of the returned token came first:
    how a network made for tests is removed when its maker is SIGKILLed."""
    with _lock:
        _state["next"] += 1
        token = _state["next"]
        _send({"op": "run", "id": token, "commands": [list(map(str, c)) for c in commands]})
    return token


def release(token: int) -> None:
    """Child ``token`` ended and was waited for (or commands ``token`` are no longer
    needed): the reaper forgets it."""
    with _lock:
        _send({"op": "release", "id": token})


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here: the reaper signals the pid
        return None


def _send(message: dict, fd: int | None = None) -> None:
    """Sends one message to this process's reaper, starting one first if this process
    has none (or forked from the process that had it). Called with ``_lock`` held."""
    data = json.dumps(message).encode()
    for attempt in range(2):
        if _state["pid"] != os.getpid():
            _start()
        try:
            socket.send_fds(_state["socket"], [data], [] if fd is None else [fd])
            return
        except OSError:  # the reaper is gone (someone killed it): a new one
            if attempt:
                raise
            _state["pid"] = None


def _start() -> None:
    if _state["socket"] is not None:
        _state["socket"].close()  # a forked child's copy of its parent's end
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.set_inheritable(theirs.fileno(), True)
        devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
        # posix_spawn, not Popen: nobody waits for the reaper, which outlives this process
        os.posix_spawn(sys.executable, [sys.executable, "-I", os.path.abspath(__file__),
                                        str(theirs.fileno())], os.environ,
                       file_actions=devnull, setsid=True)
    finally:
        theirs.close()
    _state["pid"], _state["socket"] = os.getpid(), ours


# -- the reaper process ----------------------------------------------------------------------


def _serve(fd: int) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    children: dict[int, tuple[int | None, int, list[str]]] = {}  # id -> (pidfd, pid, paths)
    commands: dict[int, list[list[str]]] = {}  # id -> what to run at the end
    removals: dict[int, list[str]] = {}  # id -> the starter's own paths to remove
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
        if not data:  # every copy of the starting process's end is closed: it is gone
            break
        message = json.loads(data)
        token = message["id"]
        if message["op"] == "adopt":
            children[token] = (fds[0] if fds else None, message["pid"], message["paths"])
        elif message["op"] == "paths" and token in children:
            children[token][2].extend(message["paths"])
        elif message["op"] == "run":
            commands[token] = message["commands"]
        elif message["op"] == "remove":
            removals[token] = message["paths"]
        elif message["op"] == "release":
            commands.pop(token, None)
            removals.pop(token, None)
            pidfd = children.pop(token, (None,))[0]
            if pidfd is not None:
                os.close(pidfd)
    for pidfd, pid, _ in children.values():
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _GONE_SECONDS
    for pidfd, _, _ in children.values():
        if pidfd is not None:  # readable once the process has ended
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
    for paths in [p for _, _, p in children.values()] + list(removals.values()):
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    for argv in (argv for token in sorted(commands) for argv in commands[token]):
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
