"""Conversions between OpenAI's HTTP API and the core's types: pure functions, as `services.wire` is
for gRPC. `services.http_server` serves them.

A request body (`/v1/chat/completions` or `/v1/completions`) becomes a `Plan`: one `FusionRequest`
per choice (`n` per prompt), each layered over the config's defaults by the service like any other
request; a completion's prompt is continued as is (no chat template), a chat's messages go through
each expert's template. Fields OpenAI has and the sampler has too keep OpenAI's meaning; vLLM's extras that the
sampler has (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`) are accepted;
unknown fields are ignored, as OpenAI ignores them; fields that ask for what this service cannot do
(tools, JSON output, echo, ...) are refused with a 400 naming the field. Fusion controls travel in an
extension object, `"fusion": {"rule", "params", "weights", "profile", "attribution"}`, and `model` may
name a weight profile (`fusion:<profile>` or the profile's own name).

Errors are `ApiError`s in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`; a domain
error's message names the field it refuses first (`temperature: ...`), which becomes `param` under
the name the client sent (`top_logprobs` for the sampler's `logprobs`, `fusion.weights`, ...).
"""

from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusion.config import SpecOverrides
from fusion.engine import TokenEvent
from fusion.service import FusionRequest

Kind = Literal["chat", "completions"]
MAX_USER_CHARS = 256  # OpenAI's `user`: an end-user id the client may send; accepted and not used
MIN_LOGPROB = -9999.0  # what a -inf logprob is sent as (JSON has no infinity; vLLM sends the same)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable_error"}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; `param` names the request field it refuses."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # a 429's Retry-After

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# -- request bodies --------------------------------------------------------------------------------
class _Lenient(BaseModel):
    # OpenAI ignores fields it does not know, and refuses values of the wrong JSON type ("5" or true
    # for an integer, "yes" for a boolean): strict, except where JSON itself forces strings.
    model_config = ConfigDict(extra="ignore", strict=True)


class FusionExtension(BaseModel):
    """The `fusion` object: the spec's fields over the config's (see `fusion.config.layer_spec`), and
    whether to return each token's attribution. Strict: a misspelt key here is an error."""

    model_config = ConfigDict(extra="forbid")

    rule: str | None = None
    params: dict[str, Any] | None = None
    weights: dict[str, float] | None = None
    profile: str | None = None
    attribution: bool = False


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Request(_Lenient):
    model: str | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's bounds
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[Annotated[int, Field(strict=False)], float] | None = None  # keys: token ids as JSON strings
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    # vLLM's extras that the sampler has
    top_k: int | None = None  # vLLM's -1 (and 0) disable it
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    fusion: FusionExtension | None = None


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = None  # top alternatives per token (the sampler allows up to 20)


