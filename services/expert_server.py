"""The Expert gRPC service over one in-process `LocalExpert`.

Step calls that arrive while a forward pass runs are queued and stepped together in the next one
(up to `limits.max_batch_size` sessions), so concurrent callers share forward passes. All model
work runs on one worker thread: the event loop never blocks, and the expert's session cache is
touched from one thread only. Logits go back as raw bytes in the model's own dtype unless the
caller asks for another.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from fusion.config import FusionConfig, Limits, SecurityConfig
from fusion.errors import InvalidArgumentError
from fusion.expert import LocalExpert, StepRequest
from services.metrics import ExpertMetrics
from services.protos import EXPERT_SERVICE, expert_pb2, expert_pb2_grpc
from services.security import expert_interceptors, server_credentials
from services.serving import RunningServer, serve_until_signalled, start_server
from services.status import unary_errors
from services.wire import encode_tensor, info_to_proto, wire_dtype

logger = logging.getLogger(__name__)

__all__ = ["ExpertServicer", "create_expert_server", "run_expert_server"]


@dataclass
class _Pending:
    steps: list[StepRequest]
    dtype: str
    future: asyncio.Future


class ExpertServicer(expert_pb2_grpc.ExpertServicer):
    def __init__(self, expert: LocalExpert, limits: Limits, metrics: ExpertMetrics) -> None:
        self.expert = expert
        self.limits = limits
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"expert-{expert.info.name}")
        self._queue: list[_Pending] = []
        self._drainer: asyncio.Task | None = None
        metrics.track_sessions(lambda: len(expert.cache))
        metrics.track_cache(expert.cache_stats)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def _on_worker(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- the service ----------------------------------------------------------------------------
    @unary_errors
    async def Step(self, request: expert_pb2.StepRequest, context) -> expert_pb2.StepResponse:
        if not request.sessions:
            raise InvalidArgumentError("sessions: must not be empty")
        dtype = wire_dtype(request.dtype, self.expert.info.dtype)
        steps = []
        for i, session in enumerate(request.sessions):
            if not session.session_id:
                raise InvalidArgumentError(f"sessions[{i}].session_id: must not be empty")
            steps.append(StepRequest(session.session_id, list(session.token_ids)))
        pending = _Pending(steps, dtype, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return expert_pb2.StepResponse(logits=await pending.future)

    @unary_errors
    async def Score(self, request: expert_pb2.ExpertScoreRequest, context) -> expert_pb2.ExpertScoreResponse:
        if not request.session_id:
            raise InvalidArgumentError("session_id: must not be empty")
        dtype = wire_dtype(request.dtype, self.expert.info.dtype)

        def score() -> expert_pb2.Tensor:
            logits = self.expert.score(request.session_id, list(request.token_ids), request.num_positions)
            return encode_tensor(logits, dtype)

        return expert_pb2.ExpertScoreResponse(logits=await self._on_worker(score))

    @unary_errors
    async def Release(self, request: expert_pb2.ReleaseRequest, context) -> expert_pb2.ReleaseResponse:
        def release() -> int:
            present = sum(session_id in self.expert.cache for session_id in set(request.session_ids))
            self.expert.release(list(request.session_ids))
            return present

        return expert_pb2.ReleaseResponse(released=await self._on_worker(release))

    @unary_errors
    async def Info(self, request: expert_pb2.InfoRequest, context) -> expert_pb2.ExpertInfo:
        return info_to_proto(self.expert.info, self.limits, active_sessions=len(self.expert.cache))

    # -- batching -------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Pending]:
        """Queued calls, oldest first, up to max_batch_size sessions (at least one call). A call naming
        a session already in the batch (a caller's retry) waits for the next forward."""
        batch, sessions, later = [], set(), []
        while self._queue:
            pending = self._queue.pop(0)
            if pending.future.done():  # the caller went away while queued
                continue
            ids = {s.session_id for s in pending.steps}
            if batch and (len(sessions) + len(ids) > self.limits.max_batch_size or ids & sessions):
                later.append(pending)
                continue
            batch.append(pending)
            sessions |= ids
        self._queue[:0] = later
        return batch

    async def _drain(self) -> None:
        while self._queue:
            batch = self._take_batch()
            if not batch:
                continue
            try:
                results = await self._on_worker(self._step, batch)
            except Exception as err:
                if len(batch) == 1:
                    _settle(batch[0].future, error=err)
                    continue
                # One bad call fails the shared forward: step each alone so the error reaches its caller.
                for pending in batch:
                    try:
                        _settle(pending.future, (await self._on_worker(self._step, [pending]))[0])
                    except Exception as single:
                        _settle(pending.future, error=single)
                continue
            for pending, result in zip(batch, results):
                _settle(pending.future, result)

    def _step(self, batch: Sequence[_Pending]) -> list[expert_pb2.Tensor]:
        """On the worker thread: one forward for every session of the batch, split back per call."""
        steps = [s for pending in batch for s in pending.steps]
        start = time.perf_counter()
        logits = self.expert.step(steps)  # (B, V)
        self.metrics.expert_step.labels(expert=self.expert.info.name).observe(time.perf_counter() - start)
        self.metrics.batch_size.observe(len(steps))
        out, row = [], 0
        for pending in batch:
            tensor = encode_tensor(logits[row: row + len(pending.steps)], pending.dtype)
            self.metrics.wire_bytes.inc(len(tensor.data))
            out.append(tensor)
            row += len(pending.steps)
        return out


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
) -> tuple[RunningServer, int]:
    """Serve `expert` on `address`; returns (server, bound port). Call on the serving event loop.
    `security` (the config's section) sets TLS, client certificates and the coordinator's secret."""
    limits = limits or Limits()
    metrics = ExpertMetrics()
    servicer = ExpertServicer(expert, limits, metrics)
    running = await start_server(
        servicer, expert_pb2_grpc.add_ExpertServicer_to_server, EXPERT_SERVICE, metrics,
        address=address, max_message_bytes=limits.max_message_bytes,
        metrics_port=metrics_port, metrics_host=metrics_host,
        credentials=server_credentials(security, expert=True) if security is not None else None,
        interceptors=expert_interceptors(security, EXPERT_SERVICE),
    )
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
) -> None:
    """Load expert `name` of `config` and serve it until SIGTERM/SIGINT (the `fusion serve-expert` command)."""
    expert_config = config.expert(name)
    expert = LocalExpert.load(expert_config, resolve_model(expert_config.model))

    async def main() -> None:
        running, bound = await create_expert_server(expert, config.limits, f"{host}:{port}", metrics_port, host,
                                                    security=config.security)
        print(f"expert {name!r} serving on {host}:{bound}", file=sys.stderr, flush=True)
        await serve_until_signalled(running, grace)

    asyncio.run(main())
