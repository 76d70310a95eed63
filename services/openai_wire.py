"""OpenAI's HTTP API requests as the core's requests: pure functions, as `fusion.services.wire` is for gRPC.
`fusion.services.http_api` serves them.

A request body (`/v1/chat/completions` or `/v1/completions`, parsed by `fusion.services.openai_requests`)
becomes a `Plan`: one `FusionRequest` per choice (`n` per prompt), each layered over the config's
defaults by the service like any other request; a completion's prompt is continued as is (no chat
template), a chat's messages go through each expert's template. Fields OpenAI has and the sampler has
too keep OpenAI's meaning; vLLM's extras that the sampler has (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`) and `token_healing` are accepted. Structured output (`response_format`, vLLM's
`structured_outputs`) and tool calls (`tools` with any `tool_choice`, `fusion.services.openai_tools`) become one
grammar over the fused distribution (`fusion.fuse.structured`). Fusion
controls travel in an extension object, `"fusion": {"rule", "params", "weights", "profile",
"attribution"}`, and `model` may name a weight profile (`fusion:<profile>` or the profile's own name).

A plan records how the service's field names map back to the client's (`Plan.renames`), so an error
the service raises names the field the client sent (`fusion.services.openai_errors.client_field`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from fusion.config import SpecOverrides
from fusion.frontdoor.service import FusionRequest
from fusion.services.openai_errors import ApiError
from fusion.services.openai_requests import (ChatRequest, CompletionRequest, FusionExtension, Kind, StructuredOutputs,
                                     parse_body)
from fusion.services.openai_tools import past_calls_text, tool_calls_spec


@dataclass
class Plan:
    """What one HTTP request runs: one FusionRequest per choice, and how to answer."""

    kind: Kind
    model: str
    requests: list[FusionRequest]
    prompt_index: list[int]  # the prompt each choice answers (completions may send several)
    stream: bool
    include_usage: bool
    logprobs: bool  # return each token's logprob (and the top alternatives the sampler gives)
    attribution: bool
    max_tokens: int | None  # as requested (None: the config's default), for per-key limits
    tool_call: bool = False  # the answer may hold tool calls (fusion.fuse.tool_calls), sent as `tool_calls`
    echo: bool = False  # completions: the prompt precedes the completion (with its logprobs)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    prompts: list = field(default_factory=list)  # completions: each prompt as sent (text or token ids)
    generate: bool = True  # False: max_tokens 0, the prompt only (echo / prompt_logprobs)
    renames: dict[str, str] = field(default_factory=dict)  # the service's field name -> the client's


def model_ids(served: str, profiles: Mapping[str, Any]) -> list[str]:
    """What `/v1/models` lists: the fused model and each weight profile."""
    return [served, *(f"{served}:{name}" for name in sorted(profiles))]


def profile_of_model(model: str | None, served: str, profiles: Mapping[str, Any]) -> str | None:
    """The weight profile `model` names (None: the fused model with the config's weights)."""
    if model is None or model == served:
        return None
    name = model[len(served) + 1:] if model.startswith(served + ":") else model
    if name in profiles:
        return name
    raise ApiError(404, f"model: unknown model {model!r}; known: {model_ids(served, profiles)}", "model",
                   "model_not_found")


def _spec(request: ChatRequest | CompletionRequest, model_profile: str | None) -> SpecOverrides | None:
    ext = request.fusion or FusionExtension()
    profile = ext.profile
    if model_profile is not None:
        if profile is not None and profile != model_profile:
            raise ApiError(400, f"fusion.profile: {profile!r} differs from the profile the model names "
                           f"({model_profile!r}); give one", "fusion.profile")
        if ext.weights is not None:
            raise ApiError(400, f"fusion.weights: the model names profile {model_profile!r}; give weights or "
                           "a profile, not both", "fusion.weights")
        profile = model_profile
    if ext.rule is None and ext.params is None and ext.weights is None and profile is None:
        return None
    return SpecOverrides(rule=ext.rule, params=ext.params, weights=ext.weights, profile=profile)


def _structured(request: ChatRequest | CompletionRequest) -> tuple[str | None, dict[str, Any] | None, bool]:
    """The request field that asks for structured output (response_format, tools or structured_outputs; at
    most one), the `structured` sampling field it becomes, and whether the answer is a tool call."""
    asked: list[tuple[str, dict[str, Any], bool]] = []
    if isinstance(request, ChatRequest):
        fmt = request.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}, False))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ApiError(400, "response_format.json_schema: required with type json_schema",
                               "response_format.json_schema")
            asked.append(("response_format", {"json_schema": fmt.json_schema.schema_}, False))
        tools = tool_calls_spec(request)
        if tools is not None:
            asked.append(("tools", {"tool_calls": tools}, True))
    if request.structured_outputs is not None:
        asked.append(("structured_outputs", _structured_outputs(request.structured_outputs), False))
    if len(asked) > 1:
        raise ApiError(400, f"{asked[1][0]}: give one of response_format, tools and structured_outputs, not "
                       f"{asked[0][0]} too", asked[1][0])
    return asked[0] if asked else (None, None, False)


