"""The Expert gRPC service over one in-process `LocalExpert`.

Step calls that arrive while a forward pass runs are queued and stepped together in the next one
(up to `limits.max_batch_size` sessions), so concurrent callers share forward passes. All model
work runs on one worker thread: the event loop never blocks, and the expert's session cache is
touched from one thread only. Logits go back as raw bytes in the model's own dtype unless the
caller asks for another.

Isolation: a queued step whose caller's deadline passed (or that was cancelled) is dropped before
its forward; a released session is remembered (the last `RELEASED_MEMORY` ids) and a later Step or
Score naming it is refused with FAILED_PRECONDITION instead of re-prefilling it; Step and Score
calls in flight (`limits.max_concurrent_rpcs`), sessions waiting in the step queue
(`limits.max_queued_steps`) and sessions per Step call (`limits.max_sessions_per_step`) are capped,
beyond them RESOURCE_EXHAUSTED names the limit. Info and health answer on the event loop, never
behind the worker thread, so a long Score cannot starve them.

Sessions whose coordinator died are never released: a session not stepped for
`limits.session_idle_s` loses its KV cache (not remembered as released: a caller that was only slow
re-prefills its history), so a dead coordinator holds no memory and no autoscaling load here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import sys
import threading
import time
from pathlib import Path
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc

from fusion.compute import compute_executor
from fusion.config import FusionConfig, Limits, SecurityConfig
from fusion.errors import (FusionError, InvalidArgumentError, ResourceExhaustedError, SessionHistoryUnknownError,
                           SessionReleasedError)
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.experts.isolation import isolate_failures
from fusion.experts.shared_base import load_local_experts
from fusion.services.metrics import ExpertMetrics
from fusion.services.protos import EXPERT_SERVICE, expert_pb2, expert_pb2_grpc
from fusion.services.expert_auth import check_expert_exposure, expert_interceptors
from fusion.services.tls import server_credentials
from fusion.services.serving import RunningServer, serve_until_signalled, start_server
from fusion.services import tracing
from fusion.services.status import unary_errors
from fusion.services.wire import encode_tensor, info_to_proto, wire_dtype

logger = logging.getLogger(__name__)

__all__ = ["ExpertServicer", "create_expert_server", "run_expert_server"]


# Released session ids remembered per replica (about 100 bytes each): far more than the sessions a
# coordinator finishes while a stale call for one of them can still be queued or retried.
RELEASED_MEMORY = 65_536

# Calls the gRPC server admits beyond limits.max_concurrent_rpcs (which caps Step and Score only), so
# that health checks, Info and Release still get through while the work calls are at their cap.
CONTROL_HEADROOM = 32


class _Dropped(FusionError):
    """A queued step or score whose caller's deadline passed, or that its caller cancelled, first."""


class ReleasedSessions:
    """The most recently released session ids, at most `capacity` (the oldest are forgotten first).
    Ids longer than `_KEPT_CHARS` are kept as a 16-byte digest, so the memory stays bounded."""

    _KEPT_CHARS = 128

    def __init__(self, capacity: int = RELEASED_MEMORY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str | bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # added to on the event loop, read on the worker

    @classmethod
    def _key(cls, session_id: str) -> str | bytes:
        if len(session_id) <= cls._KEPT_CHARS:
            return session_id
        return hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, session_id: str) -> bool:
        key = self._key(session_id)
        with self._lock:
            return key in self._ids

    def add(self, session_ids: Iterable[str]) -> None:
        keys = [self._key(session_id) for session_id in session_ids]
        with self._lock:
            for key in keys:
                self._ids[key] = None
                self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def first_of(self, session_ids: Iterable[str]) -> str | None:
        return next((s for s in session_ids if s in self), None)


# Ids of the sessions' last stepped histories a replica keeps for Step calls that send only new ids
# (4 bytes each: 16 MiB), the least recently stepped dropped first; a session dropped here costs its
# caller one resend of the whole history, not a wrong answer.
HISTORY_IDS = 4 * 1024 * 1024


