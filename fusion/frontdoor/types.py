"""What callers hand the front door (`fusion.frontdoor.service.FusionService`) and what it gives back: a request,
its text events and usage, a score, a completion, and the service's description of itself. Plain data,
shared by every door (Python, CLI, gRPC, HTTP, Ray), which convert them to and from their wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from fusion.config import FusionSpec, Limits, SamplingParams, SpecOverrides
from fusion.crosstok.decode import bits_per_byte
from fusion.engine.types import TokenEvent
from fusion.experts.expert import ExpertInfo
from fusion.engine.tenancy import LOCAL, Tenant
from fusion.frontdoor.text import Message


@dataclass(frozen=True)
class FusionRequest:
    """What a caller asks for. Unset fields take the config's defaults (see `layer_spec`)."""

    prompt: str | Sequence[Message] | Sequence[int]  # token ids: a plain prompt of the shared vocabulary
    sampling: Mapping[str, Any] | SamplingParams | None = None  # fields over the config's sampling
    spec: SpecOverrides | FusionSpec | None = None  # rule, params, weights, profile over the config's
    request_id: str | None = None  # the caller's id; it prefixes the service's own (unique) id
    plain: bool = False  # a text prompt continued as is: no chat template or system prompt (OpenAI's completions)
    tenant: Tenant = LOCAL  # who asks: its share of every queue, its max_tokens cap and its token quota
    # Chat messages whose last one, the assistant's, the answer carries on (vLLM's continue_final_message):
    # a reply's opening written for the model, such as the start of a code block.
    continue_final_message: bool = False


@dataclass
class PromptLogprobs:
    """A prompt's tokens, each one's fused log-probability after those before it, and the top alternatives
    at each position (ids, log-probs); the first token has neither (None)."""

    token_ids: list[int]
    logprobs: list[float | None]
    alternatives: list[tuple[list[int], list[float]] | None]
    ranks: list[int | None]  # each token's rank in its position's distribution (1: the likeliest)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class TextEvent:
    token: TokenEvent
    text: str  # the text this token made visible (may be empty while a character or stop is pending)
    finish_reason: str | None = None
    usage: Usage | None = None  # on the last event only


@dataclass
class ScoreResult:
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int = 0  # the prompt's length in the first expert's tokens (0: not known, e.g. remote)
    text: str = ""  # the text the log-probabilities cover: the continuation after any whitespace the
    # prompt ended with (moved over by the lm-evaluation-harness rule; "" when not known, e.g. remote)
    pieces: list[str] = field(default_factory=list)  # experts of different tokenizers: the scored text pieces
    remote_bits_per_byte: float | None = None  # as a server reported it (a client's result has no text)

    @property
    def total_logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def bits_per_byte(self) -> float | None:
        """Bits per UTF-8 byte of `text` (tokenizer-independent); None when the text is not known."""
        if not self.text:
            return self.remote_bits_per_byte
        return bits_per_byte(self.logprobs, len(self.text.encode("utf-8")))


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class ExpertDescription:
    info: ExpertInfo
    default_weight: float
    addresses: list[str]
    active_sessions: int


@dataclass(frozen=True)
class ServiceDescription:
    experts: list[ExpertDescription]
    rules: dict[str, tuple[str, ...]]  # rule name -> its parameter names
    profiles: dict[str, dict[str, float]]
    default_spec: FusionSpec
    default_sampling: SamplingParams
    limits: Limits
    active_requests: int
