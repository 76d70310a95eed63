"""The Fusion gRPC service: pure conversion between the wire and a `FusionService`.

Experts run in-process (the local build) or, where the config gives `addresses`, on remote expert
servers through `RemoteExpert`; tokenizers of remote experts are loaded here from the resolved
model path (text lives at the edge). Every request goes through the service: it layers the request
over the config's defaults, admits it off the event loop, streams text events from its continuous
batching, and frees the request's sessions on every expert when the client's stream ends, is
cancelled or expires. The service's step observer feeds the Prometheus metrics.

With an HTTP address the same process also serves the OpenAI-compatible HTTP API (`fusion.services.http_api`,
served by `fusion.services.http_server`) over the same service, metrics and API key gate; both servers stop
together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from grpc_health.v1 import health_pb2

from fusion.config import FusionConfig
from fusion.errors import ConfigError
from fusion.experts.expert import Expert
from fusion.experts.loading import load_tokenizer, tokenizer_fingerprint
from fusion.experts.shared_base import load_local_experts
from fusion.frontdoor.service import FusionService, TextEvent
from fusion.services.http_api import HttpApi
from fusion.services.http_server import start_http_server
from fusion.services.metrics import CoordinatorMetrics
from fusion.services.protos import FUSION_SERVICE, fusion_pb2, fusion_pb2_grpc
from fusion.services.remote_expert import RemoteExpert
from fusion.services.grpc_auth import fusion_interceptors
from fusion.services.key_gate import KeyGate, current_tenant
from fusion.services.tls import server_credentials
from fusion.services.serving import RunningServer, serve_until_signalled, start_server
from fusion.services import tracing
from fusion.services.status import stream_errors, unary_errors
from fusion.services.wire import description_to_proto, request_from_proto, spec_overrides_from_proto

logger = logging.getLogger(__name__)


# -- building the service ------------------------------------------------------------------------
def build_experts(config: FusionConfig, resolve_model: Callable[[str], str], cache_dir: Path | None = None
                  ) -> tuple[list[Expert], list[Any]]:
    """Each expert in-process, or remote where the config lists addresses; plus each one's tokenizer. A
    compiled decode step keeps its compiled code under `cache_dir/compiled`, as the local build's does."""
    experts, tokenizers = [], []
    try:
        # In-process experts load together: those that are adapters over one base share it (fusion.experts.shared_base).
        local = iter(load_local_experts([e for e in config.experts if not e.addresses], resolve_model,
                                        Path(cache_dir) / "compiled" if cache_dir is not None else None))
        for expert_config in config.experts:
            if not expert_config.addresses:
                expert = next(local)
                experts.append(expert)
                tokenizers.append(expert.tokenizer)
                continue
            path = resolve_model(expert_config.model)
            tokenizer = load_tokenizer(expert_config, path)
            remote = RemoteExpert(expert_config, max_message_bytes=config.limits.max_message_bytes,
                                  security=config.security, max_sessions_per_call=config.limits.max_sessions_per_step)
            experts.append(remote)
            if tokenizer_fingerprint(tokenizer) != remote.info.tokenizer_fingerprint:
                raise ConfigError(f"experts.{expert_config.name}: the tokenizer at {path!r} differs from the one "
                                  f"its replicas {expert_config.addresses} serve")
            tokenizers.append(tokenizer)
    except BaseException:
        for expert in experts:
            expert.close()
        raise
    return experts, tokenizers


def build_service(config: FusionConfig, resolve_model: Callable[[str], str], cache_dir: Path | None = None,
                  require_router: bool = True) -> FusionService:
    experts, tokenizers = build_experts(config, resolve_model, cache_dir)
    try:
        return FusionService.from_config(config, experts=experts, tokenizers=tokenizers, cache_dir=cache_dir,
                                         require_router=require_router)
    except BaseException:
        for expert in experts:
            expert.close()
        raise


# -- the service ---------------------------------------------------------------------------------
def event_to_proto(event: TextEvent) -> fusion_pb2.GenerateResponse:
    token = event.token
    response = fusion_pb2.GenerateResponse(
        request_id=token.request_id,
        index=token.index,
        token_id=token.token_id,
        text=event.text,
        logprob=token.logprob,
        top_logprobs=[fusion_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in token.top_logprobs],
        attribution=[fusion_pb2.Attribution(expert=a.expert, weight=a.weight, prob=a.prob) for a in token.attribution],
        finish_reason=event.finish_reason or "",
    )
    if event.usage is not None:
        response.usage.prompt_tokens = event.usage.prompt_tokens
        response.usage.completion_tokens = event.usage.completion_tokens
    return response


