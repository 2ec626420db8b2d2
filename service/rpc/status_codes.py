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


def unary(method):
    """For a unary method of a servicer that has ``metrics``."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            response = method(self, request, context)
        except Exception as err:
            _abort(self, method.__name__, context, err)
        self.metrics.rpcs.labels(method.__name__, "OK").inc()
        return response

    return wrapper


def streaming(method):
    """For a bidi method written as its answer to one request (None: no answer): an
    error in any request ends the stream with its code."""

    @functools.wraps(method)
    def wrapper(self, requests, context):
        for request in requests:
            try:
                answer = method(self, request, context)
            except Exception as err:
                _abort(self, method.__name__, context, err)
            if answer is not None:
                yield answer
        self.metrics.rpcs.labels(method.__name__, "OK").inc()

    return wrapper
