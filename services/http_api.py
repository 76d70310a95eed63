"""The OpenAI-compatible HTTP API over a `FusionService`: pure conversion, as the gRPC servicer is.

    GET  /v1/models             the fused model and each weight profile
    POST /v1/chat/completions   chat messages -> choices (server-sent events with `stream: true`)
    POST /v1/completions        text prompts -> choices
    GET  /health                200 while the coordinator serves (its gRPC health too), else 503
    GET  /v1/fusion/describe    the service's description (gRPC's Describe as JSON): experts, rules, ...
    GET  / and /playground      the web playground (`services/playground/`: static files, no key needed)

A request is authenticated by the coordinator's `KeyGate` (the same keys, limits and counters as
gRPC: `Authorization: Bearer <key>` or `x-api-key`), read (at most `limits.max_request_bytes`),
planned (`fusion.services.openai_wire`: one service request per choice), admitted by the service and
metered token by token against the key's limits. A stream's response starts with its first token,
so an error before it (a field the service refuses, no free slot, a lost expert) is an HTTP status
with OpenAI's error body; one after it is an `error` event before `[DONE]`. A client that
disconnects cancels every stream of its request, which frees their sessions on every expert
(`fusion.services.http_streams`).

`HttpApi.app()` is the ASGI app; `fusion.services.http_server` serves it beside the gRPC server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from fusion.errors import FusionError
from fusion.frontdoor.service import FusionService, RequestStream
from fusion.engine.tenancy import LOCAL
from fusion.services import tracing
from fusion.services.api_keys import ApiKey
from fusion.services.http_streams import Echo, Generation, ResponseBuilder, prompt_only_events, stream_body
from fusion.services.key_gate import KeyGate, KeyStream, Refusal, TokenBucket, api_key_from_headers
from fusion.services.metrics import CoordinatorMetrics
from fusion.services.openai_errors import ApiError, client_field
from fusion.services.openai_requests import Kind
from fusion.services.openai_wire import Plan, model_ids, plan_request
from fusion.services.status import http_status_for, retry_after_s

logger = logging.getLogger(__name__)

MODEL_NAME = "fusion"  # the fused model's id; each profile is `fusion:<profile>`
_ERROR_CODES = {404: "not_found", 429: "server_busy", 500: "internal_error", 503: "expert_unavailable"}

PLAYGROUND_DIR = Path(__file__).parent / "playground"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")  # a client's x-request-id we echo back
# Bodies above this are parsed only within their key's http_parse_bytes_per_s (`HttpApi._parse_turn`).
LARGE_BODY_BYTES = 64 * 1024
# The playground's files: what the page loads, with its content type; nothing else is served from there.
_PLAYGROUND_FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
                     "playground.css": "text/css; charset=utf-8"}
# The page loads only its own files and talks only to this server.
_PLAYGROUND_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache",
}


def describe_json(service: FusionService, model_name: str = MODEL_NAME) -> dict[str, Any]:
    """`GET /v1/fusion/describe`: `FusionService.describe()` (gRPC's Describe) as JSON."""
    description = service.describe()
    experts = []
    for expert in description.experts:
        info = expert.info
        experts.append({"name": info.name, "model": info.model, "default_weight": expert.default_weight,
                        "vocab_size": info.vocab_size, "dtype": info.dtype, "device": info.device,
                        "addresses": list(expert.addresses), "active_sessions": expert.active_sessions})
    return {
        "object": "fusion.description",
        "model": model_name,
        "models": model_ids(model_name, description.profiles),
        "experts": experts,
        "rules": {name: list(params) for name, params in description.rules.items()},
        "profiles": description.profiles,
        "default_spec": description.default_spec.model_dump(mode="json"),
        "default_sampling": description.default_sampling.model_dump(mode="json"),
        "limits": description.limits.model_dump(mode="json"),
        "active_requests": description.active_requests,
    }


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's own when it sent a usable one, else a new one
    (the openai SDKs expose it as `_request_id`). Pure ASGI: streams and disconnects pass untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = (given if _REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}").encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HttpApi:
    """The routes over one service; `gate` is the coordinator's KeyGate (None: no API keys)."""

    def __init__(self, service: FusionService, metrics: CoordinatorMetrics, gate: KeyGate | None = None, *,
                 model_name: str = MODEL_NAME, serving: Callable[[], Awaitable[bool]] | None = None,
                 allowed_origins: Sequence[str] = ()) -> None:
        self.service, self.metrics, self.gate = service, metrics, gate
        self.allowed_origins = tuple(allowed_origins)
        self.model_name = model_name
        self.serving = serving
        self.created = int(time.time())
        self.answers = ResponseBuilder(service, metrics)
        # Bodies are parsed and planned here, off the event loop; apart from admission's pool, so
        # a flood of large bodies delays neither admission nor the streams.
        self._parse_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fusion-http-parse")
        self._parse_budgets: dict[str, TokenBucket] = {}  # large bodies' bytes per second, per key

    def close(self) -> None:
        self._parse_pool.shutdown(wait=False, cancel_futures=True)

    def app(self) -> FastAPI:
        app = FastAPI(title="logit-fusion", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/fusion/describe", self.describe, methods=["GET"])
        app.add_api_route("/", self.playground, methods=["GET"])
        app.add_api_route("/playground", self.playground, methods=["GET"])
        app.add_api_route("/playground/", self.playground, methods=["GET"])
        app.add_api_route("/playground/{name}", self.playground_file, methods=["GET"])
        app.add_exception_handler(HTTPException, self._http_exception)  # unknown paths, wrong methods
        app.add_middleware(RequestIdMiddleware)
        if self.allowed_origins:  # browser apps on these origins may call the API (preflights answered)
            app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins), allow_methods=["GET", "POST"],
                               allow_headers=["authorization", "content-type", "x-api-key", "x-request-id"],
                               expose_headers=["x-request-id", "retry-after"], max_age=600)
        return app

    # -- routes -------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        serving = self.serving is None or await self.serving()
        return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)

    async def models(self, request: Request) -> Response:
        try:
            await self._authenticate(request, "Models")
        except Exception as err:
            return self._error_response(request, err, {})
        data = [self._model(model) for model in model_ids(self.model_name, self.service.config.profiles)]
        return self._respond(request, JSONResponse({"object": "list", "data": data}))

    async def model(self, request: Request, model_id: str) -> Response:
        """`GET /v1/models/{id}` (the openai SDKs' `models.retrieve`)."""
        try:
            await self._authenticate(request, "Models")
            if model_id not in model_ids(self.model_name, self.service.config.profiles):
                raise ApiError(404, f"model: {model_id!r} is not served here; GET /v1/models lists what is",
                               "model", "model_not_found")
        except Exception as err:
            return self._error_response(request, err, {})
        return self._respond(request, JSONResponse(self._model(model_id)))

    def _model(self, model: str) -> dict[str, Any]:
        profiles = self.service.config.profiles
        profile = model.partition(":")[2] or None
        weights = profiles[profile] if profile else {e.name: e.weight for e in self.service.config.experts}
        return {"id": model, "object": "model", "created": self.created, "owned_by": "logit-fusion",
                "fusion": {"profile": profile, "weights": weights}}

    async def describe(self, request: Request) -> Response:
        try:
            await self._authenticate(request, "Describe")
        except Exception as err:
            return self._error_response(request, err, {})
        return self._respond(request, JSONResponse(describe_json(self.service, self.model_name)))

    async def playground(self, request: Request) -> Response:
        return await self.playground_file(request, "index.html")

    async def playground_file(self, request: Request, name: str) -> Response:
        if name not in _PLAYGROUND_FILES:
            return await self._http_exception(request, HTTPException(404, "Not Found"))
        response = FileResponse(PLAYGROUND_DIR / name, media_type=_PLAYGROUND_FILES[name], headers=_PLAYGROUND_HEADERS)
        return self._respond(request, response)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    # -- one generation request ---------------------------------------------------------------------
    async def _generate(self, request: Request, kind: Kind) -> Response:
        received, received_ns = time.perf_counter(), time.time_ns()
        plan: Plan | None = None
        generation: Generation | None = None
        try:
            record = await self._authenticate(request, "ChatCompletions" if kind == "chat" else "Completions")
            body = await self._read_body(request)
            await self._parse_turn(body, record)
            plan = await asyncio.get_running_loop().run_in_executor(self._parse_pool, self._plan, kind, body)
            echoes = await self._echoes(plan, record)
            if not plan.generate:
                answer = self.answers.prompt_only(plan, echoes)
                if not plan.stream:
                    return self._respond(request, JSONResponse(answer))
                return self._respond(request, EventSourceResponse(iter(prompt_only_events(plan, answer))))
            generation = await self._open(plan, record, request, received_ns)
            generation.watch(request)
            if not plan.stream:
                answer = await self.answers.collect(generation, plan, received, echoes)
                generation.close()
                return self._respond(request, JSONResponse(answer))
            chunks = self.answers.chunks(generation, plan, received, echoes)
            try:
                first = await anext(chunks)  # the response starts with the first token (or fails before it)
            except BaseException:
                await chunks.aclose()
                raise
            body = stream_body(first, chunks, generation, lambda err: self._api_error(err, plan.renames).body())
            response = EventSourceResponse(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return self._respond(request, response)
        except Exception as err:
            if generation is not None:
                generation.close(err)
            return self._error_response(request, err, plan.renames if plan is not None else {})
        except BaseException as err:  # cancelled (a shutdown past its grace): the streams end here too
            if generation is not None:
                generation.close(err)
            raise

    async def _echoes(self, plan: Plan, record: ApiKey | None) -> list[Echo] | None:
        """Per completion prompt, what `echo` and `prompt_logprobs` return (None: neither asked). The prompt's
        tokens are scored as the key's tenant, in chunks between decode steps, like a Score."""
        if not plan.echo and plan.prompt_logprobs is None:
            return None
        tenant = self.gate.tenant(record) if record is not None else LOCAL
        top = max(plan.requests[0].sampling.get("logprobs", 0) if plan.logprobs else 0, plan.prompt_logprobs or 0)
        echoes = []
        for prompt in plan.prompts:
            text = prompt if isinstance(prompt, str) else self.service.tokenizers[0].decode(prompt)
            scored = None
            if plan.logprobs or plan.prompt_logprobs is not None:
                scored = await self.service.prompt_logprobs_async(prompt, top, tenant)
            echoes.append(Echo(text, scored))
        return echoes

    async def _open(self, plan: Plan, record: ApiKey | None, request: Request, received_ns: int) -> Generation:
        """Admit one stream per choice, each in one of the key's slots and as the key's tenant (its
        tokens reserved at admission), each traced when tracing is on (fusion.services.tracing); all or none."""
        tickets: list[KeyStream] = []
        streams: list[RequestStream] = []
        traces: list[tracing.RequestTrace | None] = []
        tenant = self.gate.tenant(record) if record is not None else None
        try:
            if record is not None:
                for _ in plan.requests:
                    tickets.append(self.gate.open_stream(record))
            for fusion_request in plan.requests:
                if tenant is not None:
                    fusion_request = replace(fusion_request, tenant=tenant)
                trace = self._start_trace(plan, fusion_request, request, received_ns) if tracing.active() else None
                traces.append(trace)
                started = functools.partial(tracing.admitted, trace) if trace is not None else None
                stream = await self.service.submit_async(fusion_request, on_start=started)
                streams.append(stream)
                self.metrics.prompt_tokens.inc(stream.prompt_tokens)
        except BaseException as err:
            Generation(streams, tickets, traces).close(err)
            raise
        return Generation(streams, tickets, traces)

    @staticmethod
    def _start_trace(plan: Plan, fusion_request, request: Request, received_ns: int) -> tracing.RequestTrace | None:
        asked = {name: fusion_request.sampling.get(name) for name in ("max_tokens", "temperature", "top_p", "top_k",
                                                                     "seed")}
        return tracing.start_request(plan.kind, request.headers.items(), received_ns, asked,
                                     http_route=request.url.path)

    # -- the edges: keys, bodies, errors --------------------------------------------------------------
    async def _authenticate(self, request: Request, method: str) -> ApiKey | None:
        if self.gate is None:
            return None
        record = await self.gate.authenticate(api_key_from_headers(request.headers))  # Refusal: 401 / 429
        self.gate.count_request(record, method)
        return record

    async def _read_body(self, request: Request) -> bytes:
        """The body, size-checked before and while it is read, within `limits.http_body_timeout_s`."""
        limits = self.service.config.limits
        limit = limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_large = ApiError(413, f"the request body exceeds max_request_bytes={limit}", None, "request_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise too_large

        try:
            await asyncio.wait_for(read(), limits.http_body_timeout_s)
        except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
            raise ApiError(408, f"the request body did not arrive within http_body_timeout_s="
                                f"{limits.http_body_timeout_s:g}", None, "request_timeout") from None
        return bytes(body)

    async def _parse_turn(self, body: bytes, record: ApiKey | None) -> None:
        """Wait for the key's turn to parse a large body. Parsing holds the GIL for its whole length
        (measured in docs/tenancy.md), stalling every stream's thread, so each key may have
        only `limits.http_parse_bytes_per_s` of large bodies parsed; past what it can wait for within
        http_body_timeout_s, a 429 with a retry time."""
        if len(body) <= LARGE_BODY_BYTES:
            return
        limits = self.service.config.limits
        key_id = record.key_id if record is not None else ""
        bucket = self._parse_budgets.get(key_id)
        if bucket is None:  # one per configured key (the gate knows no others) and one without keys
            bucket = self._parse_budgets[key_id] = TokenBucket(limits.http_parse_bytes_per_s,
                                                              limits.max_request_bytes, time.monotonic())
        waited = 0.0
        while not bucket.take(time.monotonic(), len(body)):
            wait = bucket.wait_s(time.monotonic(), len(body))
            if waited + wait > limits.http_body_timeout_s:
                raise ApiError(429, f"large request bodies are parsed at most http_parse_bytes_per_s="
                                    f"{limits.http_parse_bytes_per_s} per key; retry in {math.ceil(wait)} s",
                               None, "server_busy", wait)
            await asyncio.sleep(wait)
            waited += wait

    def _plan(self, kind: Kind, body: bytes) -> Plan:
        """Parse and plan a body (on the parsing pool, off the event loop)."""
        limits = self.service.config.limits
        try:  # parsing and validating both recurse with the body's nesting
            try:
                data = json.loads(body)
            except ValueError as err:
                raise ApiError(400, f"the request body is not valid JSON: {err}") from None
            messages = data.get("messages") if isinstance(data, dict) else None
            if isinstance(messages, list) and len(messages) > limits.max_messages:
                # a bound on the work of validating them, before it: the service checks the same limit
                raise ApiError(400, f"messages: {len(messages)} messages exceed max_messages={limits.max_messages}",
                               "messages")
            return plan_request(kind, data, served=self.model_name, profiles=self.service.config.profiles,
                                max_choices=limits.max_concurrent_sessions)
        except RecursionError:
            raise ApiError(400, "the request body nests too deeply") from None

    def _api_error(self, err: Exception, renames: dict[str, str]) -> ApiError:
        if isinstance(err, ApiError):
            return err
        if isinstance(err, Refusal):
            return ApiError(err.http_status, err.message, None, err.reason, err.retry_after_s)
        status, message = http_status_for(err)
        if status == 500 and not isinstance(err, FusionError):
            logger.error("HTTP request failed", exc_info=err)
        param, message = client_field(message, renames) if status < 500 else (None, message)
        return ApiError(status, message, param, _ERROR_CODES.get(status), retry_after_s(err))

    def _error_response(self, request: Request, err: Exception, renames: dict[str, str]) -> Response:
        error = self._api_error(err, renames)
        retry = error.retry_after_s
        headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else None
        return self._respond(request, JSONResponse(error.body(), status_code=error.status, headers=headers))

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return self._respond(request, JSONResponse(error.body(), status_code=exc.status_code))

    def _respond(self, request: Request, response: Response) -> Response:
        # The route's template, never the path a client sent: a bounded set of label values.
        route = request.scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.metrics.http_requests.labels(path=path, status=str(response.status_code)).inc()
        return response
