"""The daemon's errors as gRPC status codes, for both services; every answer is counted.

A method decorated here converts, calls and converts back; a ``DaemonError``
raised below it becomes its status code with the error's message. Anything
else is a bug: it is logged with its traceback and answered INTERNAL, and
the daemon keeps running with everything it held.
"""

import functools
import logging

import grpc

from bubblesnap.service import errors

log = logging.getLogger("bubblesnap.daemon")

CODES = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _abort(servicer, name: str, context, err: Exception) -> None:
    if isinstance(err, errors.DaemonError):
        code = CODES[type(err)]
        log.info("%s refused: %s: %s", name, code.name, err)
        message = str(err)
    else:
        code = grpc.StatusCode.INTERNAL
        log.exception("%s failed", name)
        message = errors.bounded(f"daemon error: {errors.shown(err, 400)}")
    servicer.metrics.rpcs.labels(name, code.name).inc()
    context.abort(code, message)


def late(context) -> bool:
    """Whether the caller's deadline has passed: nobody waits for the answer any more."""
    left = context.time_remaining()
    return left is not None and left <= 0


def unary(method=None, *, run_late: bool = False):
    """For a unary method of a servicer that has ``metrics``. A call whose deadline
    passed while it waited for a thread is not run (DEADLINE_EXCEEDED): nobody waits
    for it, and what it would reserve or roll back would be nobody's. ``run_late``:
    it is run even so, because it keeps what the caller already handed over (a commit
    of bytes in shared memory, a log record); dropping those would lose them."""
    if method is None:
        return functools.partial(unary, run_late=run_late)

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            if not run_late and late(context):
                raise errors.DeadlineExceeded(f"{method.__name__}: the caller's deadline "
                                              "passed before the daemon could start on it")
            response = method(self, request, context)
        except Exception as err:
            _abort(self, method.__name__, context, err)
        count_ok(self, method.__name__)
        return response

    return wrapper


def streaming(method):
    """For a bidi method written as its answer to one request (None: no answer); the
    server calls it for each request of the stream in turn (``handlers``). An error in
    any request ends the stream with its code."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as err:
            _abort(self, method.__name__, context, err)

    return wrapper


def count_ok(servicer, name: str) -> None:
    """Counts a call (or a whole stream) of ``name`` that ended well."""
    servicer.metrics.rpcs.labels(name, "OK").inc()
