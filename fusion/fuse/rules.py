"""Fusion rules: small pure functions over the experts' stacked logits, behind one registry.

Every rule maps `logits (E, B, V)` and `weights (E, B)` to fused log-space scores `(B, V)` plus the
weights it effectively used `(E, B)` (for per-token attribution). `context (B, K)`, each row's last K
history ids (left-padded with -1; the last column is the previous token), is context for learned rules;
the others ignore it. Rules validate their parameters at
construction and a request's weights with `check_weights`; both raise `InvalidArgumentError` naming the
field (`fusion.params`, `weights`) and the value, which every door reports as it is.

    weighted_logits   z = Σ w_i z_i, weights normalised to sum 1 (a weighted product of experts)
    mixture           log p = logsumexp_i(log w_i + log_softmax z_i)
    logit_arithmetic  z = Σ w_i log_softmax z_i with signed weights (contrastive decoding, proxy-tuning),
                      restricted to tokens the lead expert finds plausible: p_lead ≥ alpha · max p_lead
    confidence        per-step weights w_i ∝ prior_i · exp(-H_i / tau) from each expert's entropy H_i,
                      then combined as a mixture or weighted logits
    single            one expert's logits, unchanged
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from fusion.errors import InvalidArgumentError

_FLOAT32 = torch.finfo(torch.float32)


# Floor for log-probabilities of impossible tokens, whose probability is exactly 0 in float32: before a
# signed combination (-inf times a negative weight would become +inf) and in entropies (0 · -inf would
# be a NaN).
LOGPROB_FLOOR = -1e4


CONTEXT_TOKENS = 64  # history ids a rule sees per row


def context_rows(histories: Sequence[Sequence[int]], device: torch.device | str = "cpu",
                 k: int = CONTEXT_TOKENS) -> torch.Tensor:
    """The last `k` ids of each history, left-padded with -1: (B, k) long."""
    rows = [list(h[-k:]) for h in histories]
    return torch.tensor([[-1] * (k - len(r)) + r for r in rows], dtype=torch.long, device=device)


def teacher_forced_context(prefix: Sequence[int], continuation: Sequence[int], device: torch.device | str = "cpu",
                           k: int = CONTEXT_TOKENS) -> torch.Tensor:
    """Context rows for predicting each id of `continuation` after `prefix`: row j holds the last `k`
    ids of prefix + continuation[:j]. (n, k) long."""
    tail = list(prefix[-k:])
    ids = [-1] * (k - len(tail)) + tail + list(continuation[:-1])  # (k + n - 1,)
    return torch.tensor(ids, dtype=torch.long, device=device).unfold(0, k, 1)  # (n, k)


@dataclass
class FusedLogits:
    logits: torch.Tensor  # (B, V) fused log-space scores
    weights: torch.Tensor  # (E, B) weights each expert effectively had
    # (E, B) logsumexp of each expert's logits over the vocabulary, where the rule computed it on the
    # way (rules over log-probabilities): the engine's attribution reuses it instead of another pass.
    log_normalizers: torch.Tensor | None = None


def log_softmax_and_normalizer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax over the last dim, and the logsumexp it subtracted: (E, B, V), (E, B)."""
    normalizer = torch.logsumexp(logits, dim=-1)  # (E, B)
    return logits - normalizer[..., None], normalizer


