"""Continuous batching for many concurrent callers over one engine.

A background thread owns a `DecodeBatch`: between steps it admits waiting requests (up to
`max_batch_size` rows, shared between tenants by weight: `Scheduler`) and drops cancelled ones, then
has the process's compute thread (`fusion.compute`) step every active row at once; between steps it
runs the side jobs callers hand it (score chunks). Requests arrive validated (`FusionService.admit`).
Each caller gets a `RequestHandle` to read its events from, synchronously or with `async for`.
Requests beyond `max_concurrent` (running + waiting) are refused with `ServiceBusyError`, never
queued without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from fusion.compute import run_on_compute_thread
from fusion.engine.core import SCORE_CHUNK, FusionEngine
from fusion.engine.types import ErrorEvent, GenerationRequest, TokenEvent
from fusion.errors import ServiceBusyError
from fusion.engine.tenancy import Tenant, VirtualClock, fair_pick, should_preempt

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
        self.enqueued = 0.0  # monotonic time it first waited
        self.row = None  # its decode state while preempted (sessions kept on every expert)

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


# While requests decode, a job run between two steps (a score chunk) is sized to take about this
# share of a step: what another tenant's inter-token time may grow by for it.
SIDE_JOB_SHARE = 0.4
SIDE_JOB_MAX_POSITIONS = SCORE_CHUNK
SIDE_JOB_MIN_POSITIONS = 32


def _smoothed(previous: float | None, value: float, weight: float = 0.2) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value


@dataclass
class _SideJob:
    tenant: Tenant
    fn: Callable[[int], list]
    future: Future


class Scheduler:
    """Admits waiting requests into one decode batch, shared between tenants by weight.

    Each tenant waits in its own first-in-first-out queue. A free batch slot goes to the waiting tenant
    with the fewest running requests per unit of weight (`fair_pick`); when the batch is full and a
    tenant waits below its share while another runs above it, the other gives back its latest request
    (`should_preempt`): that request leaves the batch with its sessions kept and resumes when a slot is
    its tenant's again, so what it lost is time, never tokens. Alone, a tenant uses every slot.

    Requests beyond `max_concurrent` (running + waiting) are refused at once; a request that waits
    longer than `max_queue_wait_s` for its first slot is refused then, both with a retry time.
    """

    def __init__(self, engine: FusionEngine, max_concurrent: int | None = None, max_batch_size: int | None = None,
                 max_queue_wait_s: float | None = None,
                 admission_observers: list[Callable[[str, str, float], None]] | None = None):
        self.engine = engine
        # Called with (request id, tenant id, seconds waited) as each request first joins the batch,
        # under the scheduler's lock (keep them cheap: metrics and traces are two).
        self.admission_observers = admission_observers if admission_observers is not None else []
        self.max_concurrent = max_concurrent or engine.limits.max_concurrent_sessions
        self.max_batch_size = max_batch_size or engine.limits.max_batch_size
        self.max_queue_wait_s = max_queue_wait_s if max_queue_wait_s is not None else engine.limits.max_queue_wait_s
        self.score_slice_s = engine.limits.score_slice_s
        self._batch = engine.new_batch()
        self._waiting: dict[str, deque[RequestHandle]] = {}  # per tenant, in arrival order
        self._waiting_count = 0
        self._running: dict[str, RequestHandle] = {}
        self._running_per_tenant: Counter[str] = Counter()
        self._weights: dict[str, float] = {}
        self._last_admitted: dict[str, int] = {}
        self._admissions = 0
        self._side: dict[str, deque[_SideJob]] = {}  # jobs run between steps (score chunks), per tenant
        self._side_clock = VirtualClock()
        self._step_s: float | None = None  # a decode step's time, smoothed
        self._position_s: float | None = None  # a side job's time per position, smoothed
        self._side_s = 0.0  # how long the last side job took
        self._decode_since_side = 0.0  # decode time since then
        self._cancelled: set[str] = set()
        self._detached_cancelled: list[RequestHandle] = []  # preempted requests cancelled while waiting
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="fusion-scheduler", daemon=True)
        self.steps = 0
        self.preemptions = 0
        self.side_jobs = 0

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
            return len(self._running) + self._waiting_count

    def running_by_tenant(self) -> dict[str, int]:
        with self._cond:
            return {t: n for t, n in self._running_per_tenant.items() if n}

    def run_between_steps(self, tenant: Tenant, job: Callable[[int], list]) -> list:
        """`job(positions)` on the compute thread between two decode steps (blocking the caller); it
        does at most `positions` positions of work and returns one result per position done. One such
        job runs after each step, taken from the tenants in weighted fair order of the time their jobs
        took. While requests decode, side jobs get at most half the compute thread's time and each is
        sized to about SIDE_JOB_SHARE of a decode step; with nothing decoding, to about
        `limits.score_slice_s`, so a request arriving then waits about that for its prefill (both
        at least SIDE_JOB_MIN_POSITIONS)."""
        job = _SideJob(tenant, job, Future())
        with self._cond:
            if self._stopped:
                raise ServiceBusyError("the server is shutting down")
            self._side.setdefault(tenant.id, deque()).append(job)
            self._cond.notify_all()
        return job.future.result()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a validated request, or refuse it at once when the concurrency limit is reached."""
        handle = RequestHandle(self, request)
        with self._cond:
            if self._stopped:
                raise ServiceBusyError("the server is shutting down")
            if len(self._running) + self._waiting_count >= self.max_concurrent:
                raise ServiceBusyError(
                    f"too many concurrent sessions: the limit max_concurrent_sessions={self.max_concurrent} is "
                    "reached", retry_after_s=1.0)
            self._enqueue(handle, front=False)
            self._cond.notify_all()
        return handle

    # -- internals ----------------------------------------------------------------------------
    def _enqueue(self, handle: RequestHandle, front: bool) -> None:
        tenant = handle.request.tenant
        self._weights[tenant.id] = tenant.weight
        queue_ = self._waiting.setdefault(tenant.id, deque())
        if front:
            queue_.appendleft(handle)
        else:
            handle.enqueued = time.monotonic()
            queue_.append(handle)
        self._waiting_count += 1

    def _dequeue(self, tenant: str) -> RequestHandle:
        queue_ = self._waiting[tenant]
        handle = queue_.popleft()
        if not queue_:
            del self._waiting[tenant]
        self._waiting_count -= 1
        return handle

    def _remove_waiting(self, handle: RequestHandle) -> bool:
        queue_ = self._waiting.get(handle.request.tenant.id)
        if queue_ is None or handle not in queue_:
            return False
        queue_.remove(handle)
        if not queue_:
            del self._waiting[handle.request.tenant.id]
        self._waiting_count -= 1
        return True

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            if self._remove_waiting(handle):
                if handle.row is not None:  # preempted: its sessions are still held
                    self._detached_cancelled.append(handle)
                else:
                    handle._put(_DONE)
            elif handle.request_id in self._running:
                self._cancelled.add(handle.request_id)
            self._cond.notify_all()

    def _leave(self, request_id: str) -> RequestHandle | None:
        handle = self._running.pop(request_id, None)
        if handle is not None:
            self._running_per_tenant[handle.request.tenant.id] -= 1
        return handle

    def _join(self, handle: RequestHandle) -> None:
        first = handle.row is None  # not a preempted request coming back
        try:
            if handle.row is not None:
                self._batch.attach(handle.row)
                handle.row = None
            else:
                self._batch.add(handle.request)
        except Exception as err:  # validated at admission; a late failure still reaches its caller
            handle._put(ErrorEvent(handle.request_id, err))
            return
        tenant = handle.request.tenant.id
        if first:
            waited = time.monotonic() - handle.enqueued
            for observer in self.admission_observers:
                observer(handle.request_id, tenant, waited)
        self._running[handle.request_id] = handle
        self._running_per_tenant[tenant] += 1
        self._admissions += 1
        self._last_admitted[tenant] = self._admissions

    def _preempt(self, tenant: str) -> bool:
        """Move `tenant`'s latest running request back to the front of its queue, sessions kept."""
        for request_id in reversed(list(self._running)):
            handle = self._running[request_id]
            if handle.request.tenant.id != tenant:
                continue
            row = self._batch.detach(request_id)
            if row is None:
                return False
            self._leave(request_id)
            handle.row = row
            self._enqueue(handle, front=True)
            self.preemptions += 1
            return True
        return False

    def _expire(self, now: float) -> None:
        """Refuse requests that waited past max_queue_wait_s for their first slot."""
        for tenant in list(self._waiting):
            for handle in list(self._waiting.get(tenant, ())):
                if handle.row is not None:
                    continue  # preempted after it started: it waits for its share, never refused
                deadline = handle.enqueued + self.max_queue_wait_s
                if deadline <= now:
                    self._remove_waiting(handle)
                    handle._put(ErrorEvent(handle.request_id, ServiceBusyError(
                        f"no batch slot within max_queue_wait_s={self.max_queue_wait_s:g}: every slot is "
                        "held by requests within their share", retry_after_s=1.0)))
                    handle._put(_DONE)

    def _next_side_job(self) -> _SideJob | None:
        """Under the lock: the side job of the tenant whose jobs took the least time per unit of weight."""
        if not self._side:
            return None
        self._side_clock.activate(self._side)
        tenant = min(self._side, key=self._side_clock.key)
        jobs = self._side[tenant]
        job = jobs.popleft()
        if not jobs:
            del self._side[tenant]
        return job

    def _side_positions(self, decoding: bool) -> int:
        """Positions for the next side job: about SIDE_JOB_SHARE of a decode step while requests decode,
        else about `score_slice_s` (what a request arriving now may wait before its prefill); never
        fewer than SIDE_JOB_MIN_POSITIONS, below which a chunk's fixed cost (a forward that reads every
        weight, the experts' calls) would dominate and a long score would take many times longer."""
        if self._position_s is None:
            return SIDE_JOB_MIN_POSITIONS
        budget = SIDE_JOB_SHARE * self._step_s if decoding and self._step_s is not None else self.score_slice_s
        return max(SIDE_JOB_MIN_POSITIONS, min(SIDE_JOB_MAX_POSITIONS, int(budget / self._position_s)))

    def _run_side(self, job: _SideJob, decoding: bool) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        self.side_jobs += 1
        start = time.perf_counter()
        done = 0
        try:
            result = run_on_compute_thread(job.fn, self._side_positions(decoding))
            done = len(result)
            job.future.set_result(result)
        except BaseException as err:  # the caller gets it; the loop goes on
            job.future.set_exception(err)
        took = time.perf_counter() - start
        self._side_s, self._decode_since_side = took, 0.0
        if done:
            self._position_s = _smoothed(self._position_s, took / done)
        with self._cond:
            self._side_clock.charge(job.tenant.id, took, job.tenant.weight)

    def _admit(self) -> list[str]:
        """Under the lock: move waiting requests into the batch, fairly; return the cancelled requests,
        whose sessions the loop frees after dropping the lock (a slow expert must not block `submit`)."""
        cancelled = []
        for request_id in self._cancelled:
            handle = self._leave(request_id)
            if handle is not None:
                self._batch.detach(request_id)
                cancelled.append(request_id)
                handle._put(_DONE)
        for handle in self._detached_cancelled:
            cancelled.append(handle.request_id)
            handle.row = None
            handle._put(_DONE)
        self._detached_cancelled.clear()
        self._cancelled.clear()
        while self._waiting:
            tenant = fair_pick(self._waiting, self._running_per_tenant, self._weights, self._last_admitted)
            if len(self._running) >= self.max_batch_size:
                victim = should_preempt(tenant, self._running_per_tenant, self._weights)
                if victim is None or not self._preempt(victim):
                    break
            self._join(self._dequeue(tenant))
        return cancelled

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    self._expire(time.monotonic())  # only waits behind running requests: checked every step
                    if (self._waiting_count or self._running or self._cancelled or self._detached_cancelled
                            or self._side):
                        break
                    self._cond.wait()
                if self._stopped:
                    break
                cancelled = self._admit()
                idle = not self._running
                side = self._next_side_job() if idle else None
            for request_id in cancelled:
                self._batch.release(request_id)
            if idle:
                if side is not None:
                    self._run_side(side, decoding=False)
                continue
            started = time.perf_counter()
            try:
                events = self._batch.step()
            except Exception as err:  # a bug must not kill the loop: fail the batch, keep serving
                logger.exception("decode step failed")
                events = [ErrorEvent(rid, err) for rid in list(self._running)]
                self._batch.cancel_all()
            took = time.perf_counter() - started
            self._step_s = _smoothed(self._step_s, took)
            self._decode_since_side += took
            self.steps += 1
            with self._cond:
                for event in events:
                    handle = self._running.get(event.request_id)
                    if handle is None:
                        continue
                    handle._put(event)
                    if isinstance(event, ErrorEvent) or event.finish_reason is not None:
                        self._leave(event.request_id)
                        handle._put(_DONE)
                # Side jobs get at most half the time while requests decode: one runs once the steps
                # since the last one took as long as it did.
                side = self._next_side_job() if self._decode_since_side >= self._side_s else None
            if side is not None:  # after the step: a request admitted just now steps first
                self._run_side(side, decoding=True)
        # Shutting down: end every stream.
        with self._cond:
            waiting = [h for queue_ in self._waiting.values() for h in queue_]
            for handle in list(self._running.values()) + waiting:
                handle._put(ErrorEvent(handle.request_id, ServiceBusyError("the server is shutting down")))
                handle._put(_DONE)
            self._batch.cancel_all()
            for handle in waiting + self._detached_cancelled:
                if handle.row is not None:  # preempted: its sessions are still held
                    self._batch.release(handle.request_id)
            self._detached_cancelled.clear()
            self._running.clear()
            self._waiting.clear()
            self._waiting_count = 0
            for jobs in self._side.values():
                for job in jobs:
                    job.future.set_exception(ServiceBusyError("the server is shutting down"))
            self._side.clear()
