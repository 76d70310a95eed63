"""Structured output: one grammar mask on the fused distribution.

The experts vote as usual; after fusion, before the sampler, each constrained row's fused logits are
masked to the tokens its grammar allows next, so the sampled token is always one the grammar accepts,
whichever expert proposed it. A request's grammar (a JSON Schema, any JSON object, a regex, a choice
of strings or a Lark grammar: `fusion.config.StructuredOutput`) is compiled once at admission by
llguidance into a matcher over the experts' shared tokenizer; every step the matcher gives the row's
mask as a bitmask, and the chosen token advances it. The row ends ("stop") when the grammar is done.

llguidance computes a mask in tens of microseconds for a 50k vocabulary (a lazy lexer over a
token trie, no precomputed automaton per vocabulary), and builds its tokenizer view in a fraction of
a second, so neither admission nor the step waits on it.

Experts of different tokenizers fuse over text pieces (fusion.crosstok.step), where no one vocabulary's ids
can be masked: a structured request there is refused.
"""

from __future__ import annotations

import json
import re
import threading

import torch

from fusion.config import StructuredOutput
from fusion.errors import InvalidArgumentError
from fusion.fuse.tool_calls import END, HERMES, TRIGGER, ToolSyntax, syntax_of, tool_grammar

FIELD = "structured"
JSON_LAYOUT = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutput, *, token_tags: bool = False, syntax: ToolSyntax = HERMES) -> str:
    """The llguidance grammar for `spec` (not yet checked against a tokenizer); `token_tags`: the tool
    call tags are single tokens of the tokenizer, `syntax` its tool calls' (fusion.fuse.tool_calls)."""
    import llguidance

    if spec.tool_calls is not None:
        calls = spec.tool_calls
        return tool_grammar([fn.model_dump(exclude_none=True) for fn in calls.callable()],
                            required=calls.choice != "auto", parallel=calls.parallel and calls.choice
                            in ("auto", "required"), token_tags=token_tags, syntax=syntax)

    if spec.json_schema is not None or spec.json_object:
        schema = spec.json_schema if spec.json_schema is not None else {"type": "object"}
        # Compact JSON (no spaces or newlines between items): left free, a small model's fused votes
        # drift into whitespace and never close the object. A schema's own x-guidance settings win.
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class GrammarCompiler:
    """Compiles requests' grammars into matchers over one tokenizer (built on first use)."""

    def __init__(self, hf_tokenizer, vocab_width: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_width = vocab_width  # the fused rows' width (padded rows beyond the tokenizer never allowed)
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        # Qwen's tokenizers hold the tool call tags as tokens of their own, which llguidance names as
        # <tags>; others spell them out as text.
        added = hf_tokenizer.get_added_vocab() if hasattr(hf_tokenizer, "get_added_vocab") else {}
        self.token_tags = TRIGGER in added and END in added
        self.tool_syntax = syntax_of(hf_tokenizer)

    def _lltokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_width,
                                                               eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request (its size checked at admission); InvalidArgumentError naming
        the field for a grammar that does not compile."""
        import llguidance

        try:
            grammar = grammar_text(spec, token_tags=self.token_tags, syntax=self.tool_syntax)
        except (ValueError, TypeError) as err:
            raise InvalidArgumentError(f"{FIELD}: {first_line(err)}") from None
        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgumentError(f"{FIELD}: {first_line(matcher.get_error())}")
        return GrammarMatcher(matcher)


def first_line(err: object) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, advanced by each chosen token."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this row's allowed tokens into `bitmask` (B, ceil(V / 32)) int32."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def advance(self, token_id: int) -> bool:
        """Consume the chosen token; True when the grammar is complete (the row ends)."""
        if not self._matcher.consume_token(token_id):
            raise InvalidArgumentError(f"{FIELD}: the grammar refused token {token_id} "
                                       f"({first_line(self._matcher.get_error())})")
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()


def apply_masks(fused: torch.Tensor, matchers: list[tuple[int, GrammarMatcher]]) -> None:
    """Mask, in place, each constrained row b of `fused` (B, V) to the tokens its matcher allows."""
    if not matchers:
        return
    import llguidance.torch

    width = fused.shape[-1]
    rows = torch.tensor([b for b, _ in matchers], device=fused.device)
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), width)  # (R, ceil(V / 32)) int32
    for r, (_, matcher) in enumerate(matchers):
        matcher.fill_mask(bitmask, r)
    constrained = fused[rows]  # (R, V), a copy
    llguidance.torch.apply_token_bitmask_inplace(constrained, bitmask.to(fused.device))
    fused[rows] = constrained