def _structured_outputs(ext: StructuredOutputs) -> dict[str, Any]:
    given = {name: value for name, value in (("json_schema", ext.json_), ("json_object", ext.json_object or None),
                                             ("regex", ext.regex), ("choice", ext.choice),
                                             ("grammar", ext.grammar)) if value is not None}
    if len(given) != 1:
        raise ApiError(400, "structured_outputs: give exactly one of json, json_object, regex, choice, grammar",
                       "structured_outputs")
    if isinstance(given.get("json_schema"), str):
        try:
            given["json_schema"] = json.loads(given["json_schema"])
        except ValueError as err:  # JSONDecodeError, or a number past Python's digit limit
            raise ApiError(400, f"structured_outputs.json: not JSON ({err})", "structured_outputs.json") from None
    return given


def _prompts(request: ChatRequest | CompletionRequest) -> list:
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # one prompt of token ids
        if not prompt:
            raise ApiError(400, "prompt: give a prompt", "prompt")
        return list(prompt)
    return _chat_prompts(request)


def _chat_prompts(request: ChatRequest) -> list:
    messages = []
    for i, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role: {message.role!r} is not supported (system, developer, user, "
                           "assistant, tool)", f"messages[{i}].role", "unsupported")
        if message.tool_calls and role != "assistant":
            raise ApiError(400, f"messages[{i}].tool_calls: only assistant messages make tool calls",
                           f"messages[{i}].tool_calls")
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported (got type "
                                   f"{part.type!r})", f"messages[{i}].content[{j}]", "unsupported")
            content = "\n".join(part.text for part in content)
        if message.tool_calls:  # as the experts would have written them (fusion.fuse.tool_calls)
            content = past_calls_text(content, message.tool_calls, i)
        messages.append({"role": role, "content": content or ""})
    return [messages]


def _sampling(request: ChatRequest | CompletionRequest) -> tuple[dict[str, Any], int | None]:
    """The sampling fields the request sets, by the sampler's names; and max_tokens as requested."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "seed", "ignore_eos", "stop_token_ids", "logit_bias", "token_healing"):
        value = getattr(request, name)
        if value is not None:
            out[name] = value
    if request.top_k is not None:
        out["top_k"] = 0 if request.top_k == -1 else request.top_k
    if request.stop is not None:
        out["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    max_tokens = request.max_tokens
    if isinstance(request, ChatRequest):
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        if request.logprobs:
            out["logprobs"] = request.top_logprobs or 0
    elif request.logprobs is not None:
        out["logprobs"] = request.logprobs
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out, max_tokens


def _continues_final_message(request: ChatRequest | CompletionRequest) -> bool:
    """vLLM's pair: `continue_final_message` with `add_generation_prompt` false (or unset) carries on the last
    message. Both true is refused, as vLLM refuses it; `add_generation_prompt` false on its own (a prompt
    with no assistant turn opened) is not offered."""
    if not isinstance(request, ChatRequest):
        return False
    continued = bool(request.continue_final_message)
    if continued and request.add_generation_prompt:
        raise ApiError(400, "add_generation_prompt: cannot be true with continue_final_message",
                       "add_generation_prompt")
    if request.add_generation_prompt is False and not continued:
        raise ApiError(400, "add_generation_prompt: false only with continue_final_message: true",
                       "add_generation_prompt", "unsupported")
    return continued


def plan_request(kind: Kind, body: Any, *, served: str, profiles: Mapping[str, Any], max_choices: int) -> Plan:
    """The plan of a request body; ApiError 400 (a bad or unsupported field) or 404 (unknown model)."""
    request = parse_body(kind, body)
    profile = profile_of_model(request.model, served, profiles)
    spec = _spec(request, profile)
    sampling, max_tokens = _sampling(request)
    source, structured, tool_call = _structured(request)
    if structured is not None:
        sampling["structured"] = structured
    prompts = _prompts(request)
    continued = _continues_final_message(request)
    echo = isinstance(request, CompletionRequest) and bool(request.echo)
    prompt_logprobs = request.prompt_logprobs if isinstance(request, CompletionRequest) else None
    generate = not (kind == "completions" and max_tokens == 0)
    if not generate:
        if not echo and prompt_logprobs is None:
            raise ApiError(400, "max_tokens: 0 only with echo or prompt_logprobs (the prompt's log-probabilities)",
                           "max_tokens")
        sampling.pop("max_tokens")
    n = request.n or 1
    if n * len(prompts) > max_choices:
        raise ApiError(400, f"n: {n * len(prompts)} choices exceed max_concurrent_sessions={max_choices}", "n")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", "stream_options")
    requests, prompt_index = [], []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            choice = dict(sampling)
            if "seed" in choice and n > 1:
                choice["seed"] += i  # distinct choices, each reproducible (vLLM's rule)
            requests.append(FusionRequest(prompt, choice, spec, plain=kind == "completions",
                                          continue_final_message=continued))
            prompt_index.append(p)
    renames = {"spec": "fusion", "rule": "fusion.rule", "params": "fusion.params", "weights": "fusion.weights",
               "profile": "model" if profile is not None else "fusion.profile"}
    if source is not None:
        renames["structured"] = source
    if kind == "chat":
        renames |= {"prompt": "messages", "logprobs": "top_logprobs"}
        if request.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
    chat_logprobs = isinstance(request, ChatRequest) and bool(request.logprobs)
    return Plan(
        kind=kind, model=request.model or served, requests=requests, prompt_index=prompt_index,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=chat_logprobs or (kind == "completions" and request.logprobs is not None),
        attribution=bool(request.fusion and request.fusion.attribution),
        max_tokens=max_tokens, renames=renames, tool_call=tool_call, echo=echo, prompt_logprobs=prompt_logprobs,
        prompts=prompts if kind == "completions" else [], generate=generate,
    )
