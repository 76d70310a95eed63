"""The streams of one HTTP generation request and the answers built from them, in OpenAI's shapes.

`Generation` holds the service streams of a request (one per choice) and its key's tickets, and
closes them all when the client goes away, so a disconnect frees their sessions on every expert.
`ResponseBuilder` turns their token events into the answer: a whole response (`collect`) or one
server-sent chunk per token and choice (`chunks`), the echoed prompt first when asked, each token's
logprobs and attribution shown the same way in both (`fusion.services.openai_responses`). `stream_body`
sends the chunks once the first one exists; an error after that point can only be an `error` event
before `[DONE]`, since the response's status is already sent.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.sse import format_sse_event

from fusion.engine.types import new_request_id
from fusion.frontdoor.service import FusionService, PromptLogprobs, RequestStream, TextEvent, Usage
from fusion.services import tracing
from fusion.services.key_gate import KeyStream
from fusion.services.metrics import CoordinatorMetrics
from fusion.services.openai_responses import (
    attribution,
    chat_logprob,
    completion_logprobs,
    echo_logprobs,
    usage,
    utf8_decoder,
    vllm_prompt_logprobs,
)
from fusion.services.openai_tools import CallDeltas, message_of
from fusion.services.openai_wire import Plan

_DONE = format_sse_event(data_str="[DONE]")
_OBJECTS = {"chat": ("chatcmpl", "chat.completion", "chat.completion.chunk"),
            "completions": ("cmpl", "text_completion", "text_completion")}


def _sse(payload: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, separators=(",", ":")))


class Generation:
    """The service streams of one HTTP request (one per choice), its key's tickets and the watch for
    the client going away. `close` (idempotent) cancels the streams and frees the tickets."""

    def __init__(self, streams: list[RequestStream], tickets: list[KeyStream],
                 traces: list[tracing.RequestTrace | None] | None = None) -> None:
        self.streams, self.tickets = streams, tickets
        self.traces = traces or [None] * len(streams)  # each stream's trace (fusion.services.tracing), None: untraced
        self.finish_reasons: list[str | None] = [None] * len(self.traces)
        self._watch: asyncio.Task | None = None
        self._pumps: list[asyncio.Task] = []  # end with their streams (cancelled streams end too)
        self.closed = False

    def token(self, choice: int, event: TextEvent) -> None:
        """One token of a choice, into its trace."""
        trace = self.traces[choice]
        if trace is not None:
            tracing.token(trace)
            self.finish_reasons[choice] = event.finish_reason or self.finish_reasons[choice]

    def watch(self, request: Request) -> None:
        """Close when the client disconnects (the body has been read: what arrives now is the end)."""
        async def until_disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.close()

        self._watch = asyncio.create_task(until_disconnected())

    def close(self, error: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            stream.cancel()
        for i, trace in enumerate(self.traces):
            request_id = self.streams[i].request_id if i < len(self.streams) else None
            tracing.end_request(trace, request_id, self.finish_reasons[i], error)
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
    """One choice of an answer as its tokens come: what a whole response gathers, where a stream is."""

    text: list[str] = field(default_factory=list)
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    started: bool = False  # a stream sent its first chunk
    offset: int = 0  # completions' text_offset of the next token
    decoder: codecs.IncrementalDecoder = field(default_factory=utf8_decoder)  # counts those characters
    calls: CallDeltas | None = None  # a chat answer that may call tools: its deltas


def _prompt_chars(plan: Plan, choice: int) -> int:
    """Where a completion's text starts in OpenAI's `text_offset`: after its prompt's characters."""
    prompt = plan.requests[choice].prompt
    return len(prompt) if isinstance(prompt, str) else 0


@dataclass
class Echo:
    """A completion prompt's part of the answer (echo, prompt_logprobs): its text and its scored tokens."""

    text: str
    scored: PromptLogprobs | None  # None: neither logprobs nor prompt_logprobs asked


