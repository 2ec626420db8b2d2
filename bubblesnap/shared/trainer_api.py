"""Where trainers reach their daemon, and the token of the calls that drop snapshots.

Both ends use this: the daemon listens by default where clients look by
default, and both name the trainer token the same way.

The default is a Unix socket, not a TCP port: the daemon makes it readable and
writable by its own user only, so no other local user can call it (a Restore
of an old step rolls back every later step on every daemon of the ring). It
lies in a folder of the user's own under ``/dev/shm`` because a trainer and
its daemon share ``/dev/shm`` anyway (they map the snapshot segments there,
containers included), and the folder is named by user id so that a client
finds its user's daemon without being told. Over TCP (``--listen
127.0.0.1:7070``) any local process can connect, so there the calls that drop
snapshots need the trainer token.
"""

import collections
import os

import grpc

#: The daemon's default ``--listen`` and the clients' default daemon: this user's socket.
DEFAULT_ADDRESS = f"unix:///dev/shm/bubblesnap-user-{os.getuid()}/daemon.sock"

#: The environment variable that, when set, overrides the clients' default daemon.
DAEMON_ENV = "BUBBLESNAP_DAEMON"

#: The environment variable the daemon and the clients read the trainer token from.
TOKEN_ENV = "BUBBLESNAP_TRAINER_TOKEN"

#: The call metadata that carries the token (as ``Bearer <token>``), as peer calls do.
TOKEN_METADATA = "authorization"


def socket_path(address: str) -> str | None:
    """The file of a ``unix:`` address (``unix:///abs/path`` or ``unix:path``); None for
    a TCP address."""
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _WithToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a channel (unary, a stream of answers and bidi:
    what the Daemon has)."""

    def __init__(self, token: str):
        self._metadata = ((TOKEN_METADATA, f"Bearer {token}"),)

    def _details(self, details):
        return _CallDetails(details.method, details.timeout,
                            (*(details.metadata or ()), *self._metadata), details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def with_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """``channel`` with the trainer ``token`` on every call; as it is without a token."""
    return grpc.intercept_channel(channel, _WithToken(token)) if token else channel
