"""Tool calls over OpenAI's HTTP API. The experts' chat templates know no tools, so a tool call is
asked for as a grammar: a JSON object {"name", "arguments"} constrained to the tools' schemas
(`tool_call_schema`), with the tools described in a system message (`tools_message`); past calls in
the conversation go to the experts as text (`tool_calls_text`); the answer's JSON becomes OpenAI's
`tool_calls` (`tool_call_of`) only when it parses as a whole call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from services.openai_errors import ApiError
from services.openai_requests import ChatRequest, NamedToolChoice, Tool, ToolCall

TOOL_CHOICE_AUTO = ("tool_choice: 'auto' (the default when tools are given) is not supported: these experts do not "
                    "decide reliably whether to call a tool; send tool_choice 'required' or name a function")


def tool_call_schema(request: ChatRequest) -> dict[str, Any] | None:
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


def tools_message(tools: list[Tool]) -> str:
    """What the experts are told about the tools (the grammar does the rest)."""
    described = [{"name": t.function.name, **({"description": t.function.description} if t.function.description else {}),
                  "parameters": t.function.parameters or {"type": "object"}} for t in tools]
    return ('Call one of these functions, answering {"name": ..., "arguments": {...}}:\n'
            + json.dumps(described, separators=(",", ":")))


def tool_calls_text(calls: list[ToolCall], i: int) -> str:
    """An assistant message's past tool calls (message `i`) as the text the experts see."""
    called = [{"name": c.function.name, "arguments": _arguments(c.function.arguments, i)} for c in calls]
    return json.dumps(called[0] if len(called) == 1 else called)


def _arguments(arguments: str, i: int) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:  # JSONDecodeError, or a number past Python's digit limit
        raise ApiError(400, f"messages[{i}].tool_calls: function arguments must be JSON text",
                       f"messages[{i}].tool_calls") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_of(text: str, call_id: str) -> dict[str, Any] | None:
    """An answer's tool call in OpenAI's shape (None: the text is not a whole call, e.g. cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:  # not JSON (or a number past Python's digit limit): no tool call
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}
