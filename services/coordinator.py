"""The Fusion gRPC service: a `FusionPipeline` behind a `Scheduler` (continuous batching across clients).

Experts run in-process (the local build) or, where the config gives `addresses`, on remote expert
servers through `RemoteExpert`; the engine cannot tell them apart. Tokenizers of remote experts are
loaded here from the resolved model path (text lives at the edge).

Generate, per request: prompt/messages + sampling overrides + fusion spec → `build_request` (limits
checked) → `Scheduler.submit` → stream token events, turning ids into text deltas with the
pipeline's TextStream; on a stop string, EOS or max_tokens the stream ends and the request's
sessions are freed on every expert. A cancelled or expired client stream cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any, Callable, Sequence

from fusion.config import ExpertConfig, FusionConfig, Limits
from fusion.engine import DecodeBatch, FusionEngine, StepTimings, TokenEvent, new_request_id
from fusion.errors import AssetError, ConfigError
from fusion.expert import Expert, LocalExpert, tokenizer_fingerprint
from fusion.pipeline import FusionPipeline
from fusion.rules import known_rules
from fusion.scheduler import Scheduler
from services.metrics import CoordinatorMetrics
from services.protos import FUSION_SERVICE, fusion_pb2, fusion_pb2_grpc
from services.remote_expert import RemoteExpert
from services.security import fusion_interceptors, server_credentials
from services.serving import RunningServer, serve_until_signalled, start_server
from services.status import stream_errors, unary_errors
from services.wire import (
    info_to_proto,
    limits_to_proto,
    prompt_from_request,
    sampling_overrides,
    sampling_to_proto,
    spec_from_proto,
    spec_to_proto,
)

logger = logging.getLogger(__name__)


# -- building the pipeline -----------------------------------------------------------------------
class _MeteredBatch(DecodeBatch):
    """A DecodeBatch that reports each step's timings (per-expert forward, fusion overhead)."""

    def __init__(self, engine: MeteredEngine) -> None:
        super().__init__(engine)
        self.metrics = engine.metrics

    def step(self):
        if not self.rows:
            return []
        self.engine.last_timings = timings = StepTimings()  # fresh: experts not stepped leave no entry
        start = time.perf_counter()
        events = super().step()
        if timings.per_expert_s:
            self.metrics.decode_step.observe(time.perf_counter() - start)
            for name, seconds in timings.per_expert_s.items():
                self.metrics.expert_step.labels(expert=name).observe(seconds)
            if timings.fuse_sample_s:
                self.metrics.fusion_overhead.observe(timings.fuse_sample_s)
        return events


class MeteredEngine(FusionEngine):
    def __init__(self, experts: Sequence[Expert], limits: Limits, device: str, metrics: CoordinatorMetrics) -> None:
        super().__init__(experts, limits, device=device)
        self.metrics = metrics

    def new_batch(self) -> DecodeBatch:
        return _MeteredBatch(self)