class ResponseBuilder:
    """A request's answer from its `Generation`: tokens shown by the service's tokenizers, each stream
    timed into the coordinator's metrics."""

    def __init__(self, service: FusionService, metrics: CoordinatorMetrics) -> None:
        self.service, self.metrics = service, metrics

    def _prompt_part(self, plan: Plan, echo: Echo, choice: _Choice) -> dict[str, Any]:
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

    def prompt_only(self, plan: Plan, echoes: list[Echo]) -> dict[str, Any]:
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

    async def _metered(self, generation: Generation, received: float) -> AsyncIterator[tuple[int, TextEvent]]:
        """The events, timed into the metrics and each choice's trace."""
        timers = [self.metrics.stream(received) for _ in generation.streams]
        async with contextlib.aclosing(generation.events()) as events:
            async for choice, event in events:
                timers[choice].token()
                generation.token(choice, event)
                yield choice, event

    def _bytes_of(self, token_id: int) -> bytes:
        return self.service.token_bytes(token_id)

    def _head(self, generation: Generation, plan: Plan, stream: bool) -> dict[str, Any]:
        prefix, obj, chunk_obj = _OBJECTS[plan.kind]
        return {"id": f"{prefix}-{generation.streams[0].request_id}", "object": chunk_obj if stream else obj,
                "created": int(time.time()), "model": plan.model}

    def _usage(self, generation: Generation, plan: Plan, choices: list[_Choice]) -> dict[str, int]:
        """Each prompt counted once (as OpenAI counts `n`), every choice's tokens."""
        prompts = {p: s.prompt_tokens for p, s in zip(plan.prompt_index, generation.streams)}
        return usage(sum(prompts.values()), sum(c.usage.completion_tokens for c in choices if c.usage is not None))

    async def collect(self, generation: Generation, plan: Plan, received: float,
                      echoes: list[Echo] | None = None) -> dict[str, Any]:
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
                if plan.tool_call:
                    message, finish = message_of(text, finish, self.service.grammars.tool_syntax)
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
        """A token of an answer that may call tools: its text as content until a call begins, each call as
        OpenAI's deltas (`fusion.services.openai_tools.CallDeltas`); text that may be the start of a call is held
        until it is not."""
        if choice.calls is None:
            choice.calls = CallDeltas(self.service.grammars.tool_syntax)
        delta = choice.calls.delta(event.text, event.finish_reason is not None)
        if not choice.started:
            delta = {"role": "assistant", "content": delta.pop("content", ""), **delta}
        finish = choice.calls.finish_reason(event.finish_reason)
        if not delta and finish is None and not plan.logprobs and not plan.attribution:
            return None
        logprobs = {"content": [chat_logprob(event.token, self._bytes_of)]} if plan.logprobs else None
        entry = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if plan.attribution:
            entry["fusion"] = {"tokens": [attribution(event.token)]}
        choice.started = True
        return entry

    async def chunks(self, generation: Generation, plan: Plan, received: float,
                     echoes: list[Echo] | None = None) -> AsyncIterator[bytes]:
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


def prompt_only_events(plan: Plan, answer: dict[str, Any]) -> list[bytes]:
    """A prompt-only answer (`ResponseBuilder.prompt_only`) as a stream: its one chunk, the usage chunk
    if asked, [DONE]."""
    chunk = {**answer, "object": _OBJECTS[plan.kind][2]}
    usage_chunk = chunk.pop("usage")
    return [_sse(chunk)] + ([_sse({**chunk, "choices": [], "usage": usage_chunk})]
                            if plan.include_usage else []) + [_DONE]


async def stream_body(first: bytes, chunks: AsyncIterator[bytes], generation: Generation,
                      error_body: Callable[[Exception], dict[str, Any]]) -> AsyncIterator[bytes]:
    """A started stream's body: `first`, then the rest of `chunks`; an error becomes an `error` event
    (`error_body`, OpenAI's shape) and the end. The generation closes however the body ends."""
    error: Exception | None = None
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    except Exception as err:  # after the response started: an error event, then the end
        error = err
        yield _sse(error_body(err))
        yield _DONE
    finally:
        await chunks.aclose()
        generation.close(error)