class FusionServicer(fusion_pb2_grpc.FusionServicer):
    def __init__(self, service: FusionService, metrics: CoordinatorMetrics) -> None:
        self.service = service
        self.metrics = metrics
        metrics.track_sessions(lambda: service.active)

    @stream_errors
    async def Generate(self, request: fusion_pb2.GenerateRequest, context):
        received = time.perf_counter()
        trace = self._start_trace(request, context) if tracing.active() else None  # (fusion.services.tracing)
        request_id, finish_reason, error = None, None, None

        def started(admitted_id: str, prompt_tokens: int) -> None:  # before the scheduler can step it
            nonlocal request_id
            request_id = admitted_id
            tracing.admitted(trace, admitted_id, prompt_tokens)

        try:
            stream = await self.service.submit_async(replace(request_from_proto(request), tenant=current_tenant()),
                                                     on_start=started if trace is not None else None)
            self.metrics.prompt_tokens.inc(stream.prompt_tokens)
            timer = self.metrics.stream(received)
            async with contextlib.aclosing(stream.__aiter__()) as events:  # closing it cancels the request
                async for event in events:
                    timer.token()
                    if trace is not None:
                        tracing.token(trace)
                        finish_reason = event.finish_reason or finish_reason
                    yield event_to_proto(event)
        except BaseException as err:
            error = err
            raise
        finally:
            tracing.end_request(trace, request_id, finish_reason, error)

    @staticmethod
    def _start_trace(request: fusion_pb2.GenerateRequest, context) -> tracing.RequestTrace | None:
        sampling = request.sampling
        asked = {name: getattr(sampling, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed")
                 if sampling.HasField(name)}
        return tracing.start_request("Generate", context.invocation_metadata(), time.time_ns(), asked)

    @unary_errors
    async def Score(self, request: fusion_pb2.ScoreRequest, context) -> fusion_pb2.ScoreResponse:
        spec = spec_overrides_from_proto(request.spec) if request.HasField("spec") else None
        result = await self.service.score_async(request.prompt, request.continuation, spec, current_tenant())
        response = fusion_pb2.ScoreResponse(
            token_ids=result.token_ids, logprobs=result.logprobs, total_logprob=result.total_logprob,
            pieces=result.pieces,
        )
        if result.bits_per_byte is not None:
            response.bits_per_byte = result.bits_per_byte
        return response

    @unary_errors
    async def Describe(self, request: fusion_pb2.DescribeRequest, context) -> fusion_pb2.DescribeResponse:
        return description_to_proto(self.service.describe())


def _close_service(service: FusionService) -> None:
    service.close()
    for expert in service.experts:
        expert.close()


async def create_coordinator_server(
    config: FusionConfig,
    resolve_model: Callable[[str], str] = lambda ref: ref,
    address: str = "127.0.0.1:0",
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    cache_dir: Path | None = None,
    http_address: str | None = None,
) -> tuple[RunningServer, int]:
    """Build the service (loading in-process experts, connecting to remote ones) and serve it on
    `address`; returns (server, bound port). Call on the serving event loop. `cache_dir` holds the
    `router: auto` router (default: the model cache's default place). With `http_address` the
    OpenAI-compatible HTTP API is served there too (`server.http_port`: its bound port)."""
    metrics = CoordinatorMetrics()
    service = await asyncio.to_thread(build_service, config, resolve_model, cache_dir)
    service.add_step_observer(metrics.observe_step)
    service.add_admission_observer(metrics.observe_admission)
    service.add_admission_observer(tracing.joined_batch)
    servicer = FusionServicer(service, metrics)
    try:  # one gate for both servers: a key's streams, tokens and refusals count across them
        gate = KeyGate.from_config(config.security, metrics.registry, limits=config.limits)
        running = await start_server(
            servicer, fusion_pb2_grpc.add_FusionServicer_to_server, FUSION_SERVICE, metrics,
            # Clients send requests, not logits: their messages are capped at max_request_bytes.
            address=address, max_message_bytes=config.limits.max_request_bytes,
            # Streams (at most max_concurrent_sessions) plus calls being admitted, refused or described.
            maximum_concurrent_rpcs=config.limits.max_concurrent_sessions + config.limits.max_concurrent_rpcs,
            metrics_port=metrics_port, metrics_host=metrics_host,
            credentials=server_credentials(config.security, expert=False),
            interceptors=fusion_interceptors(gate, FUSION_SERVICE),
        )
    except BaseException:
        _close_service(service)
        raise
    running.on_stop(lambda: _close_service(service))
    if gate is not None:
        running.gate = gate
        running.on_stop(gate.close)
    if http_address is not None:
        try:
            await _serve_http(running, service, metrics, gate, config, http_address)
        except BaseException:
            await running.stop(0)
            raise
    return running, running.port


async def _serve_http(running: RunningServer, service: FusionService, metrics: CoordinatorMetrics,
                      gate: KeyGate | None, config: FusionConfig, address: str) -> None:
    async def serving() -> bool:  # /health answers for the whole coordinator: its gRPC health too
        reply = await running.health.Check(health_pb2.HealthCheckRequest(service=FUSION_SERVICE), None)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    await asyncio.to_thread(service.token_bytes, 0)  # the id -> bytes table logprobs read, built off the loop
    api = HttpApi(service, metrics, gate, serving=serving, allowed_origins=config.security.allowed_origins)
    http = await start_http_server(api.app(), address, config.security, config.limits)
    running.http_port = http.port
    running.http = http
    running.on_shutdown(http.stop)
    running.on_stop(api.close)


def run_coordinator(
    config: FusionConfig,
    resolve_model: Callable[[str], str],
    *,
    port: int,
    host: str = "0.0.0.0",
    metrics_port: int | None = None,
    grace: float = 30.0,
    cache_dir: Path | None = None,
    http_port: int | None = None,
) -> None:
    """Serve the Fusion service until SIGTERM/SIGINT (the `fusion serve` command); with `http_port`,
    the OpenAI-compatible HTTP API too, from the same process and service."""

    async def main() -> None:
        http_address = f"{host}:{http_port}" if http_port is not None else None
        running, bound = await create_coordinator_server(config, resolve_model, f"{host}:{port}", metrics_port,
                                                         host, cache_dir, http_address)
        http = f", HTTP API on {host}:{running.http_port}" if running.http_port is not None else ""
        print(f"fusion coordinator serving on {host}:{bound}{http}", file=sys.stderr, flush=True)
        await serve_until_signalled(running, grace)

    asyncio.run(main())