_ARGMAX_BLOCK = 256  # ids per block in `row_argmax`


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first of equal maxima, as `argmax`): (..., V) → (...,) long.
    On a CPU `argmax` walks a 49,152-wide row one element at a time (~0.13 ms for three rows) while
    `amax` is vectorised (~0.01 ms), so the row is cut into blocks: the block maxima pick the first
    block holding the maximum, and only that block is searched element by element (elsewhere, or on
    a row that is no whole number of blocks, plain `argmax`)."""
    width = values.shape[-1]
    if values.device.type != "cpu" or width % _ARGMAX_BLOCK or width < 2 * _ARGMAX_BLOCK:
        return values.argmax(-1)
    blocks = values.reshape(*values.shape[:-1], width // _ARGMAX_BLOCK, _ARGMAX_BLOCK)  # (..., N, G)
    block = blocks.amax(-1).argmax(-1, keepdim=True)  # (..., 1)
    inside = blocks.gather(-2, block[..., None].expand(*block.shape, _ARGMAX_BLOCK))  # (..., 1, G)
    return block[..., 0] * _ARGMAX_BLOCK + inside[..., 0, :].argmax(-1)


class FusionRule:
    name: ClassVar[str]
    param_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, expert_names: Sequence[str], **params: Any) -> None:
        unknown = sorted(set(params) - set(self.param_names))
        if unknown:
            raise InvalidArgumentError(
                f"fusion.params: rule {self.name!r} has no parameter(s) {unknown}; it takes {list(self.param_names)}"
            )
        self.expert_names = list(expert_names)

    def check_weights(self, weights: Sequence[float]) -> None:
        """Non-negative weights with a positive sum (the default for averaging rules)."""
        self._check_count(weights)
        for name, w in zip(self.expert_names, weights):
            if not math.isfinite(w) or w < 0:
                raise InvalidArgumentError(f"weights: rule {self.name!r} needs finite weights >= 0; expert {name!r} has {w}")
        if sum(weights) <= 0:
            raise InvalidArgumentError(f"weights: rule {self.name!r} needs a positive weight sum, got {list(weights)}")

    def bind(self, experts: Sequence[Any]) -> None:
        """Called once with the engine's experts before first use; learned rules check them here."""

    def uses_expert(self, index: int, weights: Sequence[float]) -> bool:
        """Whether the rule reads expert `index`'s logits under these weights (others need no forward)."""
        return weights[index] != 0

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        raise NotImplementedError

    def _check_count(self, weights: Sequence[float]) -> None:
        """One weight per expert, each one float32 can hold: the steps compute in float32, where 1e300
        is inf and 1e-300 is 0, and either turns every fused logit into NaN."""
        if len(weights) != len(self.expert_names):
            raise InvalidArgumentError(
                f"weights: rule {self.name!r} needs {len(self.expert_names)} weights "
                f"(one per expert {self.expert_names}), got {len(weights)}"
            )
        for name, w in zip(self.expert_names, weights):
            if math.isfinite(w) and w != 0 and not _FLOAT32.tiny <= abs(w) <= _FLOAT32.max:
                raise InvalidArgumentError(f"weights: expert {name!r}'s weight {w} is outside float32's range: 0 or a magnitude "
                                 f"from {_FLOAT32.tiny:.3g} to {_FLOAT32.max:.3g}")
        if all(math.isfinite(w) for w in weights) and math.fsum(abs(w) for w in weights) > _FLOAT32.max:
            raise InvalidArgumentError(f"weights: the weights' sum of magnitudes exceeds float32's range ({_FLOAT32.max:.3g})")

    def _expert_index(self, param: str, value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(self.expert_names):
            return value
        if isinstance(value, str) and value in self.expert_names:
            return self.expert_names.index(value)
        raise InvalidArgumentError(f"fusion.params: rule {self.name!r}: {param} must name an expert of {self.expert_names}, got {value!r}")


def _normalised(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=0, keepdim=True)  # (E, B)


def _weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i · values_i over (E, B, V), skipping zero weights so that 0 · -inf stays out."""
    terms = torch.where(weights[..., None] != 0, weights[..., None] * values, torch.zeros((), dtype=values.dtype))
    return terms.sum(dim=0)  # (B, V)


def _mixture(log_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log Σ_i w_i p_i from log-probabilities (E, B, V) → (B, V)."""
    return torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)  # log 0 = -inf drops out


class WeightedLogits(FusionRule):
    name = "weighted_logits"

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        w = _normalised(weights)
        return FusedLogits(_weighted_sum(logits, w), w)


class Mixture(FusionRule):
    name = "mixture"

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        w = _normalised(weights)
        log_probs, normalizer = log_softmax_and_normalizer(logits)
        return FusedLogits(_mixture(log_probs, w), w, normalizer)


