"""What both servers share: gRPC options, health and reflection, binding, graceful shutdown.

A `RunningServer` owns one `grpc.aio` server plus what must close with it (the metrics endpoint,
the scheduler, worker threads). `stop(grace)` first reports NOT_SERVING on health, then stops
accepting RPCs and lets in-flight ones finish for up to `grace` seconds, then closes the rest.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fusion.errors import FusionError
from fusion.services.metrics import ServerMetrics, serve_metrics
from fusion.services.malformed import MalformedRequestInterceptor
from fusion.services.tls import warn_if_plaintext

logger = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Message limits raised on both ends (the 4 MiB default is too small for batched logits)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# Keepalive: a channel pings its server every KEEPALIVE_TIME_MS, with or without calls in flight, and
# drops the connection when a ping is unanswered for KEEPALIVE_TIMEOUT_MS, failing its calls with
# UNAVAILABLE: a peer that vanished (powered off, partitioned, its packets black-holed) is noticed
# within about 15 s even between calls, instead of when TCP gives up (minutes). Servers accept pings
# that often: MIN_PING_INTERVAL_MS is below the channels' interval (a server answers pings more
# frequent than its minimum with GOAWAY "too_many_pings").
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MIN_PING_INTERVAL_MS = 5_000


def keepalive_channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # no cap on pings between data frames
    ]


def keepalive_server_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass
class RunningServer:
    grpc_server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    servicer: Any
    metrics: ServerMetrics
    metrics_port: int | None = None
    http_port: int | None = None  # the coordinator's HTTP API, when it serves one
    http: Any = None  # the coordinator's HttpServer (its connection book), when it serves one
    gate: Any = None  # the coordinator's KeyGate (both servers' API keys and limits), when keys are set
    _closers: list[Callable[[], Any]] = field(default_factory=list)
    _stoppers: list[Callable[[float | None], Awaitable[None]]] = field(default_factory=list)
    _stopped: bool = False

    def on_stop(self, closer: Callable[[], Any]) -> None:
        """Run `closer` (sync, in a worker thread) after the gRPC server has stopped."""
        self._closers.append(closer)

    def on_shutdown(self, stopper: Callable[[float | None], Awaitable[None]]) -> None:
        """Await `stopper(grace)` beside the gRPC server's graceful stop (another server of the same service)."""
        self._stoppers.append(stopper)

    async def stop(self, grace: float | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.grpc_server.stop(grace), *(stopper(grace) for stopper in self._stoppers))
        for closer in reversed(self._closers):
            try:
                await asyncio.to_thread(closer)
            except Exception:
                logger.exception("error while shutting down")

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def start_server(
    servicer: Any,
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    metrics: ServerMetrics,
    *,
    address: str,
    max_message_bytes: int,
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
) -> RunningServer:
    """Serve `servicer` with health and reflection on `address` ("host:0" picks a free port); over TLS
    with `credentials`, else plaintext. `interceptors` see every call (authentication, limits). Past
    `maximum_concurrent_rpcs` calls in flight gRPC itself answers RESOURCE_EXHAUSTED."""
    options = channel_options(max_message_bytes) + keepalive_server_options() + [("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options, interceptors=[*interceptors, MalformedRequestInterceptor()],
                             maximum_concurrent_rpcs=maximum_concurrent_rpcs)
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            warn_if_plaintext(address, service_name)
            port = server.add_insecure_port(address)
    except RuntimeError:
        raise FusionError(f"cannot listen on {address}: the address is in use or not valid here") from None
    running = RunningServer(server, port, health_servicer, servicer, metrics)
    if metrics_port is not None:
        try:
            http, running.metrics_port = serve_metrics(metrics.registry, metrics_port, metrics_host)
        except OSError as err:
            raise FusionError(f"metrics: cannot listen on {metrics_host}:{metrics_port}: {err.strerror or err}") from None
        running.on_stop(http.shutdown)
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("%s serving on port %d%s", service_name, port,
                f", metrics on {running.metrics_port}" if running.metrics_port is not None else "")
    return running


async def serve_until_signalled(running: RunningServer, grace: float) -> None:
    """Block until SIGTERM or SIGINT, then shut down gracefully within `grace` seconds."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(running.wait_for_termination())
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, signalled], return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down (grace %.0f s)", grace)
    await running.stop(grace)
    for task in (waiter, signalled):
        task.cancel()
