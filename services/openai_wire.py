"""Conversions between OpenAI's HTTP API and the core's types: pure functions, as `services.wire` is
for gRPC. `services.http_server` serves them.

A request body (`/v1/chat/completions` or `/v1/completions`) becomes a `Plan`: one `FusionRequest`
per choice (`n` per prompt), each layered over the config's defaults by the service like any other
request; a completion's prompt is continued as is (no chat template), a chat's messages go through
each expert's template. Fields OpenAI has and the sampler has too keep OpenAI's meaning; vLLM's extras that the
sampler has (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`) are accepted;
unknown fields are ignored, as OpenAI ignores them; fields that ask for what this service cannot do
(audio, echo, ...) are refused with a 400 naming the field. Structured output (`response_format`,
vLLM's `structured_outputs`) and tool calls (`tools` with `tool_choice` "required" or a named function)
become one grammar over the fused distribution (`fusion.structured`): a tool call is a JSON object
{"name", "arguments"} constrained to the tools' schemas, answered as `tool_calls`. Fusion controls travel in an
extension object, `"fusion": {"rule", "params", "weights", "profile", "attribution"}`, and `model` may
name a weight profile (`fusion:<profile>` or the profile's own name).

Errors are `ApiError`s in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`; a domain
error's message names the field it refuses first (`temperature: ...`), which becomes `param` under
the name the client sent (`top_logprobs` for the sampler's `logprobs`, `fusion.weights`, ...).
"""

from __future__ import annotations

import codecs
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusion.config import SpecOverrides
from fusion.engine import TokenEvent
from fusion.service import FusionRequest

Kind = Literal["chat", "completions"]
MAX_USER_CHARS = 256  # OpenAI's `user`: an end-user id the client may send; accepted and not used
MIN_LOGPROB = -9999.0  # what a -inf logprob is sent as (JSON has no infinity; vLLM sends the same)
MAX_TOOLS = 128  # OpenAI's limit on `tools`

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


