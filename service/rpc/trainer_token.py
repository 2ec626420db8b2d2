"""Who may drop snapshots through the trainer API: callers on the Unix socket, or with the token.

The daemon's Unix socket is owner-only (its file mode), so whoever calls
through it is this user. Over TCP any local process can connect; there the
calls that drop snapshots (a Restore that is not ``alone`` rolls back every
later step on every daemon of the ring; DeleteSnapshots; a FinishSave that drops a
save in flight) must carry the
trainer token, ``authorization: Bearer <token>`` as peer calls do. A daemon
on TCP without a token refuses them.
"""

import hmac

from bubblesnap.service.errors import Unauthenticated
from bubblesnap.shared.trainer_api import TOKEN_ENV, TOKEN_METADATA


class TrainerToken:
    """Checks the calls that drop snapshots; ``token`` empty: none is configured."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode() if token else b""

    def check(self, context, call: str) -> None:
        """Unauthenticated unless ``context``'s call came over the Unix socket or carries
        the token; ``call`` names what was refused."""
        if context.peer().startswith("unix:"):
            return
        given = dict(context.invocation_metadata()).get(TOKEN_METADATA, "")
        if self._expected and hmac.compare_digest(given.encode(), self._expected):
            return
        configured = ("give the client the daemon's token (ClientOptions.token or "
                      f"{TOKEN_ENV})" if self._expected else
                      f"start the daemon with --trainer-token-file FILE (or {TOKEN_ENV}) and "
                      "give the client the same token (ClientOptions.token or "
                      f"{TOKEN_ENV})")
        raise Unauthenticated(f"{call} came over TCP without the trainer token: {configured}, "
                              "or call through the daemon's Unix socket (--listen unix:PATH, "
                              "the default)")
