"""Every check a request passes, in one place, before any work it guards.

The service admits a request in this order, each check before the work it bounds: the prompt's size
and shape (before tokenizing), the request id, the rule's weights, the sampling fields (list sizes and
ids in the vocabulary), then, once the prompt is tokenized, each expert's prompt against its limits
and context. The engine's own `admit` (callers that hand it token ids directly) runs the same
`Admission.generation`. Every refusal is a domain error naming the field: InvalidArgumentError for a
malformed value, ResourceExhaustedError for one past a configured limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from fusion.config import MAX_LOGPROBS, Limits, SamplingParams
from fusion.errors import InvalidArgumentError, ResourceExhaustedError

# No spaces or newlines: a request id goes into session ids and logs.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/-]+")
# Sampling fields made of token ids, with the limit on each list's length.
_ID_LISTS = (("stop_token_ids", "max_stop_token_ids"), ("logit_bias", "max_logit_bias"),
             ("banned_token_ids", "max_banned_token_ids"))
_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def utf8_size(text: str, field_name: str) -> int:
    """The UTF-8 size of a request's text; a lone surrogate (JSON allows one escaped) is refused here,
    before a tokenizer or a stop matcher meets it."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise InvalidArgumentError(f"{field_name}: not valid Unicode text: a lone surrogate "
                                   f"(U+{ord(text[err.start]):04X}) at character {err.start}") from None


