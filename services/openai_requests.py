"""OpenAI's request bodies (`/v1/chat/completions`, `/v1/completions`) as pydantic models, and the parse
that refuses a bad body with a 400 naming the field. Kept apart from the planning (`fusion.services.openai_wire`)
so what a client may send reads in one place.

Unknown fields are ignored, as OpenAI ignores them; values of the wrong JSON type are refused, as OpenAI
refuses them; fields that ask for what this service cannot do (audio, predicted outputs, ...) are
refused by name unless their value asks for nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusion.services.openai_errors import ApiError

Kind = Literal["chat", "completions"]
MAX_USER_CHARS = 256  # OpenAI's `user`: an end-user id the client may send; accepted and not used
MAX_TOOLS = 128  # OpenAI's limit on `tools`


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
    token_healing: bool | None = None  # fusion.frontdoor.healing: for a completion or a continued final message
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
    # vLLM's: the answer carries on the last message, the assistant's (with add_generation_prompt false)
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None


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