def _absent(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == [] or value == {} or value is False


# Fields that ask for what this service cannot do: refused unless their value asks for nothing.
UNSUPPORTED: dict[Kind, dict[str, Callable[[Any, Mapping[str, Any]], bool]]] = {
    "chat": {
        "tools": _absent,
        "functions": _absent,
        "tool_choice": lambda v, body: v is None or v == "none",
        "function_call": lambda v, body: v is None or v == "none",
        "response_format": lambda v, body: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        "audio": _absent,
        "modalities": lambda v, body: v is None or v == ["text"],
        "prediction": _absent,
        "web_search_options": _absent,
    },
    "completions": {
        "echo": _absent,
        "suffix": lambda v, body: not v,
        "best_of": lambda v, body: v is None or v == (body.get("n") or 1),
    },
}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_of(loc: tuple) -> str:
    """`messages[0].content` from pydantic's location ('messages', 0, 'content')."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_TAGS:  # not a union member's tag
            out += f".{part}" if out else part
    return out


def _validation_error(err: ValidationError) -> ApiError:
    problem = err.errors()[0]
    param = _param_of(tuple(problem["loc"]))
    got = repr(problem.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return ApiError(400, f"{param}: {problem['msg']} (got {got})", param)


def parse_body(kind: Kind, body: Any) -> ChatRequest | CompletionRequest:
    """The request in a JSON body; ApiError 400 naming the field that is wrong or unsupported."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, supported in UNSUPPORTED[kind].items():
        if name in body and not supported(body[name], body):
            raise ApiError(400, f"{name}: not supported by this server (got {body[name]!r:.80})", name, "unsupported")
    if kind == "completions" and isinstance(body.get("prompt"), list) and any(
            not isinstance(p, str) for p in body["prompt"]):
        raise ApiError(400, "prompt: token id prompts are not supported; send text", "prompt", "unsupported")
    try:
        return (ChatRequest if kind == "chat" else CompletionRequest).model_validate(body)
    except ValidationError as err:
        raise _validation_error(err) from None


# -- a request as the service's requests -------------------------------------------------------------
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


def _prompts(request: ChatRequest | CompletionRequest) -> list:
    if isinstance(request, CompletionRequest):
        prompts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
        if not prompts:
            raise ApiError(400, "prompt: give a prompt", "prompt")
        return prompts
    messages = []
    for i, message in enumerate(request.messages):
        if message.tool_calls:
            raise ApiError(400, f"messages[{i}].tool_calls: not supported by this server", f"messages[{i}].tool_calls",
                           "unsupported")
        role = "system" if message.role == "developer" else message.role
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role: {message.role!r} is not supported (system, developer, user, "
                           "assistant)", f"messages[{i}].role", "unsupported")
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported (got type "
                                   f"{part.type!r})", f"messages[{i}].content[{j}]", "unsupported")
            content = "\n".join(part.text for part in content)
        messages.append({"role": role, "content": content or ""})
    return [messages]


def _sampling(request: ChatRequest | CompletionRequest) -> tuple[dict[str, Any], int | None]:
    """The sampling fields the request sets, by the sampler's names; and max_tokens as requested."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "seed", "ignore_eos", "stop_token_ids", "logit_bias"):
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


def plan_request(kind: Kind, body: Any, *, served: str, profiles: Mapping[str, Any], max_choices: int) -> Plan:
    """The plan of a request body; ApiError 400 (a bad or unsupported field) or 404 (unknown model)."""
    request = parse_body(kind, body)
    profile = profile_of_model(request.model, served, profiles)
    spec = _spec(request, profile)
    sampling, max_tokens = _sampling(request)
    prompts = _prompts(request)
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
            requests.append(FusionRequest(prompt, choice, spec, plain=kind == "completions"))
            prompt_index.append(p)
    renames = {"spec": "fusion", "rule": "fusion.rule", "params": "fusion.params", "weights": "fusion.weights",
               "profile": "model" if profile is not None else "fusion.profile"}
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
        max_tokens=max_tokens, renames=renames,
    )


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def client_field(message: str, renames: Mapping[str, str]) -> tuple[str | None, str]:
    """(the field a domain error's message names first, the message), both with the field as the
    client called it (`top_logprobs: ...` for the sampler's `logprobs: ...`)."""
    match = _FIELD.match(message)
    if match is None:
        return None, message
    param = match.group(1)
    base = re.match(r"[A-Za-z_]\w*", param).group(0)
    if base in renames:
        param = renames[base] + param[len(base):]
    return param, f"{param}: {message[match.end():]}"


# -- responses ---------------------------------------------------------------------------------------
def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def token_string(raw: bytes) -> str:
    """A token as OpenAI shows it: its text, or `bytes:\\xNN...` when its bytes are not whole UTF-8
    characters (part of a character: each such token stays distinct, none is U+FFFD)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprob(token: TokenEvent, bytes_of: Callable[[int], bytes]) -> dict[str, Any]:
    """One entry of a chat choice's `logprobs.content`: `bytes` are the token's own bytes."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = bytes_of(token_id)
        return {"token": token_string(raw), "logprob": _finite(logprob), "bytes": list(raw)}

    return {**entry(token.token_id, token.logprob), "top_logprobs": [entry(t, lp) for t, lp in token.top_logprobs]}


def completion_logprobs(tokens: list[TokenEvent], bytes_of: Callable[[int], bytes], offset: int,
                        decoder: codecs.IncrementalDecoder) -> tuple[dict[str, Any], int]:
    """A completion choice's `logprobs` for `tokens`, whose text starts at character `offset`, and the
    offset after them. `decoder` (UTF-8, kept across a choice's calls) counts the characters each token
    completes, so `text_offset` indexes the text as it decodes."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(decoder.decode(bytes_of(t.token_id)))
    return {
        "tokens": [token_string(bytes_of(t.token_id)) for t in tokens],
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": [{token_string(bytes_of(i)): _finite(lp) for i, lp in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
    }, offset


def attribution(token: TokenEvent) -> dict[str, Any]:
    """One token of the `fusion.tokens` extension: its id and each expert's weight and probability."""
    return {"token_id": token.token_id,
            "attribution": [{"expert": a.expert, "weight": a.weight, "prob": a.prob} for a in token.attribution]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

