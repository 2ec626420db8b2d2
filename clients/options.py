"""How a client reaches its daemon, and the check every options class of the clients runs.

Options are frozen, keyword-only dataclasses that check themselves when
made, so a wrong value fails where it is written, naming the option, instead
of deep inside a training step.
"""

import dataclasses
import numbers


def check_option(options, name: str, valid: bool, rule: str) -> None:
    """Raises ValueError unless ``valid``, naming the class and the field:
    ``ClientOptions.rpc_timeout_seconds must be > 0, got -1``."""
    if not valid:
        raise ValueError(f"{type(options).__name__}.{name} must be {rule}, "
                         f"got {getattr(options, name)!r}")


def is_number(value) -> bool:
    """A real number that is not a bool (True is an int to Python, never a duration here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """How a client reaches its daemon and how patient it is.

    Attributes:
      daemon: address of the local daemon. Default ``127.0.0.1:7070``.
      rpc_timeout_seconds: deadline of each call, > 0. Default 5 s.
      backoff_seconds: after the daemon timed out or was unreachable, how long
        snapshots are skipped without asking it again, >= 0. Default 10 s.
      verify_restore: recompute checksums of restored bytes in the client too
        (the daemon checks them right before it hands a step over, and never
        writes that memory again). Default False.
      restore_timeout_seconds: deadline of a restore, which may pull the
        state from a peer or the durable tier first, > 0. Default 300 s.
    """

    daemon: str = "127.0.0.1:7070"
    rpc_timeout_seconds: float = 5.0
    backoff_seconds: float = 10.0
    verify_restore: bool = False
    restore_timeout_seconds: float = 300.0

    def __post_init__(self):
        check_option(self, "daemon", isinstance(self.daemon, str) and bool(self.daemon),
                     "an address such as 127.0.0.1:7070")
        for name in ("rpc_timeout_seconds", "restore_timeout_seconds"):
            value = getattr(self, name)
            check_option(self, name, is_number(value) and value > 0, "> 0")
        check_option(self, "backoff_seconds",
                     is_number(self.backoff_seconds) and self.backoff_seconds >= 0, ">= 0")
        check_option(self, "verify_restore", isinstance(self.verify_restore, bool),
                     "True or False")
