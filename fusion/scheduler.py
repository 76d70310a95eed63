"""Continuous batching for many concurrent callers over one engine.

A background thread owns a `DecodeBatch`: between steps it admits waiting requests (up to
`max_batch_size` rows) and drops cancelled ones, then has the process's compute thread
(`fusion.compute`) step every active row at once. Requests arrive validated (`FusionService.admit`).
Each caller gets a `RequestHandle` to read its events from, synchronously or with `async for`. Requests beyond
`max_concurrent` (running + waiting) are refused with `ServiceBusyError`, never queued
without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from typing import AsyncIterator, Iterator

from fusion.engine import ErrorEvent, FusionEngine, GenerationRequest, TokenEvent
from fusion.errors import ServiceBusyError

logger = logging.getLogger(__name__)

_DONE = object()


class RequestHandle:
    """One request's stream of TokenEvents; ends after the event with a finish reason."""

    def __init__(self, scheduler: Scheduler, request: GenerationRequest) -> None:
        self.scheduler = scheduler
        self.request = request
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._lock = threading.Lock()
        self.cancelled = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _put(self, item) -> None:
        with self._lock:
            listeners = list(self._listeners)
            if not listeners:
                self._queue.put(item)
        for loop, aqueue in listeners:
            try:
                loop.call_soon_threadsafe(aqueue.put_nowait, item)
            except RuntimeError:  # the listener's event loop has closed: nobody is reading any more
                with self._lock:
                    self._listeners.remove((loop, aqueue))

    def cancel(self) -> None:
        """Stop generating; the engine frees the request's sessions on every expert."""
        self.cancelled = True
        self.scheduler._cancel(self)

    def __iter__(self) -> Iterator[TokenEvent]:
        try:
            while True:
                item = self._queue.get()
                if item is _DONE:
                    return
                if isinstance(item, ErrorEvent):
                    raise item.error
                yield item
        finally:
            self.cancel()

    async def stream(self) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        aqueue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            while not self._queue.empty():  # anything that arrived before we listened
                aqueue.put_nowait(self._queue.get())
            self._listeners.append((loop, aqueue))
        try:
            while True:
                item = await aqueue.get()
                if item is _DONE:
                    return
                if isinstance(item, ErrorEvent):
                    raise item.error
                yield item
        finally:
            self.cancel()


class Scheduler:
    def __init__(self, engine: FusionEngine, max_concurrent: int | None = None, max_batch_size: int | None = None):
        self.engine = engine
        self.max_concurrent = max_concurrent or engine.limits.max_concurrent_sessions
        self.max_batch_size = max_batch_size or engine.limits.max_batch_size
        self._batch = engine.new_batch()
        self._waiting: deque[RequestHandle] = deque()
        self._running: dict[str, RequestHandle] = {}
        self._cancelled: set[str] = set()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="fusion-scheduler", daemon=True)
        self.steps = 0

    # -- public -------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._running) + len(self._waiting)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a validated request, or refuse it at once when the concurrency limit is reached."""
        handle = RequestHandle(self, request)
        with self._cond:
            if self._stopped:
                raise ServiceBusyError("the server is shutting down")
            if len(self._running) + len(self._waiting) >= self.max_concurrent:
                raise ServiceBusyError(
                    f"too many concurrent sessions: the limit max_concurrent_sessions={self.max_concurrent} is reached"
                )
            self._waiting.append(handle)
            self._cond.notify_all()
        return handle

    # -- internals ----------------------------------------------------------------------------
    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            if handle in self._waiting:
                self._waiting.remove(handle)
                handle._put(_DONE)
            elif handle.request_id in self._running:
                self._cancelled.add(handle.request_id)
            self._cond.notify_all()

    def _admit(self) -> list[str]:
        """Under the lock: move waiting requests into the batch; return the cancelled requests, whose
        sessions the loop frees after dropping the lock (a slow expert must not block `submit`)."""
        cancelled = []
        for request_id in self._cancelled:
            handle = self._running.pop(request_id, None)
            if handle is not None:
                cancelled.append(request_id)
                handle._put(_DONE)
        self._cancelled.clear()
        while self._waiting and len(self._running) < self.max_batch_size:
            handle = self._waiting.popleft()
            try:
                self._batch.add(handle.request)
            except Exception as err:  # validated at admission; a late failure still reaches its caller
                handle._put(ErrorEvent(handle.request_id, err))
                continue
            self._running[handle.request_id] = handle
        return cancelled

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._waiting and not self._running and not self._cancelled:
                    self._cond.wait()
                if self._stopped:
                    break
                cancelled = self._admit()
                idle = not self._running
            for request_id in cancelled:
                self._batch.cancel(request_id)
            if idle:
                continue
            try:
                events = self._batch.step()
            except Exception as err:  # a bug must not kill the loop: fail the batch, keep serving
                logger.exception("decode step failed")
                events = [ErrorEvent(rid, err) for rid in list(self._running)]
                self._batch.cancel_all()
            self.steps += 1
            with self._cond:
                for event in events:
                    handle = self._running.get(event.request_id)
                    if handle is None:
                        continue
                    handle._put(event)
                    if isinstance(event, ErrorEvent) or event.finish_reason is not None:
                        self._running.pop(event.request_id, None)
                        handle._put(_DONE)
        # Shutting down: end every stream.
        with self._cond:
            for handle in list(self._running.values()) + list(self._waiting):
                handle._put(ErrorEvent(handle.request_id, ServiceBusyError("the server is shutting down")))
                handle._put(_DONE)
            self._batch.cancel_all()
            self._running.clear()
            self._waiting.clear()
