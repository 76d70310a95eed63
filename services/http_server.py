"""The OpenAI-compatible HTTP API over a `FusionService`: pure conversion, as the gRPC servicer is.

    GET  /v1/models             the fused model and each weight profile
    POST /v1/chat/completions   chat messages -> choices (server-sent events with `stream: true`)
    POST /v1/completions        text prompts -> choices
    GET  /health                200 while the coordinator serves (its gRPC health too), else 503
    GET  /v1/fusion/describe    the service's description (gRPC's Describe as JSON): experts, rules, ...
    GET  / and /playground      the web playground (`services/playground/`: static files, no key needed)

A request is authenticated by the coordinator's `KeyGate` (the same keys, limits and counters as
gRPC: `Authorization: Bearer <key>` or `x-api-key`), read (at most `limits.max_request_bytes`),
planned (`services.openai_wire`: one service request per choice), admitted by the service and
metered token by token against the key's limits. A stream's response starts with its first token,
so an error before it (a field the service refuses, no free slot, a lost expert) is an HTTP status
with OpenAI's error body; one after it is an `error` event before `[DONE]`. A client that
disconnects cancels every stream of its request, which frees their sessions on every expert.

`start_http_server` serves the app with uvicorn on the running event loop, beside the gRPC server:
one process, one service.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import math
import re
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from fusion.config import Limits, SecurityConfig
from fusion.errors import FusionError
from fusion.engine import new_request_id
from fusion.service import FusionService, PromptLogprobs, RequestStream, TextEvent, Usage
from fusion.tenancy import LOCAL
from services.http_edge import RESERVED_FDS, ConnectionBook, bounded_protocol, raise_open_files_limit
from services.metrics import CoordinatorMetrics
from services.openai_wire import (
    ApiError,
    Kind,
    Plan,
    attribution,
    chat_logprob,
    client_field,
    completion_logprobs,
    echo_logprobs,
    model_ids,
    new_call_id,
    plan_request,
    tool_call_of,
    usage,
    vllm_prompt_logprobs,
)
from services.api_keys import ApiKey
from services.key_gate import KeyGate, KeyStream, Refusal, TokenBucket, api_key_from_headers
from services.tls import warn_if_plaintext
from services.status import http_status_for, retry_after_s

logger = logging.getLogger(__name__)

MODEL_NAME = "fusion"  # the fused model's id; each profile is `fusion:<profile>`
_DONE = format_sse_event(data_str="[DONE]")
_ERROR_CODES = {404: "not_found", 429: "server_busy", 500: "internal_error", 503: "expert_unavailable"}
_OBJECTS = {"chat": ("chatcmpl", "chat.completion", "chat.completion.chunk"),
            "completions": ("cmpl", "text_completion", "text_completion")}


PLAYGROUND_DIR = Path(__file__).parent / "playground"
# The playground's files: what the page loads, with its content type; nothing else is served from there.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")  # a client's x-request-id we echo back
# Bodies above this are parsed only within their key's http_parse_bytes_per_s (`HttpApi._parse_turn`).
LARGE_BODY_BYTES = 64 * 1024
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


def _sse(payload: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, separators=(",", ":")))


class _Generation:
    """The service streams of one HTTP request (one per choice), its key's tickets and the watch for
    the client going away. `close` (idempotent) cancels the streams and frees the tickets."""

    def __init__(self, streams: list[RequestStream], tickets: list[KeyStream]) -> None:
        self.streams, self.tickets = streams, tickets
        self._watch: asyncio.Task | None = None
        self._pumps: list[asyncio.Task] = []  # end with their streams (cancelled streams end too)
        self.closed = False

    def watch(self, request: Request) -> None:
        """Close when the client disconnects (the body has been read: what arrives now is the end)."""
        async def until_disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.close()

        self._watch = asyncio.create_task(until_disconnected())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            stream.cancel()
        for ticket in self.tickets:
            ticket.close()
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()

    async def events(self) -> AsyncIterator[tuple[int, TextEvent]]:
        """(choice, event) of every stream as they come; a stream's error is raised."""
        if len(self.streams) == 1:
            async with contextlib.aclosing(self.streams[0].__aiter__()) as events:
                async for event in events:
                    yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: int, stream: RequestStream) -> None:
            try:
                async with contextlib.aclosing(stream.__aiter__()) as events:
                    async for event in events:
                        queue.put_nowait((choice, event))
                queue.put_nowait((choice, None))
            except Exception as err:  # handed to the reader, which raises it
                queue.put_nowait((choice, err))

        self._pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        left = len(self.streams)
        while left:
            choice, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    started: bool = False  # a stream sent its first chunk
    offset: int = 0  # completions' text_offset of the next token
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: utf8_decoder())  # counts those characters


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


def utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _prompt_chars(plan: Plan, choice: int) -> int:
    """Where a completion's text starts in OpenAI's `text_offset`: after its prompt's characters."""
    prompt = plan.requests[choice].prompt
    return len(prompt) if isinstance(prompt, str) else 0


@dataclass
class _Echo:
    """A completion prompt's part of the answer (echo, prompt_logprobs): its text and its scored tokens."""

    text: str
    scored: PromptLogprobs | None  # None: neither logprobs nor prompt_logprobs asked


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
        received = time.perf_counter()
        plan: Plan | None = None
        generation: _Generation | None = None
        try:
            record = await self._authenticate(request, "ChatCompletions" if kind == "chat" else "Completions")
            body = await self._read_body(request)
            await self._parse_turn(body, record)
            plan = await asyncio.get_running_loop().run_in_executor(self._parse_pool, self._plan, kind, body)
            echoes = await self._echoes(plan, record)
            if not plan.generate:
                answer = self._prompt_only(plan, echoes)
                if not plan.stream:
                    return self._respond(request, JSONResponse(answer))
                chunk = {**answer, "object": _OBJECTS[plan.kind][2]}
                usage_chunk = chunk.pop("usage")
                parts = [_sse(chunk)] + ([_sse({**chunk, "choices": [], "usage": usage_chunk})]
                                         if plan.include_usage else []) + [_DONE]
                return self._respond(request, EventSourceResponse(iter(parts)))
            generation = await self._open(plan, record)
            generation.watch(request)
            if not plan.stream:
                answer = await self._collect(generation, plan, received, echoes)
                generation.close()
                return self._respond(request, JSONResponse(answer))
            chunks = self._chunks(generation, plan, received, echoes)
            try:
                first = await anext(chunks)  # the response starts with the first token (or fails before it)
            except BaseException:
                await chunks.aclose()
                raise
            response = EventSourceResponse(self._stream_body(first, chunks, generation, plan),
                                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return self._respond(request, response)
        except Exception as err:
            if generation is not None:
                generation.close()
            return self._error_response(request, err, plan.renames if plan is not None else {})
        except BaseException:  # cancelled (a shutdown past its grace): the streams end here too
            if generation is not None:
                generation.close()
            raise

    async def _echoes(self, plan: Plan, record: ApiKey | None) -> list[_Echo] | None:
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
            echoes.append(_Echo(text, scored))
        return echoes

    def _prompt_part(self, plan: Plan, echo: _Echo, choice: _Choice) -> dict[str, Any]:
        """A completion choice's part for its prompt: with `echo`, the prompt's text and its logprobs (when
        asked), `choice.offset` moving past it; with `prompt_logprobs`, vLLM's list."""
        part: dict[str, Any] = {}
        if plan.echo:
            logprobs = None
            if plan.logprobs and echo.scored is not None:
                top = plan.requests[0].sampling.get("logprobs", 0)
                logprobs, choice.offset = echo_logprobs(echo.scored, self._bytes_of, top, choice.decoder)
            else:
                choice.offset = len(echo.text)
            part |= {"text": echo.text, "logprobs": logprobs}
        if plan.prompt_logprobs is not None:
            part["prompt_logprobs"] = vllm_prompt_logprobs(echo.scored, self.service.token_text)
        return part

    def _prompt_only(self, plan: Plan, echoes: list[_Echo]) -> dict[str, Any]:
        """A completion with max_tokens 0: each prompt (echoed, with its logprobs), nothing generated."""
        choices = []
        for i, p in enumerate(plan.prompt_index):
            echo = echoes[p]
            entry = {"index": i, "text": "", "logprobs": None, "finish_reason": "length"}
            choices.append(entry | self._prompt_part(plan, echo, _Choice()))
        prompt_tokens = sum(len(e.scored.token_ids) if e.scored is not None else 0 for e in echoes)
        prefix, obj, _ = _OBJECTS[plan.kind]
        return {"id": f"{prefix}-{new_request_id()}", "object": obj, "created": int(time.time()), "model": plan.model,
                "choices": choices, "usage": usage(prompt_tokens, 0)}

    async def _open(self, plan: Plan, record: ApiKey | None) -> _Generation:
        """Admit one stream per choice, each in one of the key's slots and as the key's tenant (its
        tokens reserved at admission); all or none."""
        tickets: list[KeyStream] = []
        streams: list[RequestStream] = []
        tenant = self.gate.tenant(record) if record is not None else None
        try:
            if record is not None:
                for _ in plan.requests:
                    tickets.append(self.gate.open_stream(record))
            for fusion_request in plan.requests:
                if tenant is not None:
                    fusion_request = replace(fusion_request, tenant=tenant)
                stream = await self.service.submit_async(fusion_request)
                streams.append(stream)
                self.metrics.prompt_tokens.inc(stream.prompt_tokens)
        except BaseException:
            _Generation(streams, tickets).close()
            raise
        return _Generation(streams, tickets)

    async def _metered(self, generation: _Generation, received: float) -> AsyncIterator[tuple[int, TextEvent]]:
        """The events, timed into the metrics."""
        timers = [self.metrics.stream(received) for _ in generation.streams]
        async with contextlib.aclosing(generation.events()) as events:
            async for choice, event in events:
                timers[choice].token()
                yield choice, event

    def _bytes_of(self, token_id: int) -> bytes:
        return self.service.token_bytes(token_id)

    def _head(self, generation: _Generation, plan: Plan, stream: bool) -> dict[str, Any]:
        prefix, obj, chunk_obj = _OBJECTS[plan.kind]
        return {"id": f"{prefix}-{generation.streams[0].request_id}", "object": chunk_obj if stream else obj,
                "created": int(time.time()), "model": plan.model}

    def _usage(self, generation: _Generation, plan: Plan, choices: list[_Choice]) -> dict[str, int]:
        """Each prompt counted once (as OpenAI counts `n`), every choice's tokens."""
        prompts = {p: s.prompt_tokens for p, s in zip(plan.prompt_index, generation.streams)}
        return usage(sum(prompts.values()), sum(c.usage.completion_tokens for c in choices if c.usage is not None))

    async def _collect(self, generation: _Generation, plan: Plan, received: float,
                       echoes: list[_Echo] | None = None) -> dict[str, Any]:
        choices = [_Choice() for _ in plan.requests]
        async with contextlib.aclosing(self._metered(generation, received)) as events:
            async for i, event in events:
                choice = choices[i]
                choice.text.append(event.text)
                choice.tokens.append(event.token)
                choice.finish_reason = event.finish_reason
                choice.usage = event.usage or choice.usage
        out = []
        for i, choice in enumerate(choices):
            text = "".join(choice.text)
            if plan.kind == "chat":
                logprobs = ({"content": [chat_logprob(t, self._bytes_of) for t in choice.tokens]}
                            if plan.logprobs else None)
                message, finish = {"role": "assistant", "content": text}, choice.finish_reason
                call = tool_call_of(text, new_call_id()) if plan.tool_call and finish == "stop" else None
                if call is not None:
                    message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
                entry = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                state = _Choice(offset=_prompt_chars(plan, i))
                part = self._prompt_part(plan, echoes[plan.prompt_index[i]], state) if echoes is not None else {}
                logprobs = (completion_logprobs(choice.tokens, self._bytes_of, state.offset, state.decoder)[0]
                            if plan.logprobs else None)
                if part.get("logprobs") is not None:  # the echoed prompt's tokens come first
                    logprobs = {k: part["logprobs"][k] + logprobs[k] for k in logprobs}
                entry = {**part, "index": i, "text": part.get("text", "") + text, "logprobs": logprobs,
                         "finish_reason": choice.finish_reason}
            if plan.attribution:
                entry["fusion"] = {"tokens": [attribution(t) for t in choice.tokens]}
            out.append(entry)
        return {**self._head(generation, plan, stream=False), "choices": out,
                "usage": self._usage(generation, plan, choices)}

    def _chunk_choice(self, plan: Plan, i: int, event: TextEvent, choice: _Choice) -> dict[str, Any] | None:
        """A stream chunk's choice for one token (None: nothing to send yet)."""
        token = event.token
        if choice.started and not event.text and event.finish_reason is None and not (
                plan.logprobs or plan.attribution):
            return None
        if plan.kind == "chat" and plan.tool_call:
            return self._tool_call_chunk(plan, i, event, choice)
        if plan.kind == "chat":
            delta = {"content": event.text} if choice.started else {"role": "assistant", "content": event.text}
            logprobs = {"content": [chat_logprob(token, self._bytes_of)]} if plan.logprobs else None
            entry = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": event.finish_reason}
        else:
            logprobs = None
            if plan.logprobs:
                logprobs, choice.offset = completion_logprobs([token], self._bytes_of, choice.offset, choice.decoder)
            entry = {"index": i, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}
        if plan.attribution:
            entry["fusion"] = {"tokens": [attribution(token)]}
        choice.started = True
        return entry

    def _tool_call_chunk(self, plan: Plan, i: int, event: TextEvent, choice: _Choice) -> dict[str, Any] | None:
        """A tool call streams as one delta with the whole call once it is complete (its JSON is only a call
        when it parses); tokens before it send nothing but their logprobs, when asked."""
        choice.text.append(event.text)
        delta: dict[str, Any] = {} if choice.started else {"role": "assistant", "content": None}
        finish = event.finish_reason
        if finish is not None:
            text = "".join(choice.text)
            call = tool_call_of(text, new_call_id()) if finish == "stop" else None
            if call is not None:
                delta["tool_calls"] = [{"index": 0, **call}]
                finish = "tool_calls"
            else:
                delta["content"] = text
        elif not plan.logprobs and not plan.attribution and choice.started:
            return None
        logprobs = {"content": [chat_logprob(event.token, self._bytes_of)]} if plan.logprobs else None
        entry = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if plan.attribution:
            entry["fusion"] = {"tokens": [attribution(event.token)]}
        choice.started = True
        return entry

    async def _chunks(self, generation: _Generation, plan: Plan, received: float,
                      echoes: list[_Echo] | None = None) -> AsyncIterator[bytes]:
        """The stream's events: the echoed prompts first (when asked), one chunk per token (and choice), the
        usage chunk if asked, [DONE]."""
        head = self._head(generation, plan, stream=True)
        choices = [_Choice(offset=_prompt_chars(plan, i)) for i in range(len(plan.requests))]
        if echoes is not None:
            for i, choice in enumerate(choices):
                echo = echoes[plan.prompt_index[i]]
                entry = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
                chunk = {**head, "choices": [entry | self._prompt_part(plan, echo, choice)]}
                if plan.include_usage:
                    chunk["usage"] = None
                choice.started = True
                yield _sse(chunk)
        async with contextlib.aclosing(self._metered(generation, received)) as events:
            async for i, event in events:
                choice = choices[i]
                choice.usage = event.usage or choice.usage
                entry = self._chunk_choice(plan, i, event, choice)
                if entry is None:
                    continue
                chunk = {**head, "choices": [entry]}
                if plan.include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        if plan.include_usage:
            yield _sse({**head, "choices": [], "usage": self._usage(generation, plan, choices)})
        yield _DONE

    async def _stream_body(self, first: bytes, chunks: AsyncIterator[bytes], generation: _Generation,
                           plan: Plan) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except Exception as err:  # after the response started: an error event, then the end
            yield _sse(self._api_error(err, plan.renames).body())
            yield _DONE
        finally:
            await chunks.aclose()
            generation.close()

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


# -- the server ------------------------------------------------------------------------------------------
class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The host process's own handler stops every server (`services.serving.serve_until_signalled`)."""
        yield


@dataclass
class HttpServer:
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
    Connections are bounded by `limits` (`services.http_edge`)."""
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