class JsonSchemaFormat(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension: one of these constrains the output."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


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
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    fusion: FusionExtension | None = None


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ToolCallFunction(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids of the experts' vocabulary
    logprobs: int | None = None  # top alternatives per token (the sampler allows up to 20)
    echo: bool | None = None  # the prompt comes back before the completion, with its logprobs when asked
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: each prompt token's logprob


def _absent(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == [] or value == {} or value is False


# Fields that ask for what this service cannot do: refused unless their value asks for nothing.
UNSUPPORTED: dict[Kind, dict[str, Callable[[Any, Mapping[str, Any]], bool]]] = {
    "chat": {
        "functions": _absent,
        "function_call": lambda v, body: v is None or v == "none",
        "audio": _absent,
        "modalities": lambda v, body: v is None or v == ["text"],
        "prediction": _absent,
        "web_search_options": _absent,
    },
    "completions": {
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
    tool_call: bool = False  # the answer is a tool call: {"name", "arguments"} JSON, sent as `tool_calls`
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


TOOL_CHOICE_AUTO = ("tool_choice: 'auto' (the default when tools are given) is not supported: these experts do not "
                    "decide reliably whether to call a tool; send tool_choice 'required' or name a function")


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
        tools = _tool_call_schema(request)
        if tools is not None:
            asked.append(("tools", {"json_schema": tools}, True))
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
        except json.JSONDecodeError as err:
            raise ApiError(400, f"structured_outputs.json: not JSON ({err})", "structured_outputs.json") from None
    return given


def _tool_call_schema(request: ChatRequest) -> dict[str, Any] | None:
    """The JSON Schema of the tool call the request asks for (None: no tool call)."""
    choice = request.tool_choice
    if not request.tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise ApiError(400, "tool_choice: needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        raise ApiError(400, TOOL_CHOICE_AUTO, "tool_choice", "unsupported")
    functions = {tool.function.name: tool.function for tool in request.tools}
    if len(functions) != len(request.tools):
        raise ApiError(400, "tools: function names must be distinct", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in functions:
            raise ApiError(400, f"tool_choice.function.name: {choice.function.name!r} is not one of the tools "
                           f"{sorted(functions)}", "tool_choice.function.name")
        functions = {choice.function.name: functions[choice.function.name]}
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               "arguments": fn.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for name, fn in functions.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _tools_message(tools: list[Tool]) -> str:
    """What the experts are told about the tools (the grammar does the rest)."""
    described = [{"name": t.function.name, **({"description": t.function.description} if t.function.description else {}),
                  "parameters": t.function.parameters or {"type": "object"}} for t in tools]
    return ('Call one of these functions, answering {"name": ..., "arguments": {...}}:\n'
            + json.dumps(described, separators=(",", ":")))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_of(text: str, call_id: str) -> dict[str, Any] | None:
    """An answer's tool call in OpenAI's shape (None: the text is not a whole call, e.g. cut by max_tokens)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}


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
        if message.tool_calls:  # the experts' chat templates know no tool roles: calls and results as text
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments, i)}
                     for c in message.tool_calls]
            messages.append({"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)})
            continue
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported (got type "
                                   f"{part.type!r})", f"messages[{i}].content[{j}]", "unsupported")
            content = "\n".join(part.text for part in content)
        if role == "tool":
            role, content = "user", f"Result of tool call {message.tool_call_id or ''}: {content or ''}"
        messages.append({"role": role, "content": content or ""})
    if request.tools and request.tool_choice != "none":
        tools = _tools_message(request.tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{tools}"}
        else:
            messages.insert(0, {"role": "system", "content": tools})
    return [messages]


def _arguments(arguments: str, i: int) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise ApiError(400, f"messages[{i}].tool_calls: function arguments must be JSON text",
                       f"messages[{i}].tool_calls") from None


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
    source, structured, tool_call = _structured(request)
    if structured is not None:
        sampling["structured"] = structured
    prompts = _prompts(request)
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
            requests.append(FusionRequest(prompt, choice, spec, plain=kind == "completions"))
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


def echo_logprobs(scored, bytes_of: Callable[[int], bytes], top: int, decoder: codecs.IncrementalDecoder
                  ) -> tuple[dict[str, Any], int]:
    """An echoed prompt's part of a completion's `logprobs` (`scored`: fusion.service.PromptLogprobs; the
    first token has no logprob: null, as OpenAI sends it), and the character offset after it."""
    tokens, offsets, top_logprobs, offset = [], [], [], 0
    for token_id, alternatives in zip(scored.token_ids, scored.alternatives):
        tokens.append(token_string(bytes_of(token_id)))
        offsets.append(offset)
        offset += len(decoder.decode(bytes_of(token_id)))
        top_logprobs.append(None if alternatives is None else
                            {token_string(bytes_of(i)): _finite(lp) for i, lp in zip(*alternatives)})
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp) for lp in scored.logprobs],
            "top_logprobs": top_logprobs if top else [None] * len(tokens), "text_offset": offsets}, offset


def vllm_prompt_logprobs(scored, text_of: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {id: {logprob, rank, decoded_token}} for the token and
    its alternatives (rank 1 = likeliest), the first token null."""
    out: list[dict[str, Any] | None] = []
    for token_id, logprob, alternatives, rank in zip(scored.token_ids, scored.logprobs, scored.alternatives,
                                                     scored.ranks):
        if logprob is None:
            out.append(None)
            continue
        ids, values = alternatives if alternatives is not None else ([], [])
        entry = {str(token_id): {"logprob": _finite(logprob), "rank": rank, "decoded_token": text_of(token_id)}}
        for r, (i, lp) in enumerate(zip(ids, values)):
            entry.setdefault(str(i), {"logprob": _finite(lp), "rank": r + 1, "decoded_token": text_of(i)})
        out.append(entry)
    return out


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

