"""The bulk path between daemons: TCP (or TLS) connections that carry a segment; the
pulling end (``data_server`` is the serving one).

gRPC from Python moves bulk bytes at about half of raw loopback TCP (each
message is copied several times); this channel sends a segment file with
``sendfile`` straight from shared memory, and the receiver reads it straight
into its own segment, over a few connections at once (one TCP stream is
bound by one core's copying: two streams moved 1.5-2x the bytes on the dev
VM), each its own byte range of the offer. Control stays on gRPC: a peer
call that passed the token check hands out a ticket for some byte ranges,
and every byte of them is sent once, to the connection that asked first.
"""

import functools
import os
import socket
import ssl
import struct
import threading

from bubblesnap.protos.checksum import SlotHasher, new_hasher
from bubblesnap.service import progress
from bubblesnap.service.errors import Aborted
from bubblesnap.service.peers.addresses import check_address
from bubblesnap.shared.sockets import recv_exact_into

TICKET_BYTES = 16

#: What a connection sends first: its ticket and the [start, stop) byte range.
HEADER = struct.Struct(f"!{TICKET_BYTES}sQQ")

#: Parallel connections of one pull.
PULL_STREAMS = min(4, os.cpu_count() or 1)


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
            pull_range(address, ticket, view, start, stop, ssl_context, timeout,
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


def pull_range(address, ticket, view, start, stop, ssl_context, timeout, received) -> None:
    """Bytes [start, stop) of the offer into the same bytes of ``view``, over one
    connection; ``received(a, b)`` (offsets in ``view``, or None) hears each piece as it
    lands, in order. OSError when the connection fails or closes early."""
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
        conn.sendall(HEADER.pack(ticket, start, stop))
        try:
            recv_exact_into(conn, target, received)
        except ConnectionError as err:
            raise ConnectionError(f"{address} closed the data channel: {err}") from None


def read_ranges(address: str, ticket: bytes, ranges, ssl_context, timeout: float, what: str,
                streams: int = PULL_STREAMS) -> list[tuple[bytearray, int]]:
    """Each (start, stop) of ``ranges`` of an offer into a buffer of its own, over up to
    ``streams`` connections at once, hashed as it lands: [(bytes, checksum)] in order.
    ``what`` names the copy in errors (Aborted when a transfer breaks off)."""
    check_address(address, "data address")
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
        check_address(address, "data address")
        progress.expect(len(view))
        done = progress.reporter()  # the pulls run on threads of their own
        groups = split(slots, len(view), streams)
        bounds = [g[0][0] for g in groups[1:]]
        ranges = list(zip([0, *bounds], [*bounds, len(view)], strict=True))
        hashers = [SlotHasher(g) for g in groups]

        def received(i: int, start: int, stop: int) -> None:
            hashers[i].feed(view, start, stop)
            done(stop - start)

        try:
            pull(address, ticket, view, ranges, ssl_context, timeout, received=received)
        except OSError as err:
            raise Aborted(f"pulling {what} from {address} failed: {err}") from err
        return tuple(d for h in hashers for d in h.digests())

    return fill
