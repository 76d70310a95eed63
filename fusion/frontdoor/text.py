"""The text edge: per-expert prompt formatting, incremental detokenisation and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from fusion.config import ExpertConfig

HEALING_CONTEXT = 4  # prompt ids a healed output is decoded after (TextStream.after)
from fusion.fuse.tool_calls import (HERMES, ToolSyntax, messages_in_syntax, plain_tool_messages, syntax_of, takes_tools,
                                    template_tools)

Message = dict[str, str]  # {"role": ..., "content": ...}


def encode_prompt(tokenizer, expert: ExpertConfig, prompt: str | Sequence[Message],
                  functions: Sequence[Mapping[str, Any]] | None = None, syntax: ToolSyntax = HERMES, *,
                  continue_final_message: bool = False) -> list[int]:
    """Token ids of a prompt as this expert expects it: its own system prompt and chat template, with
    the `functions` it may call shown as its template shows tools where it asks for calls in `syntax`
    (the one the fused answer's grammar holds to), else by the project's tool prompt in that syntax
    (fusion.fuse.tool_calls). With `continue_final_message` the last message (the assistant's, checked at
    admission) stays open: the template's end of turn is left off, and no new turn begins."""
    turn = ({"add_generation_prompt": False, "continue_final_message": True} if continue_final_message
            else {"add_generation_prompt": True})
    if isinstance(prompt, str):
        messages: list[Message] = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if expert.chat_template and getattr(tokenizer, "chat_template", None):
        if expert.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": expert.system_prompt}] + messages
        if takes_tools(tokenizer) and syntax_of(tokenizer) is syntax:
            tools = {"tools": template_tools(functions)} if functions else {}
            text = tokenizer.apply_chat_template(messages_in_syntax(messages, syntax), tokenize=False, **turn,
                                                 **tools)
        else:
            text = tokenizer.apply_chat_template(plain_tool_messages(messages, functions, syntax), tokenize=False,
                                                 **turn)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in plain_tool_messages(messages, functions, syntax))
    if expert.system_prompt:
        text = f"{expert.system_prompt}\n{text}"
    return list(tokenizer(text)["input_ids"])


@dataclass(frozen=True)
class TextSample:
    """A text to score or learn from: plain (encoded on its own after `document_context`: the BOS, or
    the eos where the tokenizer adds no BOS), or the answer to a chat
    prompt that each expert formats with its own template, optionally closed by the end-of-turn token.
    `continued`: the prompt is chat messages whose last one, the assistant's, the text carries on, healed
    as a request with `token_healing` is (the prompt's last token written again by the text)."""

    text: str
    prompt: str | Sequence[Message] | None = None
    end_turn: bool = False
    continued: bool = False


def end_of_turn_id(tokenizer) -> int:
    """The chat turn terminator: <|im_end|> when the vocabulary has it, else the eos token."""
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if tid is None or tid == tokenizer.unk_token_id:
        tid = tokenizer.eos_token_id
    if tid is None:
        raise ValueError("tokenizer has neither <|im_end|> nor an eos token")
    return tid