def is_token_ids(prompt: object) -> bool:
    """A prompt given as token ids (a plain prompt of the experts' shared vocabulary)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


@dataclass(frozen=True)
class Admission:
    """The checks for one set of experts under one config's limits.

    `cross`: the experts' tokenizers differ and fuse over text, so fields made of token ids mean
    nothing and a text piece may need one more position than a token."""

    limits: Limits
    vocab_size: int
    expert_names: tuple[str, ...]
    max_positions: tuple[int | None, ...]  # each expert's context (None: unbounded)
    cross: bool = False

    # -- before tokenizing ---------------------------------------------------------------------------
    def prompt(self, prompt: str | Sequence[Mapping] | Sequence[int], *, plain: bool = True,
               continue_final_message: bool = False) -> None:
        """A prompt's shape and size: text, chat messages or (for a plain prompt) token ids; chat messages
        ending with the assistant's where that message is to be continued."""
        limits = self.limits
        if not prompt:
            raise InvalidArgumentError("prompt: give a prompt or messages; both are empty")
        if continue_final_message and (plain or isinstance(prompt, str) or is_token_ids(prompt)
                                       or not isinstance(prompt[-1], Mapping) or prompt[-1].get("role") != "assistant"):
            raise InvalidArgumentError("continue_final_message: the messages must end with the assistant's, "
                                       "which the answer continues")
        if is_token_ids(prompt):
            if not plain:
                raise InvalidArgumentError("prompt: token ids are a plain prompt (plain=True, as completions send them)")
            if self.cross:
                raise InvalidArgumentError("prompt: token ids need experts of one tokenizer; send text")
            self._length("prompt", len(prompt))
            self._in_vocabulary("prompt", prompt)
            return
        if isinstance(prompt, str):
            size = utf8_size(prompt, "prompt")
        else:
            if plain:
                raise InvalidArgumentError("messages: a plain prompt is text, not chat messages")
            if len(prompt) > limits.max_messages:
                raise ResourceExhaustedError(f"messages: {len(prompt)} messages exceed max_messages={limits.max_messages}")
            size = 0
            for i, message in enumerate(prompt):
                if not isinstance(message, Mapping) or not message.get("role"):
                    raise InvalidArgumentError(f"messages[{i}].role: must not be empty")
                if not isinstance(message.get("content", ""), str):
                    raise InvalidArgumentError(f"messages[{i}].content: must be text")
                size += (utf8_size(message["role"], f"messages[{i}].role")
                         + utf8_size(message.get("content", ""), f"messages[{i}].content"))
        self.text_size("prompt", size)

    def text_size(self, field_name: str, size: int) -> None:
        if size > self.limits.max_prompt_bytes:
            raise ResourceExhaustedError(f"{field_name}: {size} bytes exceed max_prompt_bytes={self.limits.max_prompt_bytes}")

    def score_texts(self, prompt: str, continuation: str) -> None:
        """A score's plain prompt and continuation: valid Unicode, each within max_prompt_bytes."""
        if not continuation:
            raise InvalidArgumentError("continuation: must not be empty")
        for field_name, text in (("prompt", prompt), ("continuation", continuation)):
            self.text_size(field_name, utf8_size(text, field_name))

    def score_text_bytes(self, continuation: str) -> None:
        """A continuation scored over text (experts of different tokenizers), bounded in bytes as a
        token-level score is in tokens: a piece is rarely longer than a few bytes."""
        bound = self.limits.max_score_tokens * 8
        if len(continuation.encode("utf-8")) > bound:
            raise ResourceExhaustedError(f"continuation: more than {bound} bytes "
                                         f"(8 x max_score_tokens={self.limits.max_score_tokens})")

    def prompt_logprobs(self, prompt: str | Sequence[int], top: int) -> None:
        """A plain prompt whose every token is scored (OpenAI's `echo`), before it is tokenized."""
        if self.cross:
            raise InvalidArgumentError("prompt logprobs: token log-probabilities need experts of one tokenizer")
        self.top_logprobs(top)
        self.prompt(prompt, plain=True)

    def prompt_tokens(self, ids: Sequence[int]) -> None:
        """A tokenized plain prompt within max_prompt_tokens, its ids inside the vocabulary."""
        self._length("prompt", len(ids))
        self._in_vocabulary("prompt", ids)

    def request_id(self, request_id: str) -> None:
        limit = self.limits.max_request_id_chars
        if len(request_id) > limit:
            raise InvalidArgumentError(f"request_id: {len(request_id)} characters exceed max_request_id_chars={limit}")
        if not _REQUEST_ID.fullmatch(request_id):
            raise InvalidArgumentError("request_id: may hold only letters, digits and . _ : @ / -")

    def weights(self, rule, weights: Sequence[float]) -> None:
        """The rule's own check of a request's weights (it raises InvalidArgumentError naming `weights`)."""
        rule.check_weights(weights)

    def sampling(self, sampling: SamplingParams) -> None:
        """Sampling lists within their limits, ids inside the vocabulary, stop strings non-empty, valid
        Unicode and within max_stop_chars, a grammar within max_grammar_bytes; with experts of different tokenizers, no field made of ids
        (refused first: such a request can never run, however small)."""
        limits = self.limits
        for i, stop in enumerate(sampling.stop):  # text a client cannot send again as it is: named first
            utf8_size(stop, f"stop[{i}]")
        if self.cross:
            self._cross_sampling(sampling)
        if sampling.max_tokens > limits.max_tokens:
            raise ResourceExhaustedError(f"max_tokens: {sampling.max_tokens} exceeds the limit {limits.max_tokens}")
        if len(sampling.stop) > limits.max_stop_strings:
            raise ResourceExhaustedError(f"stop: {len(sampling.stop)} strings exceed "
                                         f"max_stop_strings={limits.max_stop_strings}")
        for i, stop in enumerate(sampling.stop):
            if not stop:
                raise InvalidArgumentError(f"stop[{i}]: must not be empty")
            if len(stop) > limits.max_stop_chars:
                raise ResourceExhaustedError(f"stop[{i}]: {len(stop)} characters exceed "
                                             f"max_stop_chars={limits.max_stop_chars}")
        for name, limit_name in _ID_LISTS:
            values = getattr(sampling, name)
            bound = getattr(limits, limit_name)
            if len(values) > bound:
                raise ResourceExhaustedError(f"{name}: {len(values)} entries exceed {limit_name}={bound}")
            bad = [t for t in values if isinstance(t, int) and not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgumentError(f"{name}: token ids out of range [0, {self.vocab_size}): {sorted(bad)[:5]}")
        if sampling.token_healing and sampling.structured is not None:
            raise InvalidArgumentError("token_healing: cannot be combined with structured output (the grammar "
                                       "would read the re-written prompt text as output)")
        if sampling.structured is not None:  # before its grammar is built (fusion.fuse.structured)
            # what the request sent (its schema as JSON, its regex, choices, grammar or tools); a lone
            # surrogate anywhere in it (JSON allows one escaped) is refused here
            sent = json.dumps(sampling.structured.model_dump(exclude_defaults=True), ensure_ascii=False)
            size = utf8_size(sent, "structured")
            if size > limits.max_grammar_bytes:
                raise ResourceExhaustedError(f"structured: {size} bytes exceed max_grammar_bytes="
                                             f"{limits.max_grammar_bytes}")

    @staticmethod
    def _cross_sampling(sampling: SamplingParams) -> None:
        """Token ids mean different strings across these experts' tokenizers: refuse fields made of ids."""
        for name, _ in _ID_LISTS:
            if getattr(sampling, name):
                raise InvalidArgumentError(f"{name}: token ids are not supported when the experts' tokenizers "
                                           "differ (use stop strings)")
        if sampling.logprobs:
            raise InvalidArgumentError("logprobs: top alternatives are ids of one vocabulary, not available when "
                                       "the experts' tokenizers differ")
        if sampling.structured is not None:
            raise InvalidArgumentError("structured: a grammar masks the ids of one vocabulary; not available when "
                                       "the experts' tokenizers differ")
        if sampling.token_healing:
            raise InvalidArgumentError("token_healing: backs up over a token of one vocabulary; not available when "
                                       "the experts' tokenizers differ")
        for name, neutral in _PENALTIES.items():
            if getattr(sampling, name) != neutral:
                raise InvalidArgumentError(f"{name}: penalties count token ids and are not supported when the "
                                           "experts' tokenizers differ")

    def top_logprobs(self, top: int) -> None:
        if not 0 <= top <= MAX_LOGPROBS:
            raise InvalidArgumentError(f"logprobs: {top} alternatives; at most {MAX_LOGPROBS}")

    # -- after tokenizing ----------------------------------------------------------------------------
    def prompt_ids(self, prompt_ids: Sequence[Sequence[int]], rule, weights: Sequence[float], new_tokens: int,
                   field_name: str = "max_tokens") -> None:
        """One non-empty prompt per expert within max_prompt_tokens, ids inside the vocabulary (one
        tokenizer), and prompt + `new_tokens` within the context of every expert the rule reads: a
        request that would outgrow one must never reach a batch. A text piece of experts of different
        tokenizers is at most one id of each, plus the held-back last prompt id."""
        if len(prompt_ids) != len(self.expert_names):
            raise InvalidArgumentError(f"prompt_ids: need one prompt per expert ({len(self.expert_names)}), "
                                       f"got {len(prompt_ids)}")
        extra = 1 if self.cross else 0
        for index, (name, prompt) in enumerate(zip(self.expert_names, prompt_ids)):
            if not prompt:
                raise InvalidArgumentError(f"prompt: the prompt for expert {name!r} is empty")
            self._length("prompt", len(prompt))
            if not self.cross:
                self._in_vocabulary("prompt_ids", prompt)
            positions = self.max_positions[index]
            if positions and rule.uses_expert(index, weights) and len(prompt) + new_tokens + extra > positions:
                raise InvalidArgumentError(f"{field_name}: the prompt ({len(prompt)} tokens) + {field_name} "
                                           f"({new_tokens}) exceed expert {name!r}'s context of {positions} positions")

    def continuation_ids(self, continuation_ids: Sequence[int]) -> None:
        if not continuation_ids:
            raise InvalidArgumentError("continuation: must not be empty")
        self._in_vocabulary("continuation", continuation_ids)

    def score_tokens(self, continuation_ids: Sequence[int]) -> None:
        """A score's continuation once encoded after its prompt (lm-evaluation-harness's rule)."""
        if not continuation_ids:
            raise InvalidArgumentError("continuation: encodes to no tokens after the prompt")
        if len(continuation_ids) > self.limits.max_score_tokens:
            raise ResourceExhaustedError(f"continuation: {len(continuation_ids)} tokens exceed "
                                         f"max_score_tokens={self.limits.max_score_tokens}")

    def generation(self, request) -> None:
        """Everything about an engine request (`fusion.engine.types.GenerationRequest`) once it holds ids."""
        self.sampling(request.sampling)
        self.weights(request.rule, request.weights)
        self.prompt_ids(request.prompt_ids, request.rule, request.weights, request.sampling.max_tokens)

    def _length(self, field_name: str, tokens: int) -> None:
        if tokens > self.limits.max_prompt_tokens:
            raise ResourceExhaustedError(f"{field_name}: {tokens} tokens exceed "
                                         f"max_prompt_tokens={self.limits.max_prompt_tokens}")

    def _in_vocabulary(self, field_name: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(f"{field_name}: token ids out of range [0, {self.vocab_size}): {bad[:5]}")
