"""The request loop of cross-tokenizer fusion: `decode` generates text one fused step at a time, and
`score_text` teacher-forces a given text through the same steps, so that a text's log-probability
(and its bits per byte) are the same whichever experts' tokenizers spell it. One step's events come
from `fusion.crosstok.step`; here they are fused by the request's rule, sampled or matched to the text,
and appended to every expert's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from fusion.config import SamplingParams
from fusion.crosstok.step import END, CrossTokenizerFusion, ExpertState, exclusions_after
from fusion.errors import InvalidArgumentError
from fusion.fuse.rules import FusionRule, context_rows
from fusion.fuse.sampler import SamplingMetadata, sample


@dataclass
class TextPiece:
    """One fused step's outcome: the bytes appended to the shared text (b"" for the end)."""

    index: int
    piece: bytes
    logprob: float  # of this event under the fused distribution
    expert_logprobs: list[float | None]  # each expert's own log-probability of it (None: not consulted)
    weights: list[float]
    finish_reason: str | None = None


def fuse_events(rule: FusionRule, weights: Sequence[float], states: Sequence[ExpertState], logprobs: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over the events: logprobs (S, C + 1) of the consulted states → fused (C + 1,) and weights (E,)."""
    width = logprobs.shape[-1]
    full = torch.zeros(num_experts, 1, width)  # (E, 1, C + 1); unconsulted experts have weight 0 or are unread
    for row, state in enumerate(states):
        full[state.index, 0] = logprobs[row]
    w = torch.tensor(weights, dtype=torch.float32)[:, None]  # (E, 1)
    result = rule.fuse(full, w, context_rows([[]]))
    return result.logits[0], result.weights[:, 0]


def decode(fusion: CrossTokenizerFusion, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
           rule: FusionRule, weights: Sequence[float], *, hold_back_prompt: bool = False,
           states_out: list | None = None) -> Iterator[TextPiece]:
    """Generate text: one `TextPiece` per fused step until END, a stop string or `max_tokens` steps."""
    used = [rule.uses_expert(i, weights) for i in range(len(fusion.experts))]
    states = fusion.open(prompt_ids, used, hold_back_prompt=hold_back_prompt)
    if states_out is not None:
        states_out.extend(states)
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    stops = [s.encode("utf-8") for s in sampling.stop]
    text = b""
    excluded: list[bytes] = []
    try:
        for index in range(sampling.max_tokens):
            pieces, logprobs = fusion.events(states, excluded)
            fused, used_weights = fuse_events(rule, weights, states, logprobs, len(fusion.experts))
            if sampling.ignore_eos:  # END is not an option
                fused = fused.clone()
                fused[-1] = -math.inf
            md = SamplingMetadata.build([sampling], len(pieces), {0: generator} if generator else {})
            out = sample(fused[None], md)
            choice = int(out.token_ids[0])
            by_state = {s.index: float(logprobs[r, choice]) for r, s in enumerate(states)}
            piece = pieces[choice]
            reason = None
            if piece is END:
                reason = "stop"
                piece = b""
            text += piece
            if reason is None and any(stop in text for stop in stops):
                reason = "stop"
            if reason is None and index + 1 >= sampling.max_tokens:
                reason = "length"
            yield TextPiece(index, piece, float(out.logprobs[0]),
                            [by_state.get(i) for i in range(len(fusion.experts))],
                            used_weights.tolist(), reason)
            if reason is not None:
                return
            excluded = exclusions_after(pieces, choice)
            for state in states:
                state.advance(piece, commit_all=fusion.params.alignment == "exact_match")
    finally:
        fusion.close(states)


@dataclass
class ScoredText:
    pieces: list[bytes | None]  # the text's pieces, END (None) last when scored
    logprobs: list[list[float]]  # per rule: the fused log-probability of each piece
    expert_logprobs: list[list[float] | None]  # per expert: its own (None: no rule reads it)


def score_text(fusion: CrossTokenizerFusion, prompt_ids: Sequence[Sequence[int]], text: bytes,
               rules: Sequence[tuple[FusionRule, Sequence[float]]], *, end: bool = False,
               hold_back_prompt: bool = False) -> ScoredText:
    """Teacher-forced: split `text` into the steps' pieces (at each step the longest candidate the rest
    of the text starts with; then END if `end`) and return each rule's fused log-probability of every
    piece, and each consulted expert's own. A rule's sum is its log-probability of the text. Every
    expert that some rule reads runs once; every rule is applied to the same event distributions."""
    if not text and not end:
        raise InvalidArgumentError("continuation: must not be empty")
    n = len(fusion.experts)
    used = [any(rule.uses_expert(i, weights) for rule, weights in rules) for i in range(n)]
    states = fusion.open(prompt_ids, used, hold_back_prompt=hold_back_prompt)
    result = ScoredText([], [[] for _ in rules], [[] if used[i] else None for i in range(n)])
    done = 0
    excluded: list[bytes] = []
    try:
        while True:
            if done >= len(text) and not end:
                break
            pieces, logprobs = fusion.events(states, excluded)
            if done < len(text):
                rest = text[done:]
                choice = max((j for j, p in enumerate(pieces) if p is not END and rest.startswith(p)),
                             key=lambda j: len(pieces[j]))
            else:
                choice = len(pieces) - 1
            result.pieces.append(pieces[choice])
            for r, (rule, weights) in enumerate(rules):
                fused, _ = fuse_events(rule, weights, states, logprobs, n)
                result.logprobs[r].append(float(torch.log_softmax(fused.double(), dim=-1)[choice]))
            for row, state in enumerate(states):
                result.expert_logprobs[state.index].append(float(logprobs[row, choice]))
            if pieces[choice] is END:
                break
            done += len(pieces[choice])
            excluded = exclusions_after(pieces, choice)
            for state in states:
                state.advance(pieces[choice], commit_all=fusion.params.alignment == "exact_match")
    finally:
        fusion.close(states)
    return result


def bits_per_byte(logprobs: Sequence[float], num_bytes: int) -> float:
    """Bits per UTF-8 byte from natural-log probabilities: tokenizer-independent."""
    return -sum(logprobs) / math.log(2) / max(num_bytes, 1)
