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
import ipaddress
import logging
import os
import re
import secrets
import socket
import ssl
import struct
import threading
import time

from bubblesnap.protos.checksum import SlotHasher, new_hasher
from bubblesnap.service.errors import Aborted, InvalidArgument, shown
from bubblesnap.sockets import recv_exact, recv_exact_into

log = logging.getLogger("bubblesnap.daemon")

TICKET_BYTES = 16

#: What a connection sends first: its ticket and the [start, stop) byte range.
_HEADER = struct.Struct(f"!{TICKET_BYTES}sQQ")

#: Parallel connections of one pull.
PULL_STREAMS = min(4, os.cpu_count() or 1)

#: A ticket nobody redeems is dropped (and its copy unpinned) after this long.
TICKET_SECONDS = 120.0

#: Connections served at once; more wait in the listen backlog.
_MAX_CONNECTIONS = 64


@dataclasses.dataclass
class _Offer:
    path: str
    allowed: tuple[tuple[int, int], ...]  # the byte ranges of the file that may be read
    deadline: float
    done: object
    served: set = dataclasses.field(default_factory=set)  # distinct (start, stop) sent
    active: int = 0  # connections sending now: the offer does not expire under them

    def permits(self, start: int, stop: int) -> bool:
        return start < stop and any(a <= start and stop <= b for a, b in self.allowed)

    def complete(self) -> bool:
        return sum(stop - start for start, stop in self.served) >= \
            sum(b - a for a, b in self.allowed)


_PORT = re.compile(r"[0-9]{1,5}")
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_address(address: str, what: str = "data address") -> None:
    """An address from a peer is host:port, the host an IP address ([...] for IPv6) or
    a DNS name (labels of 1-63 letters, digits and '-', 253 characters in all);
    InvalidArgument otherwise, before any socket or resolver sees it."""
    host, _, port = address.rpartition(":")
    if not (_PORT.fullmatch(port) and 0 < int(port) < 65536 and _is_host(host)):
        raise InvalidArgument(f"{what} {shown(address)} is not host:port (a DNS name or an "
                              "IP address, [...] around IPv6, and a port 1-65535)")


