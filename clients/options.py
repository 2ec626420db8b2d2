"""How a client reaches its daemon."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """How a client reaches its daemon and how patient it is.

    Attributes:
      daemon: address of the local daemon. Default ``127.0.0.1:7070``.
      rpc_timeout_seconds: deadline of each call. Default 5 s.
      backoff_seconds: after the daemon timed out or was unreachable, how long
        snapshots are skipped without asking it again. Default 10 s.
      verify_restore: recompute checksums of restored bytes in the client too
        (the daemon checks them right before it hands a step over, and never
        writes that memory again). Default False.
      restore_timeout_seconds: deadline of a restore, which may pull the
        state from a peer or the durable tier first. Default 300 s.
    """

    daemon: str = "127.0.0.1:7070"
    rpc_timeout_seconds: float = 5.0
    backoff_seconds: float = 10.0
    verify_restore: bool = False
    restore_timeout_seconds: float = 300.0
