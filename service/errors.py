"""Errors the daemon's parts raise; the gRPC layer maps each to a status code.

Every message says what was wrong and what to do about it: it is read by a
person looking at a failed training job. Messages are bounded
(:data:`MAX_MESSAGE_BYTES`): gRPC carries them in a header, and an answer
whose header passes the caller's metadata limit arrives as
RESOURCE_EXHAUSTED, not as what went wrong. Input a message repeats goes
through :func:`shown`, cut short.
"""

#: The most bytes (UTF-8) of one error message; a longer one is cut.
MAX_MESSAGE_BYTES = 1024

#: How much of a value from the wire a message repeats, by default.
SHOWN_CHARACTERS = 80


def shown(value, limit: int = SHOWN_CHARACTERS) -> str:
    """``value`` as a message repeats it: ``ascii()`` (non-ASCII escaped, so gRPC's
    header encoding cannot multiply it), cut to about ``limit`` characters and
    then saying how long it was."""
    text = ascii(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} {'characters' if isinstance(value, str) else 'items'}" \
        if hasattr(value, "__len__") else f"{len(text)} characters shown"
    return f"{text[:limit]}... ({size})"


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut to at most ``limit`` UTF-8 bytes, saying that it was."""
    encoded = message.encode("utf-8", "replace")
    if len(encoded) <= limit:
        return message
    cut = encoded[:limit - 40].decode("utf-8", "ignore")
    return f"{cut}... ({len(encoded) - len(cut.encode())} more bytes cut)"


def reason(err: Exception) -> str:
    """What went wrong, in a line: a gRPC error by its code and details (its str() is a
    multi-line debug dump), anything else as it says it."""
    code = getattr(err, "code", None)
    if callable(code) and callable(getattr(err, "details", None)):
        return f"{code().name}: {err.details()}"
    return str(err)


class DaemonError(Exception):
    """Base class: a request the daemon refused. Nothing it held was changed.

    The message is :func:`bounded`, whatever the part raising it put in."""

    def __init__(self, message: str = ""):
        super().__init__(bounded(str(message)))


class InvalidArgument(DaemonError):
    """The request itself is malformed (bad name, shape, dtype, checksum count)."""


class NotFound(DaemonError):
    """The job, rank or step named does not exist here."""


class AlreadyExists(DaemonError):
    """A conflicting registration is already held."""


class FailedPrecondition(DaemonError):
    """The request is well formed but the state does not allow it now."""


class ResourceExhausted(DaemonError):
    """Honouring the request would pass the memory budget, fill shared memory, or pass
    the log budget (``--log-budget``)."""


class DataLoss(DaemonError):
    """Bytes held no longer match their checksum."""


class Aborted(DaemonError):
    """A transfer between daemons broke off; trying again may work."""


class Unavailable(DaemonError):
    """The copies that exist could not be reached now (peers down or busy)."""


class Unauthenticated(DaemonError):
    """A call that drops snapshots came over TCP without the trainer token."""


class DeadlineExceeded(DaemonError):
    """The caller's deadline passed before the answer; what the call reserved is released."""
