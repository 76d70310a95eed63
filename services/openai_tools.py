"""Tool calls over OpenAI's HTTP API, as the core's tool calls (`fusion.fuse.tool_calls`, Hermes syntax):
`tools` and `tool_choice` become the `tool_calls` grammar (`tool_calls_spec`), past calls in the
conversation become the text the experts wrote (`past_calls_text`), and the answer's calls come back
in OpenAI's shape, whole (`message_of`) or as stream deltas (`CallDeltas`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fusion.fuse.tool_calls import HERMES, CallStream, ToolSyntax, call_text, parse_calls
from fusion.services.openai_errors import ApiError
from fusion.services.openai_requests import ChatRequest, NamedToolChoice, ToolCall


def tool_calls_spec(request: ChatRequest) -> dict[str, Any] | None:
    """The `tool_calls` structured field the request asks for (None: the answer is text alone)."""
    choice = request.tool_choice
    if not request.tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise ApiError(400, "tool_choice: needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be distinct", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(400, f"tool_choice.function.name: {choice.function.name!r} is not one of the tools "
                           f"{sorted(names)}", "tool_choice.function.name")
        choice = choice.function.name
    functions = [tool.function.model_dump(include={"name", "description", "parameters"}, exclude_none=True)
                 for tool in request.tools]
    return {"functions": functions, "choice": choice or "auto",
            "parallel": request.parallel_tool_calls is not False}


def past_calls_text(content: str | None, calls: list[ToolCall], i: int) -> str:
    """An assistant message's tool calls (message `i`) in the canonical Hermes form (each expert's prompt
    writes them in its own template's syntax: fusion.fuse.tool_calls.messages_in_syntax)."""
    written = [call_text(c.function.name, _arguments(c.function.arguments, i)) for c in calls]
    return "\n".join(([content] if content else []) + written)


def _arguments(arguments: str, i: int) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:  # JSONDecodeError, or a number past Python's digit limit
        value = None
    if not isinstance(value, dict):
        raise ApiError(400, f"messages[{i}].tool_calls: function arguments must be a JSON object",
                       f"messages[{i}].tool_calls") from None
    return value


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_of(text: str, finish: str | None, syntax: ToolSyntax = HERMES) -> tuple[dict[str, Any], str | None]:
    """A whole answer as an assistant message and its finish_reason: its calls (in the experts' `syntax`)
    as `tool_calls` (finish "tool_calls") when it ended with every call whole; else the text as written."""
    parsed = parse_calls(text, syntax)
    if finish != "stop" or not parsed.calls:
        return {"role": "assistant", "content": text}, finish
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
             for name, arguments in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, "tool_calls"


class CallDeltas:
    """One streamed choice's answer as OpenAI's deltas: text as `content`, each call as a first delta
    with its id and name, then its arguments as they are written."""

    def __init__(self, syntax: ToolSyntax = HERMES) -> None:
        self._stream = CallStream(syntax)

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        pieces = self._stream.feed(text) + (self._stream.finish() if finished else [])
        delta: dict[str, Any] = {}
        content = "".join(p.text for p in pieces if p.kind == "text")
        if content:
            delta["content"] = content
        calls = []
        for piece in pieces:
            if piece.kind == "call":
                calls.append({"index": piece.index, "id": new_call_id(), "type": "function",
                              "function": {"name": piece.text, "arguments": ""}})
            elif piece.kind == "arguments":
                calls.append({"index": piece.index, "function": {"arguments": piece.text}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self._stream.calls else finish
