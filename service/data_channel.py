"""The bulk path between daemons: one TCP (or TLS) connection per segment.

gRPC from Python moves bulk bytes at about half of raw loopback TCP (each
message is copied several times); this channel sends a segment file with
``sendfile`` straight from shared memory, and the receiver reads it straight
into its own segment. Control stays on gRPC: a peer call that passed the
token check hands out a one-time ticket, and a connection that does not open
with a live ticket is closed at once.
"""

import logging
import secrets
import socket
import ssl
import threading
import time

from bubblesnap.protos.checksum import SlotHasher
from bubblesnap.service.errors import Aborted

log = logging.getLogger("bubblesnap.daemon")

TICKET_BYTES = 16

#: A ticket nobody redeems is dropped (and its copy unpinned) after this long.
TICKET_SECONDS = 120.0

_RECV_CHUNK = 8 << 20


class DataServer:
    """Serves offered segments to whoever presents their ticket, once each."""

    def __init__(self, listen: str, ssl_context: ssl.SSLContext | None = None):
        host, port = listen.rsplit(":", 1)
        self._sock = socket.create_server((host, int(port)), backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._ssl = ssl_context
        self._offers: dict[bytes, tuple[str, int, float, object]] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="data-accept", daemon=True).start()

    def offer(self, path: str, nbytes: int, done) -> bytes:
        """A ticket for reading ``nbytes`` of the file at ``path``; ``done()`` runs once
        the bytes were sent, failed, or the ticket expired."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._offers[ticket] = (path, nbytes, time.monotonic() + TICKET_SECONDS, done)
        self._expire()
        return ticket

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            offers, self._offers = self._offers, {}
        for _, _, _, done in offers.values():
            done()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, (_, _, deadline, _) in self._offers.items() if deadline < now]
            dropped = [self._offers.pop(t) for t in stale]
        for _, _, _, done in dropped:
            done()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="data-send",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(30)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            ticket = _recv_exact(conn, TICKET_BYTES)
            with self._lock:
                offer = self._offers.pop(ticket, None)
            if offer is None:
                log.warning("data channel: a connection presented an unknown or used ticket")
                return
            path, nbytes, _, _ = offer
            _send_file(conn, path, nbytes)
        except (OSError, ConnectionError) as err:
            log.warning("data channel: sending failed: %s", err)
        finally:
            conn.close()
            if offer is not None:
                offer[3]()


def pull(address: str, ticket: bytes, view, ssl_context: ssl.SSLContext | None = None,
         server_hostname: str | None = None, timeout: float = 60.0, received=None) -> None:
    """Reads ``len(view)`` bytes offered under ``ticket`` at ``address`` into ``view``.

    ``received(start, stop)`` is called as each range lands (to hash it hot).
    """
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as raw:
        conn = raw
        if ssl_context is not None:
            conn = ssl_context.wrap_socket(raw, server_hostname=server_hostname or host)
        conn.sendall(ticket)
        target = memoryview(view).cast("B")
        got, total = 0, len(target)
        while got < total:
            n = conn.recv_into(target[got:], min(total - got, _RECV_CHUNK))
            if n == 0:
                raise ConnectionError(f"{address} closed the data channel after {got} of "
                                      f"{total} bytes")
            if received is not None:
                received(got, got + n)
            got += n


def puller(address: str, ticket: bytes, ssl_context, timeout: float, what: str):
    """A ``fill`` for :meth:`SnapshotStore.install`: pulls a whole segment and hashes
    each slot as its bytes land. ``what`` names the copy in errors."""

    def fill(view, slots):
        hasher = SlotHasher(slots)
        try:
            pull(address, ticket, view, ssl_context, timeout=timeout,
                 received=lambda start, stop: hasher.feed(view, start, stop))
        except OSError as err:
            raise Aborted(f"pulling {what} from {address} failed: {err}") from err
        return hasher.digests()

    return fill


def _send_file(conn, path: str, nbytes: int) -> None:
    # socket.sendfile: os.sendfile (zero copy) on a plain socket, waiting out a
    # full send buffer under the socket's timeout; plain sends under TLS.
    with open(path, "rb") as f:
        sent = conn.sendfile(f, 0, nbytes)
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
