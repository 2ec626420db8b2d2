"""How activations and gradients travel between stages.

Every stage has an :class:`Inbox`; a tensor is filed under (kind, microbatch)
with the time it arrived, which is what makes bubble lengths measurable even
when the stage was busy fetching a snapshot when the tensor came in.

``ThreadLinks`` connects stages that are threads of one process.
``SocketLinks`` connects stage processes over Unix sockets: each stage
listens on ``<dir>/stage<N>.sock`` and connects to the next stage; one
connection carries activations forward and gradients back.
"""

import json
import os
import socket
import struct
import threading
import time

import numpy as np

_HEADER = struct.Struct("!I")


class Inbox:
    """Tensors received by one stage, each with its arrival time."""

    def __init__(self, timeout: float = 120.0):
        self._timeout = timeout
        self._items: dict = {}
        self._ready = threading.Condition()

    def put(self, key, value) -> None:
        with self._ready:
            self._items[key] = (value, time.perf_counter())
            self._ready.notify_all()

    def has(self, key) -> bool:
        with self._ready:
            return key in self._items

    def take(self, key):
        """(value, arrival time), waiting until it is there (a dead neighbour: TimeoutError)."""
        with self._ready:
            if not self._ready.wait_for(lambda: key in self._items, timeout=self._timeout):
                raise TimeoutError(f"no {key} from the neighbouring stage in {self._timeout:.0f} s;"
                                   " it has probably failed (see its error above)")
            return self._items.pop(key)


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
    """One stage process's connections to its neighbours (Unix sockets in ``directory``)."""

    def __init__(self, directory: str, stages: int, stage: int, timeout: float = 120.0):
        self.inbox = Inbox()
        self._stage = stage
        self._sockets: dict[int, socket.socket] = {}
        self._locks: dict[int, threading.Lock] = {}
        listener = None
        if stage > 0:
            path = os.path.join(directory, f"stage{stage}.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(1)
        if stage < stages - 1:
            self._add(stage + 1, _connect(os.path.join(directory, f"stage{stage + 1}.sock"),
                                          timeout))
        if listener is not None:
            listener.settimeout(timeout)
            conn, _ = listener.accept()
            listener.close()
            self._add(stage - 1, conn)

    def _add(self, peer: int, conn: socket.socket) -> None:
        self._sockets[peer] = conn
        self._locks[peer] = threading.Lock()
        threading.Thread(target=self._receive, args=(conn,), daemon=True,
                         name=f"recv-from-{peer}").start()

    def endpoint(self, stage: int):
        assert stage == self._stage
        return self.inbox, self.send

    def send(self, to: int, key, value) -> None:
        array = np.ascontiguousarray(np.asarray(value))
        header = json.dumps({"key": list(key), "dtype": array.dtype.name,
                             "shape": array.shape}).encode()
        with self._locks[to]:
            self._sockets[to].sendall(_HEADER.pack(len(header)) + header)
            self._sockets[to].sendall(_HEADER.pack(array.nbytes))
            self._sockets[to].sendall(memoryview(array).cast("B"))

    def _receive(self, conn: socket.socket) -> None:
        try:
            while True:
                meta = json.loads(_read(conn, _HEADER.unpack(_read(conn, 4))[0]))
                raw = _read(conn, _HEADER.unpack(_read(conn, 4))[0])
                value = np.frombuffer(raw, dtype=meta["dtype"]).reshape(meta["shape"])
                self.inbox.put(tuple(meta["key"]), value)
        except (ConnectionError, OSError):
            return

    def close(self) -> None:
        for conn in self._sockets.values():
            conn.close()


def _connect(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"stage socket {path} did not appear in {timeout:.0f} s") from None
            time.sleep(0.05)


def _read(conn: socket.socket, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    while got < nbytes:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("neighbour stage closed the connection")
        got += n
    return buffer
