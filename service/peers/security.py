"""Who may talk to a daemon's peer port: TLS certificates and a shared token.

Peer traffic crosses the network between hosts, unlike the trainer API
(loopback). Both ends use the same files: a certificate and key for this
host, and the CA that signed every host's certificate. ``require_client_cert``
turns on mutual TLS. The token is checked on every peer call, TLS or not; the
data channel needs no token because its tickets come from token-checked calls.
"""

import dataclasses
import hmac
import ssl

import grpc


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerSecurity:
    """How peer calls are protected. Default: plain TCP, no token (loopback tests).

    Attributes:
      token: shared secret every peer call must carry as
        ``authorization: Bearer <token>``; empty: no check.
      tls_cert, tls_key: PEM files of this daemon's certificate and key; both
        or neither. With them the peer port and the data channel speak TLS.
      tls_ca: PEM file of the CA that signed the peers' certificates (used to
        verify servers, and clients when ``require_client_cert``).
      require_client_cert: mutual TLS: peers must present a certificate the
        CA signed.
    """

    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    require_client_cert: bool = False

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("PeerSecurity.tls_cert, tls_key: --peer-tls-cert and "
                             "--peer-tls-key go together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("PeerSecurity.tls_ca: TLS between peers needs --peer-tls-ca to "
                             "verify the other daemons")
        if self.require_client_cert and not self.tls_cert:
            raise ValueError("PeerSecurity.require_client_cert: --peer-tls-client-auth needs "
                             "--peer-tls-cert and --peer-tls-key")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def add_port(self, server: grpc.Server, address: str) -> int:
        if not self.tls:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))], root_certificates=_read(self.tls_ca),
            require_client_auth=self.require_client_cert)
        return server.add_secure_port(address, creds)

    def channel(self, address: str, max_message_bytes: int) -> grpc.Channel:
        # gRPC waits out a reconnect backoff (1 s, growing to 2 min) before it
        # dials a peer that was down again; a replacement host must be reached
        # at once.
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca), private_key=_read(self.tls_key),
            certificate_chain=_read(self.tls_cert))
        return grpc.secure_channel(address, creds, options=options)

    def server_ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.tls_ca)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE
        return context

    def client_ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects every call without the shared token with UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return continuation(handler_call_details)
        method = handler_call_details.method
        message = ("peer call without a valid token: pass the same --peer-token (or "
                   "--peer-token-file) to every daemon of the group")

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {message}")

        return grpc.unary_unary_rpc_method_handler(deny)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
