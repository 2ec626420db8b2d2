"""Turns a servicer object into gRPC method handlers that parse requests themselves.

grpc's own deserializer answers an unparsable request with INTERNAL. A
truncated or malformed message is the caller's fault, so the handlers built
here receive raw bytes, parse them, and answer INVALID_ARGUMENT with the
message type that was expected.
"""

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from bubblesnap.service.errors import bounded


def _parse(cls, raw: bytes, context: grpc.ServicerContext):
    try:
        return cls.FromString(raw)
    except (pb_message.DecodeError, RuntimeError, ValueError) as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(
            f"malformed {cls.DESCRIPTOR.full_name} message ({len(raw)} bytes): {err}"))


def generic_handler(service_descriptor, servicer) -> grpc.GenericRpcHandler:
    """Handlers for every method of ``service_descriptor``, implemented by ``servicer``."""
    handlers = {}
    for method in service_descriptor.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        serialize = response_cls.SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _streaming(impl, request_cls), response_serializer=serialize)
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, request_cls), response_serializer=serialize)
        else:
            raise NotImplementedError(f"{method.full_name}: only unary and bidi methods are used")
    return grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers)


def _unary(impl, request_cls):
    def handle(raw, context):
        return impl(_parse(request_cls, raw, context), context)
    return handle


def _streaming(impl, request_cls):
    def handle(raw_iterator, context):
        return impl((_parse(request_cls, raw, context) for raw in raw_iterator), context)
    return handle
