"""How activations and gradients travel between stages.

Every stage has an :class:`Inbox`; a tensor is filed under (kind, iteration,
microbatch) with the time it arrived, which is what makes bubble lengths
measurable even when the stage was busy fetching a snapshot when the tensor
came in.

``ThreadLinks`` connects stages that are threads of one process.
``SocketLinks`` connects stage processes over Unix sockets: each stage
listens on ``<dir>/stage<N>.sock`` and connects to the next stage; one
connection carries activations forward and gradients back. Given one
``host:port`` per stage it uses TCP instead (stages on different hosts, or
network namespaces as a ``bubblesnap.testing.Cluster`` makes them).
``RelayLinks`` connects a stage process to a relay (relay.py) that forwards
tensors and outlives any one stage: a replacement stage joins it while the
others keep their connections.
"""

import json
import os
import queue
import socket
import struct
import threading
import time

import numpy as np

from bubblesnap.shared.sockets import recv_exact

_HEADER = struct.Struct("!I")


class NeighbourLost(RuntimeError):
    """A tensor this stage waits for will not come: its sender failed or gave up."""


class Inbox:
    """Tensors received by one stage, each with its arrival time."""

    def __init__(self, timeout: float = 120.0):
        self._timeout = timeout
        self._items: dict = {}
        self._silent: set[int] = set()  # stages that will send nothing more
        self._ready = threading.Condition()

    def silence(self, stages) -> None:
        """From now on a wait for a tensor from one of ``stages`` raises NeighbourLost."""
        with self._ready:
            self._silent = set(stages)
            self._ready.notify_all()

    def clear(self) -> None:
        """Drops every tensor held and every silenced stage: a new start after a recovery."""
        with self._ready:
            self._items.clear()
            self._silent.clear()

    def put(self, key, value) -> None:
        with self._ready:
            self._items[key] = (value, time.perf_counter())
            self._ready.notify_all()

    def has(self, key) -> bool:
        with self._ready:
            return key in self._items

    def take(self, key, sender: int | None = None):
        """(value, arrival time), waiting until it is there; NeighbourLost once
        ``sender`` is silenced (a dead neighbour nobody silences: TimeoutError)."""
        with self._ready:
            if not self._ready.wait_for(lambda: key in self._items or sender in self._silent,
                                        timeout=self._timeout):
                raise TimeoutError(f"no {key} from the neighbouring stage in {self._timeout:.0f} s;"
                                   " it has probably failed (see its error above)")
            if key not in self._items:
                raise NeighbourLost(f"stage {sender} will not send {key}")
            return self._items.pop(key)


