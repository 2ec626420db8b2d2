"""The relay: forwards tensors between stage processes and outlives any one of them.

A stage process connects to ``<dir>/relay.sock`` (transport.RelayLinks) and
says hello with its stage number. Frames with a "to" go to that stage as
they are (dropped while it has no connection: its replacement recomputes
them); every other frame is a control message for the coordinator, read
from :attr:`Relay.events` as ``(stage, message)``. A closed connection
arrives there as ``{"event": "disconnected"}``.

This stands in for the collective library of a real job (NCCL send/recv),
whose communicators are rebuilt around a replaced rank.

Order: one connection's frames are forwarded and reported in the order they
came, and :meth:`Relay.broadcast` holds every connection while it writes,
so a tensor sent after a stage saw a broadcast reaches any other stage after
that one saw it too. coordinator.py builds its protocol on both.
"""

import os
import queue
import socket
import threading
from contextlib import ExitStack

from pipeline.transport import read_frame, write_frame


class Relay:
    """The supervisor's end: connections by stage, and what stages tell it."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "relay.sock")
        self.events: queue.Queue = queue.Queue()
        self._conns: dict[int, socket.socket] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._table = threading.Lock()  # guards the two dicts
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def broadcast(self, message: dict) -> None:
        """The same control message to every connected stage, holding every connection
        while it goes out: a tensor a stage sends after it saw the message reaches
        any other stage after that stage saw it too."""
        with self._table:
            targets = sorted(self._conns.items())
            locks = [self._locks[stage] for stage, _ in targets]
        with ExitStack() as held:
            for lock in locks:
                held.enter_context(lock)
            for _, conn in targets:
                try:
                    write_frame(conn, message, b"")
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        with self._table:
            for conn in self._conns.values():
                conn.close()

    def _connection(self, stage: int):
        with self._table:
            return self._conns.get(stage), self._locks.get(stage)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="relay-serve").start()

    def _serve(self, conn: socket.socket) -> None:
        stage = None
        try:
            hello, _ = read_frame(conn)
            stage = hello["stage"]
            with self._table:
                self._conns[stage], self._locks[stage] = conn, threading.Lock()
            self.events.put((stage, hello))
            while True:
                meta, payload = read_frame(conn)
                if "to" not in meta:
                    self.events.put((stage, meta))
                    continue
                target, lock = self._connection(meta["to"])
                if target is None:
                    continue
                with lock:
                    try:
                        write_frame(target, meta, payload)
                    except OSError:
                        pass
        except (ConnectionError, OSError, ValueError, KeyError):
            pass
        finally:
            if stage is not None:
                with self._table:
                    if self._conns.get(stage) is conn:
                        del self._conns[stage], self._locks[stage]
                self.events.put((stage, {"event": "disconnected"}))
            conn.close()