class LogitArithmetic(FusionRule):
    name = "logit_arithmetic"
    param_names = ("alpha", "lead")

    def __init__(self, expert_names: Sequence[str], alpha: float = 0.1, lead: int | str = 0) -> None:
        super().__init__(expert_names)
        if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
            raise InvalidArgumentError(f"fusion.params: rule {self.name!r}: alpha must be in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.lead = self._expert_index("lead", lead)

    def check_weights(self, weights: Sequence[float]) -> None:
        self._check_count(weights)
        for name, w in zip(self.expert_names, weights):
            if not math.isfinite(w):
                raise InvalidArgumentError(f"weights: rule {self.name!r} needs finite weights; expert {name!r} has {w}")
        if weights[self.lead] <= 0:
            raise InvalidArgumentError(
                f"weights: rule {self.name!r}: the lead expert {self.expert_names[self.lead]!r} needs a positive "
                f"weight, got {weights[self.lead]}"
            )

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        log_probs, normalizer = log_softmax_and_normalizer(logits)
        log_probs = log_probs.clamp(min=LOGPROB_FLOOR)  # (E, B, V)
        combined = _weighted_sum(log_probs, weights)  # (B, V)
        lead = log_probs[self.lead]  # (B, V)
        # p_lead >= alpha * max p_lead  <=>  log p_lead >= log alpha + max log p_lead
        threshold = lead.max(dim=-1, keepdim=True).values + math.log(self.alpha) if self.alpha > 0 else None
        if threshold is not None:
            combined = combined.masked_fill(lead < threshold, float("-inf"))
        return FusedLogits(combined, weights, normalizer)


def confidence_weights(prior: torch.Tensor, entropy: torch.Tensor, tau: float) -> torch.Tensor:
    """Weights prior (E, B) scaled by exp(-H / tau), H (E, B) each expert's entropy in nats, and renormalised
    over the experts: a softmax of (log prior - H / tau), so zero priors stay zero. The sharper an expert's
    distribution, the larger its share; a large tau leaves the prior as it is."""
    return torch.softmax(torch.log(prior) - entropy / tau, dim=0)


def check_tau(rule: str, tau: Any) -> float:
    """`tau` as a float, or InvalidArgumentError naming the field."""
    if isinstance(tau, bool) or not (isinstance(tau, (int, float)) and tau > 0 and math.isfinite(tau)):
        raise InvalidArgumentError(f"fusion.params.tau: rule {rule!r}: tau must be a finite number > 0, got {tau!r}")
    return float(tau)


class Confidence(FusionRule):
    name = "confidence"
    param_names = ("tau", "combine")

    def __init__(self, expert_names: Sequence[str], tau: float = 1.0, combine: str = "mixture") -> None:
        super().__init__(expert_names)
        self.tau = check_tau(self.name, tau)
        if combine not in ("mixture", "weighted_logits"):
            raise InvalidArgumentError(f"fusion.params: rule {self.name!r}: combine must be 'mixture' or 'weighted_logits', got {combine!r}")
        self.combine = combine

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        log_probs, normalizer = log_softmax_and_normalizer(logits)  # (E, B, V), (E, B)
        entropy = -(log_probs.exp() * log_probs.clamp(min=LOGPROB_FLOOR)).sum(dim=-1)  # (E, B) nats
        w = confidence_weights(weights, entropy, self.tau)  # (E, B)
        fused = _mixture(log_probs, w) if self.combine == "mixture" else _weighted_sum(logits, w)
        return FusedLogits(fused, w, normalizer)


class Single(FusionRule):
    name = "single"
    param_names = ("expert",)

    def __init__(self, expert_names: Sequence[str], expert: int | str = 0) -> None:
        super().__init__(expert_names)
        self.index = self._expert_index("expert", expert)

    def check_weights(self, weights: Sequence[float]) -> None:
        self._check_count(weights)

    def uses_expert(self, index: int, weights: Sequence[float]) -> bool:
        return index == self.index

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        w = torch.zeros_like(weights)
        w[self.index] = 1.0
        return FusedLogits(logits[self.index], w)


BUILTIN_RULES: dict[str, type[FusionRule]] = {
    rule.name: rule for rule in (WeightedLogits, Mixture, LogitArithmetic, Confidence, Single)
}
