"""Reading exact byte counts from stream sockets (the daemon's data channel, the examples' links).

``socket.recv`` may return fewer bytes than asked for; every framed protocol
here needs "exactly n bytes or an error", so it is written once.
"""

import socket


def recv_exact_into(conn: socket.socket, view, received=None, chunk: int = 8 << 20) -> None:
    """Fills the writable buffer ``view`` from ``conn``; ConnectionError if it closes first.

    ``received(start, stop)`` hears each range of ``view`` as it lands, in
    order (to hash the bytes while they are in cache).
    """
    target = memoryview(view).cast("B")
    got, total = 0, len(target)
    while got < total:
        n = conn.recv_into(target[got:], min(total - got, chunk))
        if n == 0:
            raise ConnectionError(f"the other end closed the connection after {got} of "
                                  f"{total} bytes")
        if received is not None:
            received(got, got + n)
        got += n


def recv_exact(conn: socket.socket, nbytes: int) -> bytearray:
    """Exactly ``nbytes`` bytes from ``conn``; ConnectionError if it closes first."""
    buffer = bytearray(nbytes)
    recv_exact_into(conn, buffer)
    return buffer
