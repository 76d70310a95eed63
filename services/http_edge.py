"""The HTTP API's connection edge: a bounded number of connections, each on a clock.

uvicorn's h11 protocol times out only an idle keep-alive connection after a response; a connection
that never sends a request, or sends half of one, stays open for ever, so a client can hold every
file descriptor of the process. This protocol adds what Envoy and nginx have:

- a header timeout: a connection must complete a request's headers within `header_timeout_s` of
  opening (or of its previous response), else it is closed;
- a connection cap: past `max_connections`, the connection idle the longest (no request in progress)
  is closed to make room, the way nginx reuses keep-alive connections; with none idle, the new one
  is closed. So a flood of idle connections can never lock out `/health` or a real client;
- the process's open-files limit raised to its hard limit, and the cap kept below it.

Body read timeouts live in the app (`HttpApi`), which reads bodies itself.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# File descriptors kept for everything else the process opens (gRPC, experts, model files, logs).
RESERVED_FDS = 256


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.warning("could not raise the open-files limit from %d", soft)
    return soft


class ConnectionBook:
    """The edge's shared state: which connections are idle, oldest first."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.open = 0
        self.idle: OrderedDict[BoundedH11Protocol, None] = OrderedDict()
        self.evicted = 0
        self.timed_out = 0

    def make_room(self, newcomer: BoundedH11Protocol) -> bool:
        """Close the longest-idle connection when over the cap; False when none is idle."""
        while self.open > self.max_connections:
            victim = next((c for c in self.idle if c is not newcomer), None)
            if victim is None:
                return False
            self.idle.pop(victim, None)
            self.evicted += 1
            victim.close_now()
        return True


def bounded_protocol(book: ConnectionBook) -> type[H11Protocol]:
    """uvicorn's h11 protocol bound to `book` (uvicorn takes a protocol class)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"book": book})


class BoundedH11Protocol(H11Protocol):
    book: ConnectionBook

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.book.open += 1
        self._become_idle()
        if not self.book.make_room(self):
            logger.warning("HTTP connection cap max_connections=%d reached with every connection busy",
                           self.book.max_connections)
            self.close_now()

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before and self.cycle is not None:  # a request's headers arrived
            self._become_busy()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._become_idle()

    # -- idle and busy ----------------------------------------------------------------------------
    def _become_idle(self) -> None:
        book = self.book
        book.idle.pop(self, None)
        book.idle[self] = None
        self._cancel_timer()
        self._header_timer = self.loop.call_later(book.header_timeout_s, self._header_timeout)

    def _become_busy(self) -> None:
        self.book.idle.pop(self, None)
        self._cancel_timer()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.book.timed_out += 1
            self.close_now()

    def _cancel_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _forget(self) -> None:
        if not self._closed:
            self._closed = True
            self.book.open -= 1
            self.book.idle.pop(self, None)
            self._cancel_timer()

    def close_now(self) -> None:
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()
