"""The engine's plain data: a request in token ids, the events a decode step emits (a token with its
attribution, or a request's error), a step's timings and logits, and the per-row state a
`fusion.engine.batch.DecodeBatch` keeps for each running request."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from fusion.config import SamplingParams
from fusion.fuse.rules import FusionRule
from fusion.fuse.structured import GrammarMatcher
from fusion.engine.tenancy import LOCAL, Tenant

_request_counter = itertools.count()

FUSED_NOT_FINITE = ("the fused logits are not finite (NaN or inf) although every expert's are: the rule's "
                    "arithmetic overflowed float32 with these weights")


def nonfinite(logits: torch.Tensor) -> torch.Tensor:
    """(...,) bool over logits (..., V): a NaN or +inf, or no finite value at all. One pass: the max is
    NaN if any is NaN, +inf if any is, -inf only if all are."""
    top = logits.amax(-1)
    return top.isnan() | top.isinf()


def nonfinite_rows(fused: torch.Tensor) -> set[int]:
    """Rows of fused logits (B, V) that are `nonfinite`. One host sync."""
    bad = nonfinite(fused)  # (B,)
    return set(bad.nonzero()[:, 0].tolist()) if bool(bad.any()) else set()


def new_request_id() -> str:
    return f"req-{time.time_ns():x}-{next(_request_counter)}"


@dataclass
class GenerationRequest:
    prompt_ids: list[list[int]]  # one prompt per expert (each may format the prompt its own way)
    sampling: SamplingParams
    rule: FusionRule
    weights: list[float]  # one per expert
    request_id: str = field(default_factory=new_request_id)
    tenant: Tenant = LOCAL  # whose share of the batch, the prefill budget and the score chunks it uses
    # Built once by `FusionEngine.admit`, read by every step:
    token_bias: torch.Tensor | None = None  # (V,) additive: banned ids -inf, logit_bias elsewhere
    stop_ids: frozenset[int] | None = None  # ids that end the request (EOS unless ignore_eos, stop ids)
    grammar: GrammarMatcher | None = None  # sampling.structured, compiled (FusionService.admit): masks each step
    # Token healing (fusion.frontdoor.healing): the prompt's backed-up last token's text, which the first
    # token re-writes (not shown again), and the ids the first token may be, (V,) bool.
    healed_text: str = ""
    first_token_mask: torch.Tensor | None = None


@dataclass
class ExpertAttribution:
    expert: str
    weight: float  # the weight the rule gave this expert at this step
    prob: float | None  # the expert's own probability of the chosen token (None: not consulted)


@dataclass
class TokenEvent:
    request_id: str
    index: int  # position in the generated sequence
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    attribution: list[ExpertAttribution]
    finish_reason: str | None = None  # "stop" (EOS / stop id), "length", or set by the edge


@dataclass
class ErrorEvent:
    request_id: str
    error: Exception


@dataclass
class StepTimings:
    step_s: float = 0.0  # the whole step: forwards, fusion, sampling, bookkeeping
    experts_s: float = 0.0  # wall time of the expert forwards
    per_expert_s: dict[str, float] = field(default_factory=dict)
    fuse_s: float = 0.0  # the finiteness check + the rule's fusion
    fuse_sample_s: float = 0.0  # fuse_s + sampling + attribution


@dataclass
class StepLogits:
    rows: list  # the Row objects still active, in batch order
    logits: torch.Tensor | None  # (E, B, V) aligned expert logits
    fused: torch.Tensor | None  # (B, V)
    weights: torch.Tensor | None  # (E, B)
    errors: list[ErrorEvent]
    log_normalizers: torch.Tensor | None = None  # (E, B) logsumexp of each expert's row, if the rule had it


@dataclass
class StepJob:
    session_id: str
    histories: list[list[int] | None]  # per expert: the ids to step on (None: expert not consulted)


@dataclass
class Row:
    request: GenerationRequest
    generated: list[int] = field(default_factory=list)
    prefilled: list[int] | None = None  # prompt ids each expert has computed while joining; None: joined
    uses: list[bool] = field(default_factory=list)  # which experts the request's rule reads
    generator: torch.Generator | None = None
    output_counts: torch.Tensor | None = None  # (V,) for frequency/presence penalties
    seen: torch.Tensor | None = None  # (V,) bool for the repetition penalty
