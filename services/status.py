"""Domain errors ↔ gRPC status codes, in one table used by every server and client (and the same
errors as HTTP statuses, for the OpenAI-compatible API).

Servers wrap their handlers with `unary_errors` / `stream_errors`: a domain error becomes its status
code with the error's message (which names the bad field); anything else becomes INTERNAL and is
logged. A bad request never takes the server down. Clients turn a status back into the domain error
with `error_from_status`, so the CLI prints one clear line for remote and local runs alike.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math

import grpc

from fusion.errors import (
    ConfigError,
    ExpertOutputError,
    ExpertUnavailableError,
    FusionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ServiceBusyError,
    SessionHistoryUnknownError,
    SessionReleasedError,
)

logger = logging.getLogger(__name__)

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

# Checked in order: the first matching class wins. Only domain errors map to a client's fault: every check
# raises one naming the field (fusion.engine.admission), so any other exception, a ValueError included, is a bug
# and answers INTERNAL with the details in the server's log.
STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ExpertUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ExpertOutputError, grpc.StatusCode.INTERNAL),
    (SessionReleasedError, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionHistoryUnknownError, grpc.StatusCode.ABORTED),
)

ERROR_BY_STATUS: dict[grpc.StatusCode, type[FusionError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: ExpertUnavailableError,
    grpc.StatusCode.FAILED_PRECONDITION: SessionReleasedError,
    grpc.StatusCode.ABORTED: SessionHistoryUnknownError,
}


# The HTTP API's statuses. A request past a size limit (prompt, max_tokens, stop strings) is a bad
# request there, as OpenAI answers a prompt over the context; only a busy service is 429 (clients
# retry 429 and 503, which is pointless for a request that is too large).
HTTP_STATUS_BY_ERROR: tuple[tuple[type[BaseException], int], ...] = (
    (NotFoundError, 404),
    (InvalidArgumentError, 400),
    (ConfigError, 400),
    (ServiceBusyError, 429),
    (ResourceExhaustedError, 400),
    (ExpertUnavailableError, 503),
    (ExpertOutputError, 500),
)


def status_for(err: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in STATUS_BY_ERROR:
        if isinstance(err, cls):
            return code, str(err)
    if isinstance(err, FusionError):
        return grpc.StatusCode.INTERNAL, str(err)
    # Not a domain error: its text may hold paths or tensors; the server logs it, the client gets the type.
    return grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__}); the server's log has the details"


def http_status_for(err: BaseException) -> tuple[int, str]:
    """(HTTP status, message) of an error; the message as `status_for` gives it."""
    for cls, status in HTTP_STATUS_BY_ERROR:
        if isinstance(err, cls):
            return status, str(err)
    return 500, status_for(err)[1]


def error_from_status(code: grpc.StatusCode, details: str) -> FusionError:
    """The domain error for a status a server sent (a plain FusionError for codes without one)."""
    cls = ERROR_BY_STATUS.get(code, FusionError)
    return cls(details if cls is not FusionError else f"{code.name}: {details}")


def error_from_rpc(err: grpc.RpcError, where: str | None = None) -> FusionError:
    """The domain error for a failed call; `where` (e.g. which expert replica) prefixes the message."""
    details = err.details() or err.code().name
    return error_from_status(err.code(), f"{where}: {details}" if where else details)


async def _abort(context: grpc.aio.ServicerContext, method: str, err: Exception) -> grpc.StatusCode:
    code, message = status_for(err)
    if code == grpc.StatusCode.INTERNAL and not isinstance(err, FusionError):
        logger.error("%s failed", method, exc_info=err)
    await abort_with_retry(context, code, message, retry_after_s(err))  # raises AbortError
    return code


async def abort_with_retry(context, code: grpc.StatusCode, message: str, retry_after_s: float | None) -> None:
    """Abort the call; with a retry time (a busy service, a key's window or slots), gRPC's retry
    pushback trailer says when to try again."""
    if retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(max(1, math.ceil(retry_after_s * 1000)))),))
    await context.abort(code, message)


def retry_after_s(err: BaseException) -> float | None:
    """When a retry of the refused request may succeed (None: not known, or never)."""
    return getattr(err, "retry_after_s", None) if isinstance(err, ServiceBusyError) else None


def _aborted_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def unary_errors(method):
    """Decorate a unary servicer method: domain errors become status codes; requests are counted by
    code on `self.metrics`."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context):
        code = grpc.StatusCode.UNKNOWN
        try:
            response = await method(self, request, context)
            code = grpc.StatusCode.OK
            return response
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            code = _aborted_code(context)
            raise
        except Exception as err:
            code = status_for(err)[0]
            await _abort(context, name, err)
        finally:
            self.metrics.count_request(name, code)

    return handler


def stream_errors(method):
    """Like `unary_errors`, for server-streaming methods (async generators)."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context):
        code = grpc.StatusCode.UNKNOWN
        try:
            async for item in method(self, request, context):
                yield item
            code = grpc.StatusCode.OK
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            code = _aborted_code(context)
            raise
        except Exception as err:
            code = status_for(err)[0]
            await _abort(context, name, err)
        finally:
            self.metrics.count_request(name, code)

    return handler


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
              retry_after_s: float | None = None) -> grpc.RpcMethodHandler:
    """The same method (same deserialisers), answering only `code`."""

    async def unary(request, context):
        await abort_with_retry(context, code, message, retry_after_s)

    async def stream(request, context):
        await abort_with_retry(context, code, message, retry_after_s)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=stream)
    return handler  # client-streaming methods: none in these services


def call_metadata(details: grpc.HandlerCallDetails) -> dict[str, str]:
    """A call's metadata as text values by lower-case key (the first value of each; binary ones skipped)."""
    out = {}
    for key, value in details.invocation_metadata or ():
        if isinstance(value, bytes):
            continue
        out.setdefault(key.lower(), value)
    return out
