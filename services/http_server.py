"""The embedded HTTP server: uvicorn serving the HTTP API's app (`fusion.services.http_api`) on the running
event loop, beside the gRPC server: one process, one service. Over TLS with the gRPC server's
certificate when the config has one; connections bounded as `fusion.services.http_edge` bounds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from fusion.config import Limits, SecurityConfig
from fusion.errors import FusionError
from fusion.services.http_edge import RESERVED_FDS, ConnectionBook, bounded_protocol, raise_open_files_limit
from fusion.services.tls import warn_if_plaintext

logger = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The host process's own handler stops every server (`fusion.services.serving.serve_until_signalled`)."""
        yield


@dataclass
class HttpServer:
    """A running HTTP server: its bound port, and its connection book (`fusion.services.http_edge`)."""

    server: uvicorn.Server
    task: asyncio.Task
    port: int
    connections: ConnectionBook

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting; requests in flight (streams too) may finish for `grace` seconds."""
        # uvicorn's wait with timeout 0 times out before it looks, and logs an error even when idle
        self.server.config.timeout_graceful_shutdown = None if grace is None else max(grace, 0.05)
        self.server.should_exit = True
        await self.task


def _bind(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, int(port)), family=family)
    except (OSError, ValueError) as err:
        raise FusionError(f"cannot listen on {address}: {getattr(err, 'strerror', None) or err}") from None


async def start_http_server(app: FastAPI, address: str, security: SecurityConfig | None = None,
                            limits: Limits | None = None) -> HttpServer:
    """Serve `app` on `address` ("host:0" picks a free port) on the running event loop; over TLS when
    the config's security section has a `tls` section (the gRPC server's certificate), else plaintext.
    Connections are bounded by `limits` (`fusion.services.http_edge`)."""
    sock = _bind(address)
    tls = security.tls if security is not None and not security.plaintext else None
    if tls is None:
        warn_if_plaintext(address, "the HTTP API")
    limits = limits or Limits()
    open_files = raise_open_files_limit()
    max_connections = max(16, min(limits.max_http_connections, open_files - RESERVED_FDS))
    if max_connections < limits.max_http_connections:
        logger.warning("max_http_connections=%d lowered to %d: the process may open %d files",
                       limits.max_http_connections, max_connections, open_files)
    book = ConnectionBook(max_connections, limits.http_header_timeout_s)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                            http=bounded_protocol(book), timeout_keep_alive=max(1, int(limits.http_keep_alive_s)),
                            ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()
            raise FusionError(f"the HTTP API did not start on {address}")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1], book)
