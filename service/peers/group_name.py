"""Which group a peer call belongs to: every call names its sender's group, and a daemon
refuses calls from another.

Two groups of daemons can reach each other's addresses: a host's address reused by
a daemon of another group (a replaced pod's IP, a port taken between being chosen and
bound), or two rings sharing a network. Without a name a daemon would serve
whoever dialled it: take their copies, answer their holdings queries, and restore
a job of the same name from the wrong group's bytes. A call without the name (a
tool, ``grpcurl``) is served as before; the token (``--peer-token``) is what keeps
strangers out.
"""

import grpc

#: The metadata key each peer call carries its sender's group name under.
METADATA_KEY = "bubblesnap-group"


def metadata(name: str) -> tuple[tuple[str, str], ...]:
    """The metadata a call from a daemon of group ``name`` carries."""
    return ((METADATA_KEY, name),)


class GroupNameInterceptor(grpc.ServerInterceptor):
    """Refuses, with PERMISSION_DENIED, every call that names a group other than
    ``name``."""

    def __init__(self, name: str):
        self._name = name

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY)
        if given is None or given == self._name:
            return continuation(handler_call_details)
        message = (f"{handler_call_details.method}: this daemon is in peer group "
                   f"{self._name[:100]!r}, the call came from group {given[:100]!r}: two "
                   "groups reach each other's addresses (a reused host address?); each "
                   "group needs its own --group-name (with etcd: --coordination-prefix)")

        def refuse(request, context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

        return grpc.unary_unary_rpc_method_handler(refuse)
