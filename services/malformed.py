"""Requests whose bytes do not decode as their message: INVALID_ARGUMENT naming the method, never a
server traceback (every gRPC server installs `MalformedRequestInterceptor`)."""

from __future__ import annotations

import contextlib
import logging

import grpc


logger = logging.getLogger(__name__)


class _Undecodable:
    """What a request that does not parse as its message type becomes (instead of gRPC's UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as err:  # DecodeError, bad UTF-8, wrong wire types
            return _Undecodable(err)

    return deserialize


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request get INVALID_ARGUMENT naming the message type
    (gRPC itself answers UNKNOWN and logs a traceback). Install innermost: authentication first."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        method = handler_call_details.method

        def message(request: _Undecodable) -> str:
            first = (str(request.error).splitlines() or [type(request.error).__name__])[0]
            return f"{method}: the request is not a valid message: {first[:200]}"

        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                return await behaviour(request, context)

            return handler._replace(unary_unary=unary, request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_stream is not None:
            behaviour = handler.unary_stream

            async def stream(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                async with contextlib.aclosing(behaviour(request, context)) as responses:  # closed with us
                    async for response in responses:
                        yield response

            return handler._replace(unary_stream=stream, request_deserializer=_lenient(handler.request_deserializer))
        return handler