def encode_plain(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text when adding special tokens (its BOS), or []."""
    with_special = encode_plain(tokenizer, "x", add_special_tokens=True)
    plain = encode_plain(tokenizer, "x", add_special_tokens=False)
    cut = len(with_special) - len(plain)
    if cut > 0 and with_special[cut:] == plain:
        return with_special[:cut]
    return []


def document_context(tokenizer) -> list[int]:
    """The context of a text scored on its own: the BOS when the tokenizer adds one, else the
    end-of-text token (lm-evaluation-harness: `[eot_token_id]`, the tokenizer's eos)."""
    prefix = special_prefix(tokenizer)
    if prefix:
        return prefix
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither a BOS nor an eos token to start a text")
    return [tokenizer.eos_token_id]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int], str]:
    """(context ids, continuation ids, scored text) by lm-evaluation-harness's rule (`_encode_pair`).

    Trailing whitespace of the context moves to the start of the continuation; then the whole text
    is encoded at once and the continuation is the whole encoding after the context's own encoding
    (`whole[len(context_enc):]`), so a boundary that BPE merges ("\n" + "    return") is scored under
    the tokenization the model saw in training, not two separately encoded halves. The context keeps
    the tokenizer's BOS (when it adds one); an empty context becomes `document_context`. The scored
    text is the continuation with the moved whitespace: the bytes the log-probabilities cover.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if not context:
        return document_context(tokenizer), encode_plain(tokenizer, continuation, add_special_tokens=False), continuation
    prefix = special_prefix(tokenizer)
    context_ids = encode_plain(tokenizer, context, add_special_tokens=False)
    whole = encode_plain(tokenizer, context + continuation, add_special_tokens=False)
    return prefix + context_ids, whole[len(context_ids):], continuation


@dataclass
class TextStream:
    """Turns generated ids into text deltas and finds stop strings.

    Decodes incrementally, as vLLM's detokenizer does: each new id is decoded with the few ids before it
    (from `prefix_offset`), and the text beyond what those few ids alone decode to is the new text, so a
    token's leading space or a character spread over several byte tokens comes out right while the work
    per token stays constant (decoding the whole output every time made a long answer quadratic). A
    trailing partial UTF-8 character is held back until it completes, and so is any tail that could
    still become a stop string.
    """

    tokenizer: object
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False
    text: str = ""  # the output decoded so far (complete characters)
    prefix_offset: int = 0  # ids from here on are decoded together with the new ones
    read_offset: int = 0  # ids before this are in `text`

    @classmethod
    def after(cls, tokenizer, stop: Sequence[str], prompt_ids: Sequence[int], healed: str = "") -> TextStream:
        """The stream of a request's output. With token healing (`healed`: the prompt text the first token
        re-writes), the output is decoded after the prompt's last few ids, so a token's leading space
        survives as in the prompt, and the healed text counts as shown: it is not sent again, and a stop
        string may begin in it (the model wrote it anew)."""
        if not healed:
            return cls(tokenizer, stop)
        context = list(prompt_ids[-HEALING_CONTEXT:])
        return cls(tokenizer, stop, token_ids=context, emitted=healed, prefix_offset=0, read_offset=len(context))

    def push(self, token_id: int) -> str:
        """Append one id; return the new text that is safe to show. Sets `stopped` on a stop string."""
        self.token_ids.append(token_id)
        if not self._advance(partial_ok=False):  # an incomplete multi-byte character: wait for the next id
            return ""
        safe, self.stopped = StopMatcher(self.stop).cut(self.text, len(self.emitted))
        return self._emit(self.text[:safe])

    def flush(self) -> str:
        """Text held back at the end of the stream (a tail that never became a stop string)."""
        if self.stopped:
            return ""
        self._advance(partial_ok=True)
        return self._emit(self.text)

    def _advance(self, *, partial_ok: bool) -> bool:
        """Move the ids not yet in `text` into it; False (nothing moved) while they end inside a character."""
        if self.read_offset == len(self.token_ids):
            return True
        before = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        after = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
        if after.endswith("\ufffd") and not partial_ok:
            return False
        self.text += after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return True

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta


@dataclass(frozen=True)
class StopMatcher:
    """Stop strings in a growing text: where the first one begins, or how much of the tail to hold back
    because it could still become one. One rule for every stream (ids, or text pieces across
    tokenizers)."""

    stops: Sequence[str]

    def cut(self, text: str, shown: int) -> tuple[int, bool]:
        """(how much of `text` is safe to show, whether a stop string begins there). `shown`: the length
        already shown, which holds no stop string, so only the tail after it is searched."""
        hits = [at for stop in self.stops if stop and (at := text.find(stop, max(0, shown - len(stop)))) != -1]
        if hits:
            return min(hits), True
        return len(text) - max((self.partial(text, s) for s in self.stops if s), default=0), False

    @staticmethod
    def partial(text: str, stop: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of `stop`. Only tails that start
        with `stop[0]` are tried, each by one C-level comparison (the naive loop is O(len(stop)^2))."""
        tail = text[-(len(stop) - 1):] if len(stop) > 1 else ""
        at = tail.find(stop[0]) if tail else -1
        while at != -1:
            if stop.startswith(tail[at:]):
                return len(tail) - at
            at = tail.find(stop[0], at + 1)
        return 0
