"""Tool calls in the syntax the experts were trained to write, one per tokenizer (`syntax_of`):

Hermes (Qwen2.5, Qwen3, Hermes; and the project's own tool prompt for templates without tools):

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

Llama 3.x's JSON tool calling (a template that asks for {"name", "parameters"}): the answer is the call

    {"name":"get_weather","parameters":{"city":"Paris"}}

One syntax on every path, so what the experts are shown, what the grammar lets them write and what the
parser reads back always agree:
- the prompt: the experts' own chat template when it takes `tools` (`takes_tools`), else the
  project's tool prompt in the system message (`tool_prompt`), with past calls and tool results in the
  same syntax (`plain_tool_messages`, `messages_in_syntax`);
- the grammar (`tool_grammar`): under tool_choice "auto" a lazy grammar, free text until the trigger
  (`<tool_call>`; Llama's: a `{` opening the answer) and then a call constrained to one of the tools'
  JSON schemas; under "required" or a named function, calls from the first token;
- the parser (`CallStream`, `parse_calls`): the answer's calls, streamed as OpenAI's deltas (the name
  first, then the arguments as they are written).
Past calls travel between the layers in the Hermes form (`call_text`), the canonical one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

TRIGGER, END = "<tool_call>", "</tool_call>"
RESPONSE, RESPONSE_END = "<tool_response>", "</tool_response>"
# Compact JSON (no spaces or newlines between items), as in fusion.fuse.structured: left free, a small
# model's fused votes drift into whitespace and never close the object.
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ToolSyntax:
    name: str
    key: str  # the arguments' key in a call's JSON
    anywhere: bool  # calls may follow text (Hermes' tags) or only open the answer (Llama 3's bare JSON)
    opening: str = ""  # what begins a call before its JSON ("": the JSON itself)
    closing: str = ""  # what ends it after


HERMES = ToolSyntax("hermes", "arguments", True, TRIGGER, END)
LLAMA3_JSON = ToolSyntax("llama3_json", "parameters", False)


def _template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else ""


def syntax_of(tokenizer) -> ToolSyntax:
    """The tool-call syntax of the tokenizer's template: Llama 3.x's JSON where it takes tools and asks
    for {"name", "parameters"} without Hermes' tags; otherwise Hermes (the project's prompt teaches it
    to templates without tools)."""
    template = _template(tokenizer)
    if "tools" in template and TRIGGER not in template and ('"parameters"' in template or "<|python_tag|>" in template):
        return LLAMA3_JSON
    return HERMES


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` and asks for calls in a syntax this module
    writes and reads."""
    template = _template(tokenizer)
    return "tools" in template and (TRIGGER in template or syntax_of(tokenizer) is LLAMA3_JSON)


def tool_prompt(functions: Sequence[Mapping[str, Any]], syntax: ToolSyntax | None = None) -> str:
    """The system text that offers `functions` ({"name", "description"?, "parameters"?}) to an expert
    whose template takes no tools (SmolLM2's): the project's own, in the syntax the grammar enforces."""
    syntax = syntax or HERMES
    listed = "\n".join(json.dumps(fn, separators=(",", ":")) for fn in functions)
    call = f'{{"name":"<function>","{syntax.key}":{{...}}}}'
    how = f"answer:\n{syntax.opening}\n{call}\n{syntax.closing}" if syntax.opening else f"answer only:\n{call}"
    return f"You can call these functions:\n{listed}\nTo call one, {how}\nIf none is needed, answer in plain text."


