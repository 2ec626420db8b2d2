"""The serving end of the data channel: offered segments sent to whoever presents their ticket.

Anyone who reaches the port can open a connection, so nothing is spent on
one until it proved itself: a connection holds no thread and no send slot
until its ticket header (and TLS handshake) is in, all of it within
``HEADER_SECONDS`` (one deadline, not one per read: a byte every few seconds
does not keep it open). The header is read by one thread for all opening
connections (a selector); past ``MAX_OPENING`` of them the oldest is
dropped, and a peer's own connection sends its header at once, so silent or
slow sockets cannot crowd out transfers. A ticket is good for the byte
ranges it was issued for, each byte of them sent once: a range asked twice,
or outside the offer, is refused, and a ticket whose ranges were all asked
for is gone. A send that makes no progress for ``SEND_IDLE_SECONDS`` ends.
"""

import dataclasses
import logging
import secrets
import selectors
import socket
import ssl
import threading
import time

from bubblesnap.service.peers.data_channel import HEADER, TICKET_BYTES

log = logging.getLogger("bubblesnap.daemon")

#: A ticket nobody redeems is dropped (and its copy unpinned) after this long.
TICKET_SECONDS = 120.0

#: A connection must have sent its whole header (after its TLS handshake) by then.
HEADER_SECONDS = 5.0

#: Connections that have not sent their header yet; past this the oldest is dropped.
MAX_OPENING = 256

#: A send that the reader lets make no progress for this long is ended.
SEND_IDLE_SECONDS = 30.0

#: Sends at once; a connection with a good ticket waits up to SEND_IDLE_SECONDS for one.
_MAX_SENDS = 64

#: A gated offer's bytes go in pieces of this size, the gate asked before each.
GATED_PIECE_BYTES = 1 << 20
#: ... and of this size when the gate may hold them back (pacing), the socket's send
#: buffer kept as small: what the gate lets go then crosses the link soon after
#: (64 KiB: 2.6 ms at 200 Mbit/s), not a 4 MiB buffer's worth after the bubble ended.
HELD_PIECE_BYTES = 64 << 10


@dataclasses.dataclass
class _Offer:
    path: str
    allowed: tuple[tuple[int, int], ...]  # the byte ranges of the file that may be read
    deadline: float
    done: object
    gate: object = None  # gate(nbytes) before each piece: it may hold the send back
    # (a gate whose ``holds_back`` is true: pieces and send buffer are kept small)
    claimed: list = dataclasses.field(default_factory=list)  # (start, stop) asked for so far
    active: int = 0  # connections sending now: the offer does not expire under them

    def claim(self, start: int, stop: int) -> bool:
        """Takes [start, stop) if it lies in one allowed range and no byte of it was
        asked for before."""
        if not (start < stop and any(a <= start and stop <= b for a, b in self.allowed)):
            return False
        if any(start < b and a < stop for a, b in self.claimed):
            return False
        self.claimed.append((start, stop))
        return True

    def used_up(self) -> bool:
        return sum(b - a for a, b in self.claimed) >= sum(b - a for a, b in self.allowed)


@dataclasses.dataclass
class _Opening:
    """A connection whose header has not arrived yet."""

    conn: socket.socket
    deadline: float
    header: bytearray = dataclasses.field(default_factory=bytearray)
    shaken: bool = False  # TLS handshake done (or no TLS)


