"""The bulk path between daemons: TCP (or TLS) connections that carry a segment.

gRPC from Python moves bulk bytes at about half of raw loopback TCP (each
message is copied several times); this channel sends a segment file with
``sendfile`` straight from shared memory, and the receiver reads it straight
into its own segment, over a few connections at once (one TCP stream is
bound by one core's copying: two streams moved 1.5-2x the bytes on the dev
VM). Control stays on gRPC: a peer call that passed the token check hands
out a one-time ticket, and a connection that does not open with a live
ticket and a range inside its segment is closed at once.
"""

import dataclasses
import functools
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time

from bubblesnap.protos.checksum import SlotHasher
from bubblesnap.service.errors import Aborted

log = logging.getLogger("bubblesnap.daemon")

TICKET_BYTES = 16

#: What a connection sends first: its ticket and the [start, stop) byte range.
_HEADER = struct.Struct(f"!{TICKET_BYTES}sQQ")

#: Parallel connections of one pull.
PULL_STREAMS = min(4, os.cpu_count() or 1)

#: A ticket nobody redeems is dropped (and its copy unpinned) after this long.
TICKET_SECONDS = 120.0

_RECV_CHUNK = 8 << 20


@dataclasses.dataclass
class _Offer:
    path: str
    nbytes: int
    deadline: float
    done: object
    served: int = 0


class DataServer:
    """Serves offered segments to whoever presents their ticket.

    A connection opens with the ticket and the byte range it wants; a
    segment may be read over several connections in parallel, and the offer
    ends (``done()``) once all its bytes were sent.
    """

    def __init__(self, listen: str, ssl_context: ssl.SSLContext | None = None):
        host, port = listen.rsplit(":", 1)
        self._sock = socket.create_server((host, int(port)), backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._ssl = ssl_context
        self._offers: dict[bytes, _Offer] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="data-accept", daemon=True).start()

    def offer(self, path: str, nbytes: int, done) -> bytes:
        """A ticket for reading ``nbytes`` of the file at ``path``; ``done()`` runs once
        all bytes were sent, or the ticket expired."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._offers[ticket] = _Offer(path, nbytes, time.monotonic() + TICKET_SECONDS, done)
        self._expire()
        return ticket

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            offers, self._offers = self._offers, {}
        for offer in offers.values():
            offer.done()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, offer in self._offers.items() if offer.deadline < now]
            dropped = [self._offers.pop(t) for t in stale]
        for offer in dropped:
            offer.done()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="data-send",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            header = _recv_exact(conn, _HEADER.size)
            ticket, start, stop = _HEADER.unpack(header)
            with self._lock:
                offer = self._offers.get(ticket)
            if offer is None or not 0 <= start < stop <= offer.nbytes:
                log.warning("data channel: a connection presented an unknown ticket or a bad "
                            "range; closed")
                return
            _send_file(conn, offer.path, start, stop - start)
            with self._lock:
                offer.served += stop - start
                finished = offer.served >= offer.nbytes and \
                    self._offers.pop(ticket, None) is not None
            if finished:
                offer.done()
        except (OSError, ConnectionError) as err:
            log.warning("data channel: sending failed: %s", err)
        finally:
            conn.close()


def pull(address: str, ticket: bytes, view, ranges, ssl_context: ssl.SSLContext | None = None,
         timeout: float = 60.0, received=None) -> None:
    """Reads the byte ``ranges`` of the segment offered under ``ticket`` into ``view``,
    one connection per range, in parallel.

    ``received(i, start, stop)`` is called as bytes of range ``i`` land, in
    order within the range (to hash them while they are hot).
    """
    errors: list[BaseException] = []

    def one(i: int, start: int, stop: int) -> None:
        try:
            _pull_range(address, ticket, view, start, stop, ssl_context, timeout,
                        None if received is None else functools.partial(received, i))
        except BaseException as err:  # reported by the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i, a, b), name="data-recv")
               for i, (a, b) in enumerate(ranges[1:], start=1)]
    for t in threads:
        t.start()
    if ranges:
        one(0, *ranges[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _pull_range(address, ticket, view, start, stop, ssl_context, timeout, received) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as raw:
        conn = raw
        if ssl_context is not None:
            conn = ssl_context.wrap_socket(raw, server_hostname=host)
        conn.sendall(_HEADER.pack(ticket, start, stop))
        target = memoryview(view).cast("B")
        got = start
        while got < stop:
            n = conn.recv_into(target[got:stop], min(stop - got, _RECV_CHUNK))
            if n == 0:
                raise ConnectionError(f"{address} closed the data channel after "
                                      f"{got - start} of {stop - start} bytes")
            if received is not None:
                received(got, got + n)
            got += n


def split(slots, nbytes: int, streams: int) -> list[list[tuple[int, int]]]:
    """Slots ((offset, nbytes), offset order) in up to ``streams`` contiguous groups of
    about equal bytes; a slot is never split, so each group hashes on its own."""
    groups: list[list[tuple[int, int]]] = [[]]
    per_group = nbytes / max(1, streams)
    for offset, size in slots:
        if groups[-1] and offset >= per_group * len(groups) and len(groups) < streams:
            groups.append([])
        groups[-1].append((offset, size))
    return groups


def puller(address: str, ticket: bytes, ssl_context, timeout: float, what: str,
           streams: int = PULL_STREAMS):
    """A ``fill`` for :meth:`SnapshotStore.install`: pulls a whole segment over up
    to ``streams`` connections and hashes each slot as its bytes land. ``what``
    names the copy in errors."""

    def fill(view, slots):
        groups = split(slots, len(view), streams)
        bounds = [g[0][0] if g else 0 for g in groups[1:]]
        ranges = list(zip([0, *bounds], [*bounds, len(view)], strict=True))
        hashers = [SlotHasher(g) for g in groups]
        try:
            pull(address, ticket, view, ranges, ssl_context, timeout,
                 received=lambda i, start, stop: hashers[i].feed(view, start, stop))
        except OSError as err:
            raise Aborted(f"pulling {what} from {address} failed: {err}") from err
        return tuple(d for h in hashers for d in h.digests())

    return fill


def _send_file(conn, path: str, offset: int, nbytes: int) -> None:
    # socket.sendfile: os.sendfile (zero copy) on a plain socket, waiting out a
    # full send buffer under the socket's timeout; plain sends under TLS.
    with open(path, "rb") as f:
        sent = conn.sendfile(f, offset, nbytes)
    if sent != nbytes:
        raise ConnectionError(f"{path} ended after {sent} of {nbytes} bytes")


def _recv_exact(conn, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed before sending its ticket")
        data += chunk
    return bytes(data)