class SessionHistories:
    """Each session's history as of its last Step here, within `capacity` ids in all, so that a decoding
    session's Step carries only its new ids (`SessionStep.known_length`). On the event loop only."""

    def __init__(self, capacity: int = HISTORY_IDS) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return len(self._ids)

    def history(self, session: expert_pb2.SessionStep, i: int) -> list[int] | None:
        """The whole history a SessionStep stands for (None: this replica does not hold its known part)."""
        if session.known_length < 0:
            raise InvalidArgumentError(f"sessions[{i}].known_length: must not be negative")
        if session.known_length == 0:
            return list(session.token_ids)
        known = self._ids.get(session.session_id)
        if known is None or len(known) < session.known_length:
            return None
        return known[:session.known_length].tolist() + list(session.token_ids)

    def record(self, session_id: str, token_ids: list[int]) -> None:
        self.discard([session_id])
        if len(token_ids) > self.capacity:
            return
        self._ids[session_id] = array("i", token_ids)
        self._total += len(token_ids)
        while self._total > self.capacity:
            self._total -= len(self._ids.popitem(last=False)[1])

    def discard(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            dropped = self._ids.pop(session_id, None)
            if dropped is not None:
                self._total -= len(dropped)


def _deadline(context: Any) -> float | None:
    """The caller's deadline on this machine's monotonic clock (None: the call has none)."""
    time_remaining = getattr(context, "time_remaining", None)
    remaining = time_remaining() if time_remaining is not None else None
    return None if remaining is None else time.monotonic() + remaining


def _gone(context: Any) -> bool:
    """The call was cancelled or is over (on the event loop only)."""
    return any(bool(getattr(context, name, lambda: False)()) for name in ("cancelled", "done"))


@dataclass
class _Pending:
    steps: list[StepRequest]
    dtype: str
    future: asyncio.Future
    context: Any = None
    deadline: float | None = None  # monotonic

    @property
    def expired(self) -> bool:
        """Not worth computing: the caller went away or its deadline passed (safe on the worker)."""
        return self.future.done() or (self.deadline is not None and time.monotonic() >= self.deadline)


class ExpertServicer(expert_pb2_grpc.ExpertServicer):
    def __init__(self, expert: LocalExpert, limits: Limits, metrics: ExpertMetrics,
                 worker: ThreadPoolExecutor | None = None) -> None:
        """`worker`: the one-thread executor that runs the model work (default: a thread of its own;
        a server alone in its process passes the process's compute thread, `fusion.compute`)."""
        self.expert = expert
        self.limits = limits
        self.metrics = metrics
        self._owns_executor = worker is None
        self._executor = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"expert-{expert.info.name}")
        self._queue: list[_Pending] = []
        self._drainer: asyncio.Task | None = None
        self.released = ReleasedSessions()
        self.histories = SessionHistories()
        self._in_flight = 0  # Step and Score calls being served
        self._busy_since: float | None = None  # when the worker's current job started (None: idle)
        metrics.track_sessions(lambda: len(expert.cache))
        metrics.track_cache(expert.cache_stats)
        self._sweeper: asyncio.Task | None = None

    def start_idle_sweep(self) -> None:
        """On the serving event loop: drop idle sessions' caches from now on (module docstring)."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_idle())

    async def _sweep_idle(self) -> None:
        idle_s = self.limits.session_idle_s

        def drop_idle() -> list[str]:  # on the worker, which alone touches the cache
            idle = self.expert.cache.idle(idle_s)
            if idle:
                self.expert.release(idle)
            return idle

        while True:
            await asyncio.sleep(idle_s / 4)
            try:
                dropped = await self._on_worker(drop_idle)
            except RuntimeError:  # the worker shut down: the server is stopping
                return
            if dropped:
                logger.info("expert %r: dropped the caches of %d sessions idle for %.0f s or more",
                            self.expert.info.name, len(dropped), idle_s)

    def close(self) -> None:
        if self._sweeper is not None and not self._sweeper.get_loop().is_closed():
            self._sweeper.get_loop().call_soon_threadsafe(self._sweeper.cancel)  # (close runs off the loop)
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    async def _on_worker(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, *args)

    def _timed(self, fn: Callable, *args):
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._busy_since = None

    def worker_busy_s(self) -> float:
        """How long the worker thread has been on its current job (0 when idle): a forward that never
        returns shows here, while Info and health keep answering."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @contextlib.contextmanager
    def _admitted(self):
        """On the event loop: count a Step or Score call in flight, or refuse it past the cap."""
        limit = self.limits.max_concurrent_rpcs
        if self._in_flight >= limit:
            raise ResourceExhaustedError(f"limits.max_concurrent_rpcs={limit}: expert {self.expert.info.name!r} "
                                         f"has {self._in_flight} Step/Score calls in flight; try later")
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def _refuse_released(self, session_ids: Iterable[str]) -> None:
        released = self.released.first_of(session_ids)
        if released is not None:
            raise SessionReleasedError(f"session {released!r} was released on expert {self.expert.info.name!r}; "
                                       "its request is over and it is not computed again")

    # -- the service ----------------------------------------------------------------------------
    @unary_errors
    async def Step(self, request: expert_pb2.StepRequest, context) -> expert_pb2.StepResponse:
        if not request.sessions:
            raise InvalidArgumentError("sessions: must not be empty")
        limit = self.limits.max_sessions_per_step
        if len(request.sessions) > limit:
            raise ResourceExhaustedError(f"limits.max_sessions_per_step={limit}: a Step call of "
                                         f"{len(request.sessions)} sessions; split it")
        dtype = wire_dtype(request.dtype, self.expert.info.dtype)
        steps, unknown = [], []
        for i, session in enumerate(request.sessions):
            if not session.session_id:
                raise InvalidArgumentError(f"sessions[{i}].session_id: must not be empty")
            history = self.histories.history(session, i)
            if history is None:
                unknown.append(session.session_id)
            steps.append(StepRequest(session.session_id, history or []))
        self._refuse_released(s.session_id for s in steps)
        if unknown:
            raise SessionHistoryUnknownError(f"expert {self.expert.info.name!r} does not hold the history of "
                                             f"{len(unknown)} session(s) ({unknown[0]!r}, ...); send it whole")
        queued = sum(len(p.steps) for p in self._queue if not p.future.done())
        limit = self.limits.max_queued_steps
        if self._queue and queued + len(steps) > limit:
            raise ResourceExhaustedError(f"limits.max_queued_steps={limit}: expert {self.expert.info.name!r} has "
                                         f"{queued} sessions waiting to step; try later")
        # (a Serve handle's call brings no gRPC metadata: deploy's DirectContext)
        span = (tracing.start_expert_server_span("Step", getattr(context, "invocation_metadata", tuple)(),
                                                 self.expert.info.name, len(steps)) if tracing.active() else None)
        try:
            with self._admitted():
                pending = _Pending(steps, dtype, asyncio.get_running_loop().create_future(), context,
                                   _deadline(context))
                self._queue.append(pending)
                if self._drainer is None or self._drainer.done():
                    self._drainer = asyncio.create_task(self._drain())
                try:
                    logits = await pending.future
                except _Dropped as err:
                    self.histories.discard(s.session_id for s in steps)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
                except BaseException:
                    self.histories.discard(s.session_id for s in steps)
                    raise
                for step in steps:
                    if step.session_id not in self.released:  # a Release that came during the step wins
                        self.histories.record(step.session_id, step.token_ids)
                return expert_pb2.StepResponse(logits=logits)
        except BaseException as err:
            tracing.fail(span, err)
            raise
        finally:
            if span is not None:
                span.end()

    @unary_errors
    async def Score(self, request: expert_pb2.ExpertScoreRequest, context) -> expert_pb2.ExpertScoreResponse:
        if not request.session_id:
            raise InvalidArgumentError("session_id: must not be empty")
        dtype = wire_dtype(request.dtype, self.expert.info.dtype)
        self._refuse_released([request.session_id])
        deadline = _deadline(context)

        def score() -> expert_pb2.Tensor:
            if deadline is not None and time.monotonic() >= deadline:  # waited past it behind other work
                self.metrics.dropped.inc()
                raise _Dropped(f"session {request.session_id!r}: the caller's deadline passed before the score")
            logits = self.expert.score(request.session_id, list(request.token_ids), request.num_positions)
            return encode_tensor(logits, dtype)

        with self._admitted():
            # A released session is refused above; a Release arriving later runs after this score on the
            # one worker thread (jobs run in the order they were submitted), so nothing is recreated.
            try:
                logits = await self._on_worker(score)
            except _Dropped as err:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
            return expert_pb2.ExpertScoreResponse(logits=logits)

    @unary_errors
    async def Extend(self, request: expert_pb2.ExtendRequest, context) -> expert_pb2.ExtendResponse:
        if not request.session_id:
            raise InvalidArgumentError("session_id: must not be empty")
        dtype = wire_dtype(request.dtype, self.expert.info.dtype)
        self._refuse_released([request.session_id])
        deadline = _deadline(context)
        extensions = [list(e.token_ids) for e in request.extensions]

        def extend() -> expert_pb2.Tensor:
            if deadline is not None and time.monotonic() >= deadline:
                self.metrics.dropped.inc()
                raise _Dropped(f"session {request.session_id!r}: the caller's deadline passed before the extension")
            logits = self.expert.extend(request.session_id, list(request.token_ids), extensions)
            return encode_tensor(logits, dtype)

        with self._admitted():
            try:
                logits = await self._on_worker(extend)
            except _Dropped as err:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
            return expert_pb2.ExtendResponse(logits=logits)

    @unary_errors
    async def Release(self, request: expert_pb2.ReleaseRequest, context) -> expert_pb2.ReleaseResponse:
        # Remembered at once, on the event loop: a step queued for one of these sessions is refused from
        # now on, on the worker too if its batch has not started its forward; one already computing
        # runs before this release does (both run on the one worker).
        self.released.add(request.session_ids)
        self.histories.discard(request.session_ids)

        def release() -> int:
            present = sum(session_id in self.expert.cache for session_id in set(request.session_ids))
            self.expert.release(list(request.session_ids))
            return present

        return expert_pb2.ReleaseResponse(released=await self._on_worker(release))

    @unary_errors
    async def Info(self, request: expert_pb2.InfoRequest, context) -> expert_pb2.ExpertInfo:
        info = info_to_proto(self.expert.info, self.limits, active_sessions=len(self.expert.cache))
        info.keeps_histories = True  # (SessionHistories)
        return info

    # -- batching -------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Pending]:
        """Queued calls, oldest first, up to max_batch_size sessions (at least one call). A call naming
        a session already in the batch (a caller's retry) waits for the next forward. Calls whose
        caller went away or whose deadline passed are dropped; calls naming a session released since
        they arrived are refused."""
        batch, sessions, later = [], set(), []
        while self._queue:
            pending = self._queue.pop(0)
            if pending.expired or _gone(pending.context):
                self._drop(pending)
                continue
            refusal = self._refusal(pending)
            if refusal is not None:
                _settle(pending.future, error=refusal)
                continue
            ids = {s.session_id for s in pending.steps}
            if batch and (len(sessions) + len(ids) > self.limits.max_batch_size or ids & sessions):
                later.append(pending)
                continue
            batch.append(pending)
            sessions |= ids
        self._queue[:0] = later
        return batch

    def _refusal(self, pending: _Pending) -> SessionReleasedError | None:
        try:
            self._refuse_released(s.session_id for s in pending.steps)
        except SessionReleasedError as err:
            return err
        return None

    def _drop(self, pending: _Pending) -> None:
        self.metrics.dropped.inc(len(pending.steps))
        _settle(pending.future, error=_Dropped(
            f"sessions {[s.session_id for s in pending.steps]}: the caller's deadline passed, or it went away, "
            "before the step"))

    async def _drain(self) -> None:
        while self._queue:
            batch = self._take_batch()
            if not batch:
                continue
            # One bad call fails the shared forward: the runtime's one isolation policy steps the calls
            # again in halves, on the worker, so each error reaches only its own caller.
            try:
                done, errors = await self._on_worker(
                    functools.partial(isolate_failures, what=f"batched step of expert {self.expert.info.name!r}"),
                    self._step, batch)
            except Exception as err:  # the worker itself is gone (the server is closing): no call may hang
                for pending in batch:
                    _settle(pending.future, error=err)
                continue
            for positions, results in done:
                for position, result in zip(positions, results):
                    self._settle_step(batch[position], result)
            for position, err in errors.items():
                _settle(batch[position].future, error=err)

    def _settle_step(self, pending: _Pending, result: expert_pb2.Tensor | SessionReleasedError | None) -> None:
        if result is None:  # dropped on the worker
            self._drop(pending)
        elif isinstance(result, SessionReleasedError):
            _settle(pending.future, error=result)
        else:
            _settle(pending.future, result)

    def _step(self, batch: Sequence[_Pending]) -> list[expert_pb2.Tensor | SessionReleasedError | None]:
        """On the worker thread: one forward for every session of the batch still wanted, split back per
        call (None for a call dropped because its caller's deadline passed while it waited; the refusal
        for a call naming a session released since it was queued, which is no failure of the others)."""
        refusals = {id(pending): self._refusal(pending) for pending in batch if not pending.expired}
        live = [pending for pending in batch if id(pending) in refusals and refusals[id(pending)] is None]
        results: dict[int, expert_pb2.Tensor | SessionReleasedError] = {
            key: refusal for key, refusal in refusals.items() if refusal is not None}
        if live:
            steps = [s for pending in live for s in pending.steps]
            start = time.perf_counter()
            logits = self.expert.step(steps)  # (B, V)
            self.metrics.expert_step.labels(expert=self.expert.info.name).observe(time.perf_counter() - start)
            self.metrics.batch_size.observe(len(steps))
            row = 0
            for pending in live:
                tensor = encode_tensor(logits[row: row + len(pending.steps)], pending.dtype)
                self.metrics.wire_bytes.inc(len(tensor.data))
                results[id(pending)] = tensor
                row += len(pending.steps)
        return [results.get(id(pending)) for pending in batch]


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def create_expert_server(
    expert: LocalExpert,
    limits: Limits | None = None,
    address: str = "127.0.0.1:0",
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    security: SecurityConfig | None = None,
    worker: ThreadPoolExecutor | None = None,
    insecure: bool = False,
) -> tuple[RunningServer, int]:
    """Serve `expert` on `address`; returns (server, bound port). Call on the serving event loop.
    `security` (the config's section) sets TLS, client certificates and the coordinator's secret;
    beyond loopback one of them is required unless `insecure`. `worker` runs the model work (see
    `ExpertServicer`)."""
    check_expert_exposure(security, address, insecure)
    limits = limits or Limits()
    metrics = ExpertMetrics()
    servicer = ExpertServicer(expert, limits, metrics, worker)
    running = await start_server(
        servicer, expert_pb2_grpc.add_ExpertServicer_to_server, EXPERT_SERVICE, metrics,
        address=address, max_message_bytes=limits.max_message_bytes,
        metrics_port=metrics_port, metrics_host=metrics_host,
        credentials=server_credentials(security, expert=True) if security is not None else None,
        interceptors=expert_interceptors(security, EXPERT_SERVICE),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs + CONTROL_HEADROOM,
    )
    servicer.start_idle_sweep()
    running.on_stop(servicer.close)
    return running, running.port


def run_expert_server(
    config: FusionConfig,
    name: str,
    resolve_model: Callable[[str], str],
    *,
    port: int,
    host: str = "0.0.0.0",
    metrics_port: int | None = None,
    grace: float = 30.0,
    insecure: bool = False,
    cache_dir: Path | None = None,
) -> None:
    """Load expert `name` of `config` and serve it until SIGTERM/SIGINT (the `fusion serve-expert` command).
    A compiled decode step keeps its compiled code under `cache_dir/compiled`, as the local build's does."""
    check_expert_exposure(config.security, f"{host}:{port}", insecure)  # before minutes of loading
    expert_config = config.expert(name)
    expert = load_local_experts([expert_config], resolve_model,  # as every door builds experts
                                Path(cache_dir) / "compiled" if cache_dir is not None else None)[0]

    async def main() -> None:
        running, bound = await create_expert_server(expert, config.limits, f"{host}:{port}", metrics_port, host,
                                                    security=config.security, worker=compute_executor(),
                                                    insecure=insecure)
        print(f"expert {name!r} serving on {host}:{bound}", file=sys.stderr, flush=True)
        await serve_until_signalled(running, grace)

    asyncio.run(main())
