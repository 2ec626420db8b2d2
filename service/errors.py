"""Errors the daemon's parts raise; the gRPC layer maps each to a status code.

Every message says what was wrong and what to do about it: it is read by a
person looking at a failed training job.
"""


class DaemonError(Exception):
    """Base class: a request the daemon refused. Nothing it held was changed."""


class InvalidArgument(DaemonError):
    """The request itself is malformed (bad name, shape, dtype, checksum count)."""


class NotFound(DaemonError):
    """The job, rank or step named does not exist here."""


class AlreadyExists(DaemonError):
    """A conflicting registration is already held."""


class FailedPrecondition(DaemonError):
    """The request is well formed but the state does not allow it now."""


class ResourceExhausted(DaemonError):
    """Honouring the request would pass the memory budget or fill shared memory."""


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
