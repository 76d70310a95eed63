"""`ApiKeyInterceptor`: the KeyGate's gRPC adapter. It reads `authorization: Bearer <key>` or
`x-api-key: <key>` on every Fusion method (health and reflection stay open for probes). Refusals:
UNAUTHENTICATED, or RESOURCE_EXHAUSTED naming the limit (or too many failed attempts) with a retry
pushback."""

from __future__ import annotations

import contextlib
import logging

import grpc

from fusion.services.api_keys import ApiKey
from fusion.services.key_gate import KeyGate, Refusal, api_key_from_headers
from fusion.services.status import abort_with_retry, call_metadata, refusing

logger = logging.getLogger(__name__)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The gRPC adapter of a `KeyGate`: every call of `service` (health and reflection stay open)
    is authenticated; Generate and Score each hold one of the key's slots while they run, and the
    handler runs as the key's tenant (`current_tenant`), whose quota the service reserves tokens on
    at admission. Refusals become status codes, with a retry pushback where a retry can succeed."""

    SLOTTED = ("Generate", "Score")

    def __init__(self, gate: KeyGate, service: str) -> None:
        self.gate = gate
        self._prefix = f"/{service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        try:
            record = await self.gate.authenticate(api_key_from_headers(call_metadata(handler_call_details)))
        except Refusal as refusal:
            return refusing(handler, refusal.grpc_code, refusal.message, refusal.retry_after_s)
        name = method[len(self._prefix):]
        self.gate.count_request(record, name)
        slotted = name in self.SLOTTED
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, record, slotted))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, record, slotted))
        return handler

    @contextlib.asynccontextmanager
    async def _held(self, context, record: ApiKey, slotted: bool):
        """The call runs as the key's tenant, in one of its slots when `slotted` (refused past its limit)."""
        try:
            ticket = self.gate.open_stream(record) if slotted else None
        except Refusal as refusal:
            await abort_with_retry(context, refusal.grpc_code, refusal.message, refusal.retry_after_s)
        try:
            with self.gate.calling_as(record):
                yield
        finally:
            if ticket is not None:
                ticket.close()

    def _unary(self, behaviour, record: ApiKey, slotted: bool):
        async def unary(request, context):
            async with self._held(context, record, slotted):
                return await behaviour(request, context)

        return unary

    def _stream(self, behaviour, record: ApiKey, slotted: bool):
        async def stream(request, context):
            async with self._held(context, record, slotted):
                async with contextlib.aclosing(behaviour(request, context)) as responses:  # closing cancels
                    async for response in responses:
                        yield response

        return stream


def fusion_interceptors(gate: KeyGate | None, service: str) -> list[grpc.aio.ServerInterceptor]:
    """The Fusion service's interceptors: its key gate's adapter (none without API keys). The HTTP API
    of the same coordinator holds the same gate, so a key's limits count both."""
    return [] if gate is None else [ApiKeyInterceptor(gate, service)]