def load_tokenizer(config: ExpertConfig, model_path: str):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": config.gguf_file} if config.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(model_path, **kwargs)
    except (OSError, ValueError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AssetError(f"expert {config.name!r}: cannot load the tokenizer of {model_path!r}: {first_line}") from None


def build_experts(config: FusionConfig, resolve_model: Callable[[str], str]) -> tuple[list[Expert], list[Any]]:
    """Each expert in-process, or remote where the config lists addresses; plus each one's tokenizer."""
    experts, tokenizers = [], []
    for expert_config in config.experts:
        path = resolve_model(expert_config.model)
        if not expert_config.addresses:
            local = LocalExpert.load(expert_config, path)
            experts.append(local)
            tokenizers.append(local.tokenizer)
            continue
        tokenizer = load_tokenizer(expert_config, path)
        remote = RemoteExpert(expert_config, max_message_bytes=config.limits.max_message_bytes,
                              security=config.security)
        if tokenizer_fingerprint(tokenizer) != remote.info.tokenizer_fingerprint:
            raise ConfigError(f"experts.{expert_config.name}: the tokenizer at {path!r} differs from the one "
                              f"its replicas {expert_config.addresses} serve")
        experts.append(remote)
        tokenizers.append(tokenizer)
    return experts, tokenizers


def build_pipeline(
    config: FusionConfig, resolve_model: Callable[[str], str], metrics: CoordinatorMetrics
) -> FusionPipeline:
    experts, tokenizers = build_experts(config, resolve_model)
    devices = {e.info.device for e in experts}
    device = devices.pop() if len(devices) == 1 else "cpu"
    pipeline = FusionPipeline(config, MeteredEngine(experts, config.limits, device, metrics), tokenizers)
    if pipeline.uses_auto_router:  # `rule: route, path: auto`: train this trio's router once, before serving
        pipeline.prepare_router()
    return pipeline


# -- the service ---------------------------------------------------------------------------------
def token_response(event: TokenEvent, text: str, finish_reason: str | None) -> fusion_pb2.GenerateResponse:
    return fusion_pb2.GenerateResponse(
        request_id=event.request_id,
        index=event.index,
        token_id=event.token_id,
        text=text,
        logprob=event.logprob,
        top_logprobs=[fusion_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in event.top_logprobs],
        attribution=[fusion_pb2.Attribution(expert=a.expert, weight=a.weight, prob=a.prob) for a in event.attribution],
        finish_reason=finish_reason or "",
    )


class FusionServicer(fusion_pb2_grpc.FusionServicer):
    def __init__(self, pipeline: FusionPipeline, scheduler: Scheduler, metrics: CoordinatorMetrics) -> None:
        self.pipeline = pipeline
        self.config = pipeline.config
        self.scheduler = scheduler
        self.metrics = metrics
        metrics.track_sessions(lambda: scheduler.active)

    @stream_errors
    async def Generate(self, request: fusion_pb2.GenerateRequest, context):
        received = time.perf_counter()
        prompt = prompt_from_request(request)
        spec = spec_from_proto(request.spec, self.config.fusion) if request.HasField("spec") else None
        # Session ids must be unique on every expert: a client's id only prefixes ours.
        request_id = f"{request.request_id}/{new_request_id()}" if request.request_id else None
        generation = self.pipeline.build_request(prompt, sampling_overrides(request.sampling), spec, request_id)
        handle = self.scheduler.submit(generation)
        prompt_tokens = len(generation.prompt_ids[0])
        self.metrics.prompt_tokens.inc(prompt_tokens)
        text = self.pipeline.text_stream(generation)
        last = None
        async with contextlib.aclosing(handle.stream()) as events:  # closing it cancels the request
            async for event in events:
                now = time.perf_counter()
                if last is None:
                    self.metrics.time_to_first_token.observe(now - received)
                else:
                    self.metrics.inter_token_latency.observe(now - last)
                last = now
                self.metrics.tokens.inc()
                delta = text.push(event.token_id)
                reason = "stop" if text.stopped else event.finish_reason
                if reason is not None:
                    delta += text.flush()
                response = token_response(event, delta, reason)
                if reason is not None:
                    response.usage.prompt_tokens = prompt_tokens
                    response.usage.completion_tokens = event.index + 1
                yield response
                if reason is not None:
                    return

    @unary_errors
    async def Score(self, request: fusion_pb2.ScoreRequest, context) -> fusion_pb2.ScoreResponse:
        spec = spec_from_proto(request.spec, self.config.fusion) if request.HasField("spec") else None
        result = await asyncio.to_thread(self.pipeline.score, request.prompt, request.continuation, spec)
        return fusion_pb2.ScoreResponse(
            token_ids=result.token_ids, logprobs=result.logprobs, total_logprob=result.total_logprob,
        )

    @unary_errors
    async def Describe(self, request: fusion_pb2.DescribeRequest, context) -> fusion_pb2.DescribeResponse:
        experts = []
        for expert, expert_config in zip(self.pipeline.engine.experts, self.config.experts):
            sessions = len(expert.cache) if isinstance(expert, LocalExpert) else 0
            info = info_to_proto(expert.info, self.config.limits, active_sessions=sessions)
            if isinstance(expert, RemoteExpert):
                info.device = expert.replica_info.device
            experts.append(fusion_pb2.ExpertDescription(
                info=info, default_weight=expert_config.weight, addresses=expert_config.addresses,
            ))
        return fusion_pb2.DescribeResponse(
            experts=experts,
            rules=[fusion_pb2.RuleDescription(name=name, params=getattr(factory, "param_names", ()))
                   for name, factory in sorted(known_rules().items())],
            profiles=[fusion_pb2.Profile(name=name, weights=weights)
                      for name, weights in sorted(self.config.profiles.items())],
            default_spec=spec_to_proto(self.config.fusion),
            default_sampling=sampling_to_proto(self.config.sampling),
            limits=limits_to_proto(self.config.limits),
            active_requests=self.scheduler.active,
        )


def _close_pipeline(pipeline: FusionPipeline) -> None:
    pipeline.close()
    for expert in pipeline.engine.experts:
        if isinstance(expert, RemoteExpert):
            expert.close()


async def create_coordinator_server(
    config: FusionConfig,
    resolve_model: Callable[[str], str] = lambda ref: ref,
    address: str = "127.0.0.1:0",
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
) -> tuple[RunningServer, int]:
    """Build the pipeline (loading in-process experts, connecting to remote ones) and serve it on
    `address`; returns (server, bound port). Call on the serving event loop."""
    metrics = CoordinatorMetrics()
    pipeline = await asyncio.to_thread(build_pipeline, config, resolve_model, metrics)
    scheduler = Scheduler(pipeline.engine).start()
    servicer = FusionServicer(pipeline, scheduler, metrics)
    try:
        running = await start_server(
            servicer, fusion_pb2_grpc.add_FusionServicer_to_server, FUSION_SERVICE, metrics,
            address=address, max_message_bytes=config.limits.max_message_bytes,
            metrics_port=metrics_port, metrics_host=metrics_host,
            credentials=server_credentials(config.security, expert=False),
            interceptors=fusion_interceptors(config.security, FUSION_SERVICE, metrics.registry,
                                             default_max_tokens=config.sampling.max_tokens),
        )
    except BaseException:
        scheduler.stop()
        _close_pipeline(pipeline)
        raise
    running.on_stop(lambda: _close_pipeline(pipeline))
    running.on_stop(scheduler.stop)  # closers run in reverse: the scheduler stops first
    return running, running.port


def run_coordinator(
    config: FusionConfig,
    resolve_model: Callable[[str], str],
    *,
    port: int,
    host: str = "0.0.0.0",
    metrics_port: int | None = None,
    grace: float = 30.0,
) -> None:
    """Serve the Fusion service until SIGTERM/SIGINT (the `fusion serve` command)."""

    async def main() -> None:
        running, bound = await create_coordinator_server(config, resolve_model, f"{host}:{port}", metrics_port,
                                                         host)
        print(f"fusion coordinator serving on {host}:{bound}", file=sys.stderr, flush=True)
        await serve_until_signalled(running, grace)

    asyncio.run(main())
