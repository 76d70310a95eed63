"""What the expert and coordinator replicas share: a private event loop for their gRPC servers, the
address they advertise, and a stand-in servicer context for calls that do not arrive over gRPC.

A replica's gRPC server runs on its own `BackgroundLoop` thread, not on Serve's user-code loop, so
it neither depends on how Serve schedules user code nor blocks it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

import grpc

from fusion.services.background import BackgroundLoop
from fusion.services.status import error_from_status

_ANY_INTERFACE = {"0.0.0.0", "::", "[::]", ""}


def advertised_host(bind_host: str) -> str:
    """The host others reach this replica at: the node's IP when bound to every interface."""
    if bind_host in _ANY_INTERFACE:
        import ray

        return ray.util.get_node_ip_address()
    return bind_host


class ServerLoop(BackgroundLoop):
    """A BackgroundLoop that Serve's user-code loop can await."""

    async def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def shut_down(self, running: Any, channel: Any, grace: float) -> None:
        """Stop a replica's gRPC server (in-flight calls get `grace` seconds), close its probe channel
        if any, then this loop."""

        async def stop() -> None:
            await running.stop(grace)
            if channel is not None:
                await channel.close()

        try:
            self.run(stop(), timeout=grace + 10.0)
        finally:
            self.close()


class DirectContext:
    """The part of `grpc.aio.ServicerContext` the servicers use, for calls made through a Serve handle
    or Serve's gRPC ingress: an abort raises the matching domain error."""

    def __init__(self) -> None:
        self._code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code = code
        raise error_from_status(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def time_remaining(self) -> float | None:  # a Serve handle's call carries no gRPC deadline
        return None

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False