def run_stage_threads(work, stages: int) -> None:
    """Runs ``work(stage)`` for every stage on its own thread, waits for all of them, and
    raises SystemExit naming the first failure (after every thread stopped)."""
    errors = []

    def guarded(stage: int) -> None:
        try:
            work(stage)
        except BaseException as err:
            errors.append(err)
            raise

    threads = [threading.Thread(target=guarded, args=(s,), name=f"stage{s}")
               for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a stage failed: {errors[0]!r}")


class ThreadLinks:
    """Stages as threads of one process: sending is filing into the neighbour's inbox."""

    def __init__(self, stages: int):
        self.inboxes = [Inbox() for _ in range(stages)]

    def endpoint(self, stage: int):
        return self.inboxes[stage], lambda to, key, value: self.inboxes[to].put(
            key, np.asarray(value))

    def close(self) -> None:
        pass


class SocketLinks:
    """One stage process's connections to its neighbours: Unix sockets in ``directory``,
    or, with ``addresses`` (``host:port`` of every stage, in stage order), TCP: stage
    N listens on the N-th address and connects to the next stage's."""

    def __init__(self, directory: str, stages: int, stage: int, timeout: float = 120.0,
                 addresses: list[str] | None = None):
        self.inbox = Inbox()
        self._stage = stage
        self._sockets: dict[int, socket.socket] = {}
        self._locks: dict[int, threading.Lock] = {}
        if addresses is None:
            where = [os.path.join(directory, f"stage{s}.sock") for s in range(stages)]
        else:
            where = [_host_port(a) for a in addresses]
        listener = _listen(where[stage]) if stage > 0 else None
        if stage < stages - 1:
            self._add(stage + 1, _connect(where[stage + 1], timeout))
        if listener is not None:
            listener.settimeout(timeout)
            conn, _ = listener.accept()
            listener.close()
            self._add(stage - 1, _nodelay(conn))

    def _add(self, peer: int, conn: socket.socket) -> None:
        self._sockets[peer] = conn
        self._locks[peer] = threading.Lock()
        threading.Thread(target=self._receive, args=(conn,), daemon=True,
                         name=f"recv-from-{peer}").start()

    def endpoint(self, stage: int):
        assert stage == self._stage
        return self.inbox, self.send

    def send(self, to: int, key, value) -> None:
        with self._locks[to]:
            write_tensor(self._sockets[to], {}, key, value)

    def _receive(self, conn: socket.socket) -> None:
        try:
            while True:
                meta, raw = read_frame(conn)
                self.inbox.put(tuple(meta["key"]), tensor(meta, raw))
        except (ConnectionError, OSError):
            return

    def close(self) -> None:
        for conn in self._sockets.values():
            conn.close()


class RelayLinks:
    """One stage process's connection to the relay (relay.py).

    Tensors for other stages go through the relay; messages from the relay
    that are not tensors (its recovery protocol) land in :attr:`control`,
    after the inbox has acted on them: "lost" silences the stages named,
    "recover" and "go" clear the inbox (coordinator.py says why nothing
    stale can arrive after them).
    """

    def __init__(self, path: str, stage: int, timeout: float = 120.0):
        self.inbox = Inbox(timeout)
        self.control = queue.Queue()
        self._stage = stage
        self._lock = threading.Lock()
        self._socket = _connect(path, timeout)
        self.tell({"event": "hello", "stage": stage})
        threading.Thread(target=self._receive, daemon=True, name="recv-from-relay").start()

    def endpoint(self, stage: int):
        assert stage == self._stage
        return self.inbox, self.send

    def send(self, to: int, key, value) -> None:
        with self._lock:
            write_tensor(self._socket, {"to": to}, key, value)

    def tell(self, message: dict) -> None:
        """A control message to the relay's coordinator."""
        with self._lock:
            write_frame(self._socket, message, b"")

    def _receive(self) -> None:
        try:
            while True:
                meta, raw = read_frame(self._socket)
                if "key" in meta:
                    self.inbox.put(tuple(meta["key"]), tensor(meta, raw))
                    continue
                if meta["event"] == "lost":
                    self.inbox.silence(meta["stages"])
                elif meta["event"] in ("recover", "go"):
                    self.inbox.clear()
                self.control.put(meta)
        except (ConnectionError, OSError):
            self.control.put({"event": "relay-gone"})

    def close(self) -> None:
        self._socket.close()


def write_frame(conn: socket.socket, meta: dict, payload) -> None:
    """A frame: a JSON header, then a payload, each after its 4-byte length."""
    header = json.dumps(meta).encode()
    conn.sendall(_HEADER.pack(len(header)) + header + _HEADER.pack(len(payload)))
    if len(payload):
        conn.sendall(payload)


def read_frame(conn: socket.socket) -> tuple[dict, bytearray]:
    """The next frame :func:`write_frame` sent; ConnectionError once the other end closed."""
    meta = json.loads(recv_exact(conn, _HEADER.unpack(recv_exact(conn, 4))[0]))
    return meta, recv_exact(conn, _HEADER.unpack(recv_exact(conn, 4))[0])


def write_tensor(conn: socket.socket, meta: dict, key, value) -> None:
    array = np.ascontiguousarray(np.asarray(value))
    write_frame(conn, {**meta, "key": list(key), "dtype": array.dtype.name,
                       "shape": array.shape}, memoryview(array).cast("B"))


def tensor(meta: dict, raw) -> np.ndarray:
    return np.frombuffer(raw, dtype=meta["dtype"]).reshape(meta["shape"])


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _nodelay(conn: socket.socket) -> socket.socket:
    """TCP sends each tensor at once: Nagle's algorithm would hold a frame's tail back
    until the previous one is acknowledged, a round trip inside every handoff."""
    if conn.family != socket.AF_UNIX:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _listen(where) -> socket.socket:
    """A listener on a Unix socket path or a (host, port)."""
    family = socket.AF_UNIX if isinstance(where, str) else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    if family != socket.AF_UNIX:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(where)
    listener.listen(1)
    return listener


def _connect(where, timeout: float) -> socket.socket:
    """A connection to a Unix socket path or a (host, port), retried until the
    neighbour listens or ``timeout`` passed (stages start in any order)."""
    family = socket.AF_UNIX if isinstance(where, str) else socket.AF_INET
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(family, socket.SOCK_STREAM)
        try:
            conn.connect(where)
            return _nodelay(conn)
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"stage socket {where} did not appear in {timeout:.0f} s") from None
            time.sleep(0.05)