class DataServer:
    """Serves offered segments to whoever presents their ticket.

    A connection opens with the ticket and the byte range it wants; a
    segment may be read over several connections in parallel (each its own
    part of it), and the offer ends (``done()``) once every byte was asked
    for and the sends ended.
    """

    def __init__(self, listen: str, ssl_context: ssl.SSLContext | None = None):
        host, port = listen.rsplit(":", 1)
        self._sock = socket.create_server((host, int(port)), backlog=128)
        self._sock.setblocking(False)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._ssl = ssl_context
        self._offers: dict[bytes, _Offer] = {}
        self._opening: dict[socket.socket, _Opening] = {}  # oldest first
        self._lock = threading.Lock()
        self._sends = threading.BoundedSemaphore(_MAX_SENDS)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._closed = False
        self._sent_bytes = 0
        threading.Thread(target=self._run, name="data-accept", daemon=True).start()

    def offer(self, path: str, nbytes: int, done, ranges=None, gate=None) -> bytes:
        """A ticket for reading the first ``nbytes`` of the file at ``path``, or only its
        byte ``ranges`` ((start, stop) each), every byte once; ``done()`` runs once:
        when every byte offered was asked for and sent (or failed to), the ticket was
        cancelled, or it expired unused for ``TICKET_SECONDS``. ``gate(nbytes)``, if
        given, is called on the sending thread before each piece of at most
        ``GATED_PIECE_BYTES``; where ``gate.holds_back`` it may wait (pacing the bytes
        into idle windows), and the pieces and the send buffer are
        ``HELD_PIECE_BYTES``."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        allowed = tuple((a, b) for a, b in (ranges if ranges is not None else [(0, nbytes)])
                        if a < b)
        with self._lock:
            self._offers[ticket] = _Offer(path, allowed, time.monotonic() + TICKET_SECONDS,
                                          done, gate)
        return ticket

    @property
    def sent_bytes(self) -> int:
        """Bytes sent since the start (the metrics' counter), counted piece by piece as
        they go: a paced send in flight counts what it sent so far."""
        with self._lock:
            return self._sent_bytes

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

    # -- the selector thread: accept, handshake, header ------------------------------------

    def _run(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(timeout=0.5)
            except OSError:
                return
            for key, _ in events:
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    self._advance(self._opening.get(key.fileobj))
            self._drop_late()
            self._expire()
        for opening in list(self._opening.values()):
            self._drop(opening)
        self._selector.close()

    def _accept(self) -> None:
        for _ in range(128):  # a burst: take some, then read the headers that came
            try:
                raw, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed, or out of descriptors: the next round retries
                return
            raw.setblocking(False)
            conn = raw
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(raw, server_side=True,
                                             do_handshake_on_connect=False)
            if len(self._opening) >= MAX_OPENING:
                self._drop(next(iter(self._opening.values())))
            self._opening[conn] = _Opening(conn, time.monotonic() + HEADER_SECONDS,
                                           shaken=self._ssl is None)
            self._selector.register(conn, selectors.EVENT_READ)

    def _advance(self, opening: _Opening | None) -> None:
        if opening is None:
            return
        conn = opening.conn
        try:
            if not opening.shaken:
                conn.do_handshake()
                opening.shaken = True
            # Until the socket runs dry: TLS may hold decrypted bytes the selector never sees.
            while len(opening.header) < HEADER.size:
                chunk = conn.recv(HEADER.size - len(opening.header))
                if not chunk:
                    self._drop(opening)
                    return
                opening.header += chunk
        except ssl.SSLWantWriteError:
            self._selector.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._selector.modify(conn, selectors.EVENT_READ)
            return
        except OSError as err:  # ssl.SSLError included: not our peer
            log.info("data channel: a connection failed before its header: %s", err)
            self._drop(opening)
            return
        self._forget(opening)
        self._admit(conn, *HEADER.unpack(opening.header))

    def _forget(self, opening: _Opening) -> None:
        self._selector.unregister(opening.conn)
        del self._opening[opening.conn]

    def _drop(self, opening: _Opening) -> None:
        self._forget(opening)
        opening.conn.close()

    def _drop_late(self) -> None:
        now = time.monotonic()
        late = [o for o in self._opening.values() if o.deadline < now]
        for opening in late:
            self._drop(opening)
        if late:
            log.info("data channel: %d connections sent no ticket within %.0f s; closed",
                     len(late), HEADER_SECONDS)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, offer in self._offers.items()
                     if offer.deadline < now and not offer.active]
            dropped = [self._offers.pop(t) for t in stale]
        for offer in dropped:
            offer.done()

    # -- sending ---------------------------------------------------------------------------

    def _admit(self, conn: socket.socket, ticket: bytes, start: int, stop: int) -> None:
        with self._lock:
            offer = self._offers.get(ticket)
            if offer is not None and offer.claim(start, stop):
                offer.active += 1
                if offer.used_up():  # every byte asked for: the ticket is spent
                    del self._offers[ticket]
            else:
                offer = None
        if offer is None:
            log.warning("data channel: a connection presented an unknown or spent ticket, or "
                        "a range outside its offer or asked for before; closed")
            conn.close()
            return
        try:
            threading.Thread(target=self._send, args=(conn, ticket, offer, start, stop),
                             name="data-send", daemon=True).start()
        except RuntimeError as err:  # no thread to be had
            conn.close()
            log.warning("data channel: connection refused: %s", err)
            self._finish(ticket, offer)

    def _count_sent(self, nbytes: int) -> None:
        with self._lock:
            self._sent_bytes += nbytes

    def _send(self, conn: socket.socket, ticket: bytes, offer: _Offer, start: int,
              stop: int) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(SEND_IDLE_SECONDS)  # per wait for room to send: an idle timeout
            if not self._sends.acquire(timeout=SEND_IDLE_SECONDS):
                log.warning("data channel: %d sends busy; one refused", _MAX_SENDS)
                return
            try:
                _send_file(conn, offer.path, start, stop - start, offer.gate, self._count_sent)
            finally:
                self._sends.release()
        except OSError as err:
            log.warning("data channel: sending failed: %s", err)
        finally:
            conn.close()
            self._finish(ticket, offer)

    def _finish(self, ticket: bytes, offer: _Offer) -> None:
        with self._lock:
            offer.active -= 1
            offer.deadline = time.monotonic() + TICKET_SECONDS  # in use: not stale yet
            finished = offer.active == 0 and offer.used_up()
            if finished:
                self._offers.pop(ticket, None)
        if finished:
            offer.done()


def _send_file(conn, path: str, offset: int, nbytes: int, gate=None, counted=None) -> None:
    # socket.sendfile: os.sendfile (zero copy) on a plain socket, waiting out a
    # full send buffer under the socket's timeout; plain sends under TLS. Each piece
    # is counted once sent (``counted``): a paced send lasts seconds, and what it
    # sent so far is on the link already.
    piece = GATED_PIECE_BYTES if gate is not None else max(nbytes, 1)
    if gate is not None and gate.holds_back:
        piece = HELD_PIECE_BYTES
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, HELD_PIECE_BYTES)
    sent = 0
    with open(path, "rb") as f:
        for start in range(offset, offset + nbytes, piece):
            count = min(piece, offset + nbytes - start)
            if gate is not None:
                gate(count)
            done = conn.sendfile(f, start, count)
            sent += done
            if counted is not None:
                counted(done)
    if sent != nbytes:
        raise ConnectionError(f"{path} ended after {sent} of {nbytes} bytes")