def _is_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            return ipaddress.ip_address(host).version == 6
        except ValueError:
            return False
    return 0 < len(host) <= 253 and all(_HOST_LABEL.fullmatch(label)
                                        for label in host.removesuffix(".").split("."))


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
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._accept, name="data-accept", daemon=True).start()

    def offer(self, path: str, nbytes: int, done, ranges=None) -> bytes:
        """A ticket for reading the first ``nbytes`` of the file at ``path``, or only its
        byte ``ranges`` ((start, stop) each); ``done()`` runs once: when every byte
        offered was sent, the ticket was cancelled, or it expired unused for
        ``TICKET_SECONDS``."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        allowed = tuple((a, b) for a, b in (ranges if ranges is not None else [(0, nbytes)])
                        if a < b)
        with self._lock:
            self._offers[ticket] = _Offer(path, allowed, time.monotonic() + TICKET_SECONDS,
                                          done)
        return ticket

    def cancel(self, ticket: bytes) -> None:
        """The reader will not come (its call failed): end the offer now."""
        with self._lock:
            offer = self._offers.get(ticket)
            if offer is None or offer.active:
                return  # done already, or a connection still sends: it ends the offer
            del self._offers[ticket]
        offer.done()

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
            stale = [t for t, offer in self._offers.items()
                     if offer.deadline < now and not offer.active]
            dropped = [self._offers.pop(t) for t in stale]
        for offer in dropped:
            offer.done()

    def _accept(self) -> None:
        self._sock.settimeout(1.0)  # wakes up to expire unused tickets
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._expire()
                continue
            except OSError:
                return
            self._expire()
            if not self._slots.acquire(timeout=30):
                log.warning("data channel: %d connections busy; one refused", _MAX_CONNECTIONS)
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="data-send",
                                 daemon=True).start()
            except RuntimeError as err:  # no thread to be had
                self._slots.release()
                conn.close()
                log.warning("data channel: connection refused: %s", err)

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(30)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            ticket, start, stop = _HEADER.unpack(recv_exact(conn, _HEADER.size))
            with self._lock:
                offer = self._offers.get(ticket)
                if offer is not None and offer.permits(start, stop):
                    offer.active += 1
                else:
                    offer = None
            if offer is None:
                log.warning("data channel: a connection presented an unknown ticket or a bad "
                            "range; closed")
                return
            _send_file(conn, offer.path, start, stop - start)
            with self._lock:
                offer.served.add((start, stop))
        except (OSError, ConnectionError) as err:
            log.warning("data channel: sending failed: %s", err)
        finally:
            conn.close()
            self._slots.release()
            if offer is not None:
                self._finish_connection(ticket, offer)

    def _finish_connection(self, ticket: bytes, offer: _Offer) -> None:
        with self._lock:
            offer.active -= 1
            offer.deadline = time.monotonic() + TICKET_SECONDS  # in use: not stale yet
            finished = offer.active == 0 and offer.complete() and \
                self._offers.pop(ticket, None) is not None
        if finished:
            offer.done()


def pull(address: str, ticket: bytes, view, ranges, ssl_context: ssl.SSLContext | None = None,
         timeout: float = 60.0, received=None) -> None:
    """Reads the byte ``ranges`` of the segment offered under ``ticket`` into ``view``,
    one connection per range, in parallel.

    ``received(i, start, stop)`` is called as bytes of range ``i`` land, in
    order within the range (to hash them while they are hot).
    """
    errors: list[BaseException] = []
    ranges = [(i, a, b) for i, (a, b) in enumerate(ranges) if a < b]  # zero-size slots

    def one(i: int, start: int, stop: int) -> None:
        try:
            _pull_range(address, ticket, view, start, stop, ssl_context, timeout,
                        None if received is None else functools.partial(received, i))
        except BaseException as err:  # reported by the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=r, name="data-recv") for r in ranges[1:]]
    for t in threads:
        t.start()
    if ranges:
        one(*ranges[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _pull_range(address, ticket, view, start, stop, ssl_context, timeout, received) -> None:
    _receive(address, ticket, start, stop, memoryview(view).cast("B")[start:stop], ssl_context,
             timeout, None if received is None else lambda a, b: received(start + a, start + b))


def _receive(address, ticket, start, stop, target, ssl_context, timeout, received) -> None:
    """Bytes [start, stop) of the offer into ``target``; ``received(a, b)`` hears each
    range of ``target`` as it lands."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as raw:
        conn = raw
        if ssl_context is not None:
            conn = ssl_context.wrap_socket(raw, server_hostname=host)
        conn.sendall(_HEADER.pack(ticket, start, stop))
        try:
            recv_exact_into(conn, target, received)
        except ConnectionError as err:
            raise ConnectionError(f"{address} closed the data channel: {err}") from None


def read_ranges(address: str, ticket: bytes, ranges, ssl_context, timeout: float, what: str,
                streams: int = PULL_STREAMS) -> list[tuple[bytearray, int]]:
    """Each (start, stop) of ``ranges`` of an offer into a buffer of its own, over up to
    ``streams`` connections at once, hashed as it lands: [(bytes, checksum)] in order.
    ``what`` names the copy in errors (Aborted when a transfer breaks off)."""
    check_address(address)
    buffers = [bytearray(stop - start) for start, stop in ranges]
    hashers = [new_hasher() for _ in ranges]
    pending = [(i, r) for i, r in enumerate(ranges) if r[0] < r[1]]  # zero-size shards
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        while not errors:
            with lock:
                if not pending:
                    return
                i, (start, stop) = pending.pop(0)
            view = memoryview(buffers[i])
            try:
                _receive(address, ticket, start, stop, view, ssl_context, timeout,
                         lambda a, b, i=i, view=view: hashers[i].update(view[a:b]))
            except BaseException as err:  # reported by the caller's thread
                errors.append(err)

    threads = [threading.Thread(target=work, name="data-recv")
               for _ in range(min(streams, len(pending)) - 1)]
    for t in threads:
        t.start()
    work()
    for t in threads:
        t.join()
    if errors:
        raise Aborted(f"pulling {what} from {address} failed: {errors[0]}") from errors[0]
    return [(buffer, h.intdigest()) for buffer, h in zip(buffers, hashers, strict=True)]


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
    """A ``fill`` for ``SnapshotStore.install``: pulls a whole segment over up
    to ``streams`` connections and hashes each slot as its bytes land. ``what``
    names the copy in errors."""

    def fill(view, slots):
        check_address(address)
        groups = split(slots, len(view), streams)
        bounds = [g[0][0] for g in groups[1:]]
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