def plain_tool_messages(messages: Sequence[Mapping[str, str]], functions: Sequence[Mapping[str, Any]] | None,
                        syntax: ToolSyntax | None = None) -> list[dict[str, str]]:
    """`messages` for a template that knows no tools (or not in `syntax`): past calls in `syntax`, tool
    results as user turns in <tool_response> tags, and the tool prompt joins the system message (or opens
    the conversation)."""
    out = [{"role": "user", "content": f"{RESPONSE}\n{m.get('content', '')}\n{RESPONSE_END}"}
           if m.get("role") == "tool" else m for m in messages_in_syntax(messages, syntax or HERMES)]
    if functions:
        prompt = tool_prompt(functions, syntax)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_tools(functions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The functions as chat templates take them (OpenAI's `tools` entries)."""
    return [{"type": "function", "function": dict(fn)} for fn in functions]


def call_text(name: str, arguments: Any, syntax: ToolSyntax = HERMES) -> str:
    """A past call as the experts would have written it (an assistant turn's content)."""
    call = json.dumps({"name": name, syntax.key: arguments}, separators=(",", ":"))
    return f"{syntax.opening}\n{call}\n{syntax.closing}" if syntax.opening else call


def messages_in_syntax(messages: Sequence[Mapping[str, str]], syntax: ToolSyntax) -> list[dict[str, str]]:
    """`messages` with the past calls in assistant turns (in the canonical Hermes form) rewritten in
    `syntax`."""
    if syntax is HERMES:
        return [dict(m) for m in messages]
    out = []
    for message in messages:
        parsed = parse_calls(message.get("content", "")) if message.get("role") == "assistant" else None
        if parsed is not None and parsed.calls:
            try:
                written = [call_text(name, json.loads(args), syntax) for name, args in parsed.calls]
            except ValueError:  # not calls this module wrote: the text as it is
                written = None
            if written is not None:
                message = {**message, "content": "\n".join(([parsed.content] if parsed.content else []) + written)}
        out.append(dict(message))
    return out


def call_schema(functions: Sequence[Mapping[str, Any]], syntax: ToolSyntax = HERMES) -> dict[str, Any]:
    """One call's JSON Schema: {"name", arguments} of one of `functions`, name first."""
    calls = [{"type": "object",
              "properties": {"name": {"const": fn["name"]}, syntax.key: fn.get("parameters") or {"type": "object"}},
              "required": ["name", syntax.key], "additionalProperties": False} for fn in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": _COMPACT}


def tool_grammar(functions: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                 token_tags: bool, syntax: ToolSyntax = HERMES) -> str:
    """The Lark grammar (llguidance's dialect) of an answer that may (`required`: must) call `functions`,
    one call or several (`parallel`, Hermes only). `token_tags`: Hermes' tags are single tokens of the
    tokenizer (Qwen's), named as such; otherwise they are text, and the free text before a call is a lazy
    lexeme that ends at the trigger. Llama 3's call is the answer's JSON: text that opens with anything
    but `{` is no call."""
    if syntax is LLAMA3_JSON:
        call = f"call: %json {json.dumps(call_schema(functions, syntax))}"
        text = ["TEXT: /[^{](.|\\n)*/", 'start: call | TEXT | ""']
        return "\n".join(["%llguidance {}", call] + (["start: call"] if required else text)) + "\n"
    if token_tags:
        opening, closing = TRIGGER, END
    else:
        opening, closing = json.dumps(TRIGGER), json.dumps(END)
    body = f'"\\n" %json {json.dumps(call_schema(functions))} "\\n" {closing}'
    lines = ["%llguidance {}", "TEXT: /(.|\\n)*/"]
    if required:
        lines += [f"call: {opening} {body}", "start: call (\"\\n\" call)*" if parallel else "start: call"]
    else:
        if token_tags:
            lines.append(f"call: TEXT {opening} {body}")
        else:  # lazy: the text ends at the first trigger, where the call begins
            lines += [f"call_head[lazy]: TEXT {opening}", f"call: call_head {body}"]
        lines.append("start: call* TEXT" if parallel else "start: TEXT | call")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Piece:
    """What a stream of answer text holds, in order: "text" (content), "call" (a call starts: `name`),
    "arguments" (the current call's arguments, as written)."""

    kind: str
    text: str = ""
    index: int = 0  # the call's index in the answer


_OPENING = '{"name"'
_HEADS = {key: re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + key + r'"\s*:\s*')
          for key in ("arguments", "parameters")}


@dataclass
class CallStream:
    """An answer's text, fed as it comes, read into `Piece`s. Text that may be the start of the trigger
    is held until it is not; a call's name is sent once whole, its arguments as they are written."""

    syntax: ToolSyntax = HERMES
    _state: str = "start"
    _after_call: bool = False  # the newlines that follow a call's closing tag are part of the call
    _buffer: str = ""
    calls: int = 0  # calls started so far
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _pieces: list[Piece] = field(default_factory=list)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        self._pieces = []
        progressed = True
        while progressed and self._buffer:
            progressed = getattr(self, f"_{self._state}")()
        return self._pieces

    @property
    def inside_call(self) -> bool:
        return self._state not in ("start", "text", "plain")

    def finish(self) -> list[Piece]:
        """The rest at the end of the answer: held text, or a call cut before its end (as text)."""
        self._pieces = []
        if self._after_call and self._state != "plain":
            self._buffer = self._buffer.lstrip("\n")
        if self._buffer:
            self._pieces.append(Piece("text", self._buffer))
            self._buffer = ""
        return self._pieces

    def _start(self) -> bool:
        if self.syntax.anywhere:
            self._state = "text"
        elif _OPENING.startswith(self._buffer[:len(_OPENING)]) or self._buffer.startswith(_OPENING):
            if len(self._buffer) < len(_OPENING) and _OPENING.startswith(self._buffer):
                return False  # may yet open a call
            self._state = "head"
        else:
            self._state = "plain"  # Llama 3's calls open the answer: none here
        return True

    def _plain(self) -> bool:
        self._emit_text(self._buffer)
        self._buffer = ""
        return False

    def _text(self) -> bool:
        if self._after_call:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return False
            self._after_call = False
        at = self._buffer.find(TRIGGER)
        if at < 0:
            keep = _partial_suffix(self._buffer, TRIGGER)
            self._emit_text(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._emit_text(self._buffer[:at])
        self._buffer = self._buffer[at:]
        self._state = "head"
        return True

    def _head(self) -> bool:
        # self._buffer starts with the syntax's opening (Hermes: the trigger; Llama 3: the call's JSON)
        opening = self.syntax.opening
        rest = self._buffer[len(opening):]
        lead = rest.lstrip()
        if lead and not (lead.startswith(_OPENING) or _OPENING.startswith(lead)):
            self._emit_text(opening)  # not a call after all (text that named the tag)
            self._buffer, self._state = rest, "text" if self.syntax.anywhere else "plain"
            return True
        match = _HEADS[self.syntax.key].match(self._buffer, len(opening))
        if match is None:
            return False
        self._pieces.append(Piece("call", json.loads(match.group(1)), self.calls))
        self._buffer = self._buffer[match.end():]
        self._depth, self._in_string, self._escaped = 0, False, False
        self._state = "arguments"
        return True

    def _arguments(self) -> bool:
        for i, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
            if self._depth == 0 and not self._in_string and not char.isspace():
                self._pieces.append(Piece("arguments", self._buffer[:i + 1], self.calls))
                self._buffer = self._buffer[i + 1:]
                self._state = "tail"
                return True
        self._pieces.append(Piece("arguments", self._buffer, self.calls))
        self._buffer = ""
        return False

    def _tail(self) -> bool:
        end_tag = self.syntax.closing or "}"  # Llama 3: the brace that closes the call's object
        end = self._buffer.find(end_tag)
        if end < 0:
            return False
        self._buffer = self._buffer[end + len(end_tag):]
        self._after_call = True
        self.calls += 1
        self._state = "text" if self.syntax.anywhere else "plain"
        return True

    def _emit_text(self, text: str) -> None:
        if text:
            self._pieces.append(Piece("text", text))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text that may yet become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ParsedAnswer:
    content: str | None  # the text around the calls (None: only calls, or nothing)
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), in order
    complete: bool  # every call that started ended


def parse_calls(text: str, syntax: ToolSyntax = HERMES) -> ParsedAnswer:
    """A whole answer's calls and the text around them (`CallStream` over it, in one piece)."""
    stream = CallStream(syntax)
    pieces = stream.feed(text)
    complete = not stream.inside_call
    pieces += stream.finish()
    content = "".join(p.text for p in pieces if p.kind == "text").strip()
    calls: list[list[str]] = []
    for piece in pieces:
        if piece.kind == "call":
            calls.append([piece.text, ""])
        elif piece.kind == "arguments":
            calls[-1][1] += piece.text
    if not complete:  # a call cut short (max_tokens): no call, the text as written
        return ParsedAnswer(text.strip() or None, [], False)
    return ParsedAnswer(content or None, [(name, args) for name, args in calls], True)
