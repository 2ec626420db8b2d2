"""Turns a servicer object into gRPC method handlers that parse requests themselves.

grpc's own deserializer answers an unparsable request with INTERNAL. A
truncated or malformed message is the caller's fault, so the handlers built
here receive raw bytes, parse them, and answer INVALID_ARGUMENT with the
message type that was expected.

:func:`generic_handler` is for grpc's threaded server (the peer port).
:func:`aio_handler` is for the trainer API's ``grpc.aio`` server: each call
runs its servicer method (parsing included) in a thread of a bounded pool,
and a bidi stream does so once per request, so a stream holds no thread
between its messages however long it lives. A method that streams its answers
(one request) runs once, sends the early ones with ``CallContext.send`` and
returns the last.
"""

import asyncio
import time

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from bubblesnap.service.errors import bounded
from bubblesnap.service.rpc.status_codes import count_ok


def _parse(cls, raw: bytes, context):
    try:
        return cls.FromString(raw)
    except (pb_message.DecodeError, RuntimeError, ValueError) as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(
            f"malformed {cls.DESCRIPTOR.full_name} message ({len(raw)} bytes): {err}"))


def _methods(service_descriptor):
    """(method descriptor, request class, response serializer) of every method."""
    for method in service_descriptor.methods:
        yield (method, message_factory.GetMessageClass(method.input_type),
               message_factory.GetMessageClass(method.output_type).SerializeToString)


def generic_handler(service_descriptor, servicer) -> grpc.GenericRpcHandler:
    """Threaded-server handlers for every (unary) method of ``service_descriptor``."""
    handlers = {}
    for method, request_cls, serialize in _methods(service_descriptor):
        if method.client_streaming or method.server_streaming:
            raise NotImplementedError(f"{method.full_name}: the threaded server takes unary "
                                      "methods only (a stream would hold a thread)")
        impl = getattr(servicer, method.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            lambda raw, context, impl=impl, cls=request_cls: impl(_parse(cls, raw, context),
                                                                  context),
            response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers)


class _Abort(Exception):
    """``CallContext.abort`` from a pool thread; the event loop ends the call with it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What a servicer method running in a pool thread sees of its call (grpc.aio's own
    context belongs to the event loop): the caller's deadline, metadata and peer.
    ``abort`` raises, and the call ends with that status."""

    def __init__(self, context: grpc.aio.ServicerContext, send=None):
        left = context.time_remaining()
        self._deadline = None if left is None else time.monotonic() + left
        self._metadata = tuple(context.invocation_metadata() or ())
        self._peer = context.peer()
        self._send = send

    def send(self, answer) -> None:
        """Sends ``answer`` before the method returns its last one (a method that
        streams its answers only); thread-safe, never blocks."""
        if self._send is None:
            raise TypeError("send: this method answers once")
        self._send(answer)

    def time_remaining(self) -> float | None:
        """Seconds until the caller's deadline (None: it set none)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def peer(self) -> str:
        """Where the call came from: ``unix:...`` or ``ipv4:host:port``/``ipv6:...``."""
        return self._peer

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)


def _call(impl, request_cls, raw: bytes, context: CallContext):
    return impl(_parse(request_cls, raw, context), context)


class StreamLimit:
    """How many streams may be open at once; past it a new one is refused with
    RESOURCE_EXHAUSTED naming ``option`` (the streams cost the daemon memory)."""

    def __init__(self, most: int, option: str):
        self.most, self.open, self._option = most, 0, option

    def refusal(self) -> str | None:
        if self.open < self.most:
            return None
        return (f"this daemon has {self.open} streams open, the most {self._option} allows; "
                "raise it, or spread the ranks over more daemons")


def aio_handler(service_descriptor, servicer, pools: dict, lanes: dict[str, str],
                streams: StreamLimit) -> grpc.GenericRpcHandler:
    """``grpc.aio`` handlers for every method of ``service_descriptor``. ``pools`` are
    executors by lane name; ``lanes`` puts a method in a lane ("calls" when it names
    none); ``streams`` bounds the bidi streams open at once (counted on the loop)."""
    handlers = {}
    for method, request_cls, serialize in _methods(service_descriptor):
        impl = getattr(servicer, method.name)
        pool = pools[lanes.get(method.name, "calls")]
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _stream(servicer, method.name, impl, request_cls, pool, streams),
                response_serializer=serialize)
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, request_cls, pool), response_serializer=serialize)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _answers(impl, request_cls, pool), response_serializer=serialize)
        else:
            raise NotImplementedError(f"{method.full_name}: a client stream without a server "
                                      "stream is not used")
    return grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers)


def _unary(impl, request_cls, pool):
    async def handle(raw, context):
        call = CallContext(context)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, _call, impl, request_cls, raw, call)
        except _Abort as stop:
            await context.abort(stop.code, stop.details)
    return handle


def _answers(impl, request_cls, pool):
    """A method with one request and a stream of answers: what it ``send``s from its pool
    thread goes out as it is sent, then what it returns."""
    async def handle(raw, context):
        loop = asyncio.get_running_loop()
        sent: asyncio.Queue = asyncio.Queue()

        def send(answer) -> None:
            try:
                loop.call_soon_threadsafe(sent.put_nowait, answer)
            except RuntimeError:  # the server's loop is closed: the daemon is stopping
                pass

        call = CallContext(context, send)
        running = loop.run_in_executor(pool, _call, impl, request_cls, raw, call)
        next_sent = None
        try:
            while not running.done():
                next_sent = asyncio.ensure_future(sent.get())
                await asyncio.wait((next_sent, running), return_when=asyncio.FIRST_COMPLETED)
                if not next_sent.done():
                    break
                yield next_sent.result()
            # what was sent before the method returned is queued before its end is seen
            while not sent.empty():
                yield sent.get_nowait()
            try:
                last = await running
            except _Abort as stop:
                await context.abort(stop.code, stop.details)
            yield last
        finally:  # also when the caller went away: a method not started yet never runs
            if next_sent is not None:
                next_sent.cancel()
            if not running.cancel() and not running.cancelled():
                running.exception()  # retrieved: it went to the caller, or nobody waits for it
    return handle


def _stream(servicer, name: str, impl, request_cls, pool, streams: StreamLimit):
    async def handle(raw_requests, context):
        refusal = streams.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: {refusal}")
        streams.open += 1
        try:
            call = CallContext(context)
            loop = asyncio.get_running_loop()
            async for raw in raw_requests:
                try:
                    answer = await loop.run_in_executor(pool, _call, impl, request_cls, raw,
                                                        call)
                except _Abort as stop:
                    await context.abort(stop.code, stop.details)
                if answer is not None:
                    yield answer
            count_ok(servicer, name)
        finally:
            streams.open -= 1
    return handle
