"""A learned token-level router (FusionRoute style) and the `route` fusion rule.

At every step a light network reads what is known at decode time — each expert's confidence
(entropy, top-1 log-prob, top-1/top-2 margin), how much each expert believes the others' top
choice, an embedding of the previous token, and bags of the recent tokens' embeddings (which tell
arithmetic from code from prose) — and outputs

  * routing weights over the experts `w (E, B)` (softmax), and
  * a complementary logit `c (B, V)` added in log space, which lets the fused distribution reach
    tokens no single expert ranks first (pure routing between fixed experts cannot).

    fused = logsumexp_i(log w_i + log_softmax z_i) + c

The complementary head may be factored, hidden → rank → vocabulary (`RouterShape.comp_rank`): its
vocabulary-wide matrix is what a decode step reads, and rank 16 reads a sixth of the one-layer head's.

The experts are never changed. A checkpoint stores the router's weights, its shape, and the
fingerprints of the experts it was trained with; loading it against other experts is refused.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import pickle
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from fusion.forward import native_kernels
from fusion.compute import single_team
from fusion.errors import ConfigError, InvalidArgumentError
from fusion.fuse.rules import (
    CONTEXT_TOKENS, LOGPROB_FLOOR, FusedLogits, FusionRule, check_tau, confidence_weights, row_argmax,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class RouterShape:
    num_experts: int
    vocab_size: int
    embed_dim: int = 32
    hidden: int = 96
    complementary: bool = True
    windows: tuple[int, ...] = (8, CONTEXT_TOKENS)  # recent-token bags, each the mean over its last w ids
    # The complementary layer as hidden → comp_rank → vocab (0: one hidden → vocab layer, as checkpoints
    # before the factored head have). Its vocab-wide matrix is what a decode step reads: 96 × 49,152 fp32
    # is 18.9 MB, ~1 ms at a CPU's memory bandwidth; rank 16 reads a sixth of it.
    comp_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "windows", tuple(int(w) for w in self.windows))
        if not self.windows or not all(0 < w <= CONTEXT_TOKENS for w in self.windows):
            raise ValueError(f"router windows must be in [1, {CONTEXT_TOKENS}], got {self.windows}")
        if not 0 <= self.comp_rank < self.hidden:
            raise ValueError(f"router comp_rank must be in [0, {self.hidden}), got {self.comp_rank}")

    @property
    def comp_width(self) -> int:
        """The width of the vocab-wide layer's input."""
        return self.comp_rank or self.hidden

    @property
    def num_features(self) -> int:
        return 3 * self.num_experts + self.num_experts**2

    @property
    def num_inputs(self) -> int:
        return self.num_features + self.embed_dim * (1 + len(self.windows))


def logit_features(log_probs: torch.Tensor) -> torch.Tensor:
    """Decode-time statistics of the experts' distributions. (E, B, V) log-probs → (B, 3E + E²)."""
    E = log_probs.shape[0]
    probs = log_probs.exp()
    entropy = -(probs * log_probs.clamp(min=LOGPROB_FLOOR)).sum(-1)  # (E, B)
    top2 = log_probs.topk(2, dim=-1)
    top1_lp = top2.values[..., 0]  # (E, B)
    margin = top2.values[..., 0] - top2.values[..., 1]
    top1_ids = top2.indices[..., 0]  # (E, B)
    # agreement[e, f] = expert e's log-prob of expert f's top choice
    agreement = torch.stack(
        [log_probs[e].gather(-1, top1_ids.T) for e in range(E)]
    )  # (E, B, E)
    feats = [entropy.T, top1_lp.T.clamp(min=-30), margin.T.clamp(max=30), agreement.permute(1, 0, 2).reshape(
        log_probs.shape[1], E * E).clamp(min=-30)]
    return torch.cat(feats, dim=-1)  # (B, 3E + E²)


def logit_statistics(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logit_features(log_softmax(logits))` and the logsumexp the log-softmax subtracts, from the raw
    logits without materialising the log-probabilities: two maxima, one exp and two reductions over
    (E, B, V). logits (E, B, V) float, every row with a finite maximum → (B, 3E + E²), (E, B)."""
    if _native_passes(logits):  # two reads of each row in C, where torch makes a dozen passes
        E, B, V = logits.shape
        top1_ids, best, runner_up, log_total, entropy = (
            t.view(E, B) for t in native_kernels.logit_statistics(logits.reshape(E * B, V), LOGPROB_FLOOR))
        normalizer = best + log_total
        features = _features(logits, log_total, normalizer, entropy, runner_up, top1_ids)
    else:
        top1_ids = row_argmax(logits)  # (E, B)
        features, normalizer, runner_up = _statistics(logits, top1_ids)
    # Tied maxima name the id `topk` names, as in `logit_features` (the router's training); so does a
    # GPU, where topk is cheap and checking for ties would wait for the device.
    if logits.device.type != "cpu" or bool((runner_up == 0).any()):
        top1_ids = logits.topk(2, dim=-1).indices[..., 0]
        features[:, -top1_ids.shape[0] ** 2:] = _agreement(logits, normalizer, top1_ids)
    return features, normalizer


def _native_passes(*tensors: torch.Tensor) -> bool:
    """Whether the vocabulary-wide passes run in the project's C (`native_kernels.logit_statistics`,
    `mixture`): float32 CPU tensors with no gradient to carry (training keeps torch's operators)."""
    return (native_kernels.reads_logits(tensors[0])
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _softmax_parts(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both statistics read off the rows: logits (E, B, V) → the shifted rows y = z - max (E, B, V),
    log Σe^y, the normalizer (logsumexp) and the entropy (E, B) each."""
    best = logits.amax(-1, keepdim=True)  # (E, B, 1)
    # y = z - max ≤ 0; -inf ids go to the floor, whose exp is exactly 0, so e^y · y stays 0
    shifted = (logits - best).clamp_(min=LOGPROB_FLOOR)  # (E, B, V)
    unnormalised = shifted.exp()  # (E, B, V)
    total = unnormalised.sum(-1)  # (E, B), in [1, V]
    log_total = total.log()
    # log p = y - log Σe^y, so H = -Σ p log p = log Σe^y - Σ e^y · y / Σe^y
    entropy = log_total - torch.linalg.vecdot(unnormalised, shifted) / total  # (E, B)
    return shifted, log_total, best[..., 0] + log_total, entropy


def _features(logits: torch.Tensor, log_total: torch.Tensor, normalizer: torch.Tensor, entropy: torch.Tensor,
              runner_up: torch.Tensor, top1_ids: torch.Tensor) -> torch.Tensor:
    """The router's logit features from the rows' parts, each (E, B): (B, 3E + E²). -log Σe^y is the best
    id's log p; the runner-up is its logit less the best's."""
    return torch.cat([entropy.T, (-log_total).T.clamp(min=-30), (-runner_up).T.clamp(max=30),
                      _agreement(logits, normalizer, top1_ids)], dim=-1)


def _statistics(logits: torch.Tensor, top1_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logit_statistics` given each row's best id (E, B), without the tie check: the features (B, 3E + E²),
    the normalizers (E, B) and each row's runner-up logit less its best (E, B), 0 where the maximum ties."""
    shifted, log_total, normalizer, entropy = _softmax_parts(logits)
    # the runner-up: the shifted row without its best id (a tied maximum leaves a 0 behind: margin 0)
    runner_up = shifted.scatter_(-1, top1_ids[..., None], float("-inf")).amax(-1)  # (E, B) ≤ 0
    return _features(logits, log_total, normalizer, entropy, runner_up, top1_ids), normalizer, runner_up


def _agreement(logits: torch.Tensor, normalizer: torch.Tensor, top1_ids: torch.Tensor) -> torch.Tensor:
    """agreement[b, e·E + f] = expert e's log p of expert f's top id: logits (E, B, V), normalizer and
    top1_ids (E, B) → (B, E²)."""
    E, B, _ = logits.shape
    agreement = logits.gather(-1, top1_ids.T.expand(E, B, E)) - normalizer[..., None]  # (E, B, E)
    return agreement.permute(1, 0, 2).reshape(B, E * E).clamp(min=-30)


def _picked_log_probs(logits: torch.Tensor, normalizer: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Row b of expert picked[b]'s log-probabilities: logits (E, B, V), normalizer (E, B), picked (B,)
    → (B, V). (A gather along the experts: half the time of advanced indexing on a CPU.)"""
    B, V = logits.shape[1:]
    rows = logits.gather(0, picked[None, :, None].expand(1, B, V))[0]  # (B, V)
    return rows - normalizer.gather(0, picked[None])[0][:, None]


class FamiliarityGate:
    """Fail-safe: how far a step's router inputs lie from those seen in training, and a pull towards
    the generalist that grows with it.

    d² = |(x - mean) @ whiten|² / F (a Mahalanobis distance; `whiten` is a Cholesky factor of the
    shrunk inverse covariance of training inputs), and the pull g = clamp(d² / limit - 1, 0, 1), where
    `limit` is the 99th percentile of d² on training positions held out from the fit: no pull on what
    training saw, all of it at twice that distance. The router's weights become (1 - g) w + g e_gen
    and its complementary logit (1 - g) c."""

    QUANTILE = 0.99

    def __init__(self, mean: torch.Tensor, whiten: torch.Tensor, limit: float, generalist: int = 0) -> None:
        # Not a submodule: checkpoints carry it beside the router's state dict, and older ones lack it.
        self.mean = mean  # (F,)
        self.whiten = whiten  # (F, F)
        self.limit = float(limit)
        self.generalist = int(generalist)

    @classmethod
    def fit(cls, inputs: torch.Tensor, held: torch.Tensor, generalist: int = 0, shrink: float = 1e-2) -> "FamiliarityGate":
        """inputs (N, F) to fit the mean and covariance, held (M, F) to set the limit."""
        inputs = inputs.double()
        mean = inputs.mean(0)
        cov = torch.cov((inputs - mean).T)  # (F, F)
        cov = cov + shrink * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype)
        whiten = torch.linalg.cholesky(torch.linalg.inv(cov))
        gate = cls(mean.float(), whiten.float(), 1.0, generalist)
        gate.limit = float(torch.quantile(gate.distance(held.float()), cls.QUANTILE))
        return gate

    def distance(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, F) → squared distance per row (B,)."""
        return ((x - self.mean.to(x.device)) @ self.whiten.to(x.device)).pow(2).mean(-1)

    def pull(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, F) → g (B,) in [0, 1]."""
        return (self.distance(x) / self.limit - 1.0).clamp(0.0, 1.0)

    def state(self) -> dict:
        return {"mean": self.mean, "whiten": self.whiten, "limit": self.limit, "generalist": self.generalist}


class Router(nn.Module):
    def __init__(self, shape: RouterShape) -> None:
        super().__init__()
        self.shape = shape
        self.gate: FamiliarityGate | None = None  # set by training (`FamiliarityGate.fit`) or a checkpoint
        self.embed = nn.Embedding(shape.vocab_size, shape.embed_dim)
        self.body = nn.Sequential(
            nn.LayerNorm(shape.num_inputs),
            nn.Linear(shape.num_inputs, shape.hidden), nn.GELU(),
            nn.Linear(shape.hidden, shape.hidden), nn.GELU(),
        )
        self.route = nn.Linear(shape.hidden, shape.num_experts)
        # comp_down (hidden → rank, factored heads only) then comp (→ vocab)
        self.comp_down = (nn.Linear(shape.hidden, shape.comp_rank, bias=False)
                          if shape.complementary and shape.comp_rank else None)
        self.comp = nn.Linear(shape.comp_width, shape.vocab_size) if shape.complementary else None
        if self.comp is not None:  # start as pure routing; training grows the complementary logit
            nn.init.zeros_(self.comp.weight)  # (comp_down keeps its random start: a gradient reaches both)
            nn.init.zeros_(self.comp.bias)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_native_cache", None)  # pointers into this process's tensors: made again where it is used
        return state

    def context_features(self, context: torch.Tensor) -> torch.Tensor:
        """context (B, K) recent ids, -1 = none → previous-token embedding and one mean-embedding
        bag per window: (B, embed_dim · (1 + len(windows)))."""
        valid = (context >= 0).float()  # (B, K)
        emb = self.embed(context.clamp(min=0)) * valid[..., None]  # (B, K, D)
        parts = [emb[:, -1]]
        for w in self.shape.windows:
            count = valid[:, -w:].sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
            parts.append(emb[:, -w:].sum(1) / count)
        return torch.cat(parts, dim=-1)

    def inputs(self, log_probs: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The body's input: logit features and context embeddings, (B, num_inputs)."""
        return torch.cat([logit_features(log_probs), self.context_features(context)], dim=-1)

    def forward(
        self, log_probs: torch.Tensor, context: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """log_probs (E, B, V), context (B, K) recent ids, allowed (E, B) bool → route logits (B, E),
        weights (E, B), complementary logit (B, V) or None."""
        return self.head(self.inputs(log_probs, context), allowed)

    def head(self, inputs: torch.Tensor, allowed: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`forward` from the body's inputs (B, num_inputs)."""
        h = self.body(inputs)  # (B, hidden)
        route_logits, weights = self.route_weights(h, allowed)
        comp = self.comp(self._comp_input(h)) if self.comp is not None else None
        return route_logits, weights, comp

    def _comp_input(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, hidden) → the vocab-wide layer's input (B, comp_width)."""
        return h if self.comp_down is None else self.comp_down(h)

    def route_weights(self, h: torch.Tensor, allowed: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, hidden) → route logits (B, E) and weights (E, B); experts not `allowed` get 0."""
        route_logits = self.route(h)  # (B, E)
        if allowed is not None:
            route_logits = route_logits.masked_fill(~allowed.T, float("-inf"))
        return route_logits, torch.softmax(route_logits, dim=-1).T

    def fuse(self, logits: torch.Tensor, context: torch.Tensor, allowed: torch.Tensor | None = None,
             hard: bool = False, complementary: bool = True, fail_safe: bool = False,
             tau: float | None = None) -> FusedLogits:
        """The fused scores of one step: logits (E, B, V), context (B, K), allowed (E, B) bool.
        Equal to `logsumexp_i(log w_i + log_softmax z_i) + c` over `forward`'s outputs, in fewer passes
        over the vocabulary: the features come from the raw logits, a hard pick reads one expert's row,
        and the complementary logit is accumulated straight into the fused scores. With `tau` the router's
        weights are scaled by each expert's confidence first (`confidence_weights`)."""
        logits = logits.float()
        features, normalizer = logit_statistics(logits)  # (B, 3E + E²), (E, B)
        return self._fuse_from(logits, features, normalizer, context, allowed, hard, complementary, fail_safe, tau)

    def _fuse_from(self, logits: torch.Tensor, features: torch.Tensor, normalizer: torch.Tensor,
                   context: torch.Tensor, allowed: torch.Tensor | None, hard: bool, complementary: bool,
                   fail_safe: bool, tau: float | None = None) -> FusedLogits:
        """`fuse` past the logit features: features (B, 3E + E²), normalizer (E, B)."""
        add_comp = self.comp is not None and complementary
        head = self._native_head(logits, features, context, allowed, fail_safe)
        if head is not None:  # the router's head in one C call: its weights (E, B), keep (B,), keep · comp input
            weights, keep, comp_input = head
            comp = (comp_input, self.comp.weight.T, self.comp.bias, keep) if add_comp else None
        else:
            inputs = torch.cat([features, self.context_features(context)], dim=-1)  # (B, F): the head's, the gate's
            h = self.body(inputs)  # (B, hidden)
            _, weights = self.route_weights(h, allowed)  # (E, B)
            keep = None  # (B,) the share of the complementary logit the gate leaves; None: all of it
            if fail_safe and self.gate is not None:
                weights, keep = self._pull_to_generalist(inputs, weights, allowed)
            comp = self._complementary_parts(h, keep) if add_comp else None
        if tau is not None:  # the features' first E columns are each expert's entropy (`logit_features`)
            weights = confidence_weights(weights, features[:, :weights.shape[0]].T, tau)  # (E, B)
        if hard:  # pick one expert per row: the mixture is that expert's log-probabilities
            picked = weights.argmax(0)  # (B,)
            weights = torch.nn.functional.one_hot(picked, weights.shape[0]).T.to(weights.dtype)
            fused = _picked_log_probs(logits, normalizer, picked)  # (B, V)
        elif _native_passes(logits, weights) and logits.shape[0] <= native_kernels.MIXTURE_MAX:
            # one pass in C over the logits, the complementary logit added in it
            fused = native_kernels.mixture(logits, torch.log(weights), normalizer, comp)  # (B, V)
            return FusedLogits(fused, weights, normalizer)
        else:
            log_probs = logits - normalizer[..., None]  # (E, B, V)
            fused = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)  # (B, V)
        if comp is not None:
            fused = self._add_complementary(fused, *comp)
        return FusedLogits(fused, weights, normalizer)

    def _native_head(self, logits: torch.Tensor, features: torch.Tensor, context: torch.Tensor,
                     allowed: torch.Tensor | None, fail_safe: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The router's head (context features, body, route weights, the gate's pull, the complementary layer's
        input) as one call into the project's C (`native_kernels.router_head`) where the route rule's passes run
        there (`_native_passes`: float32 CPU logits, eagerly, no gradient), the router is a CPU float32 one of
        this layout and no gradient is taken through it; None elsewhere (torch's operators then). At a step's
        few rows torch's thirty-odd small operators cost more than their arithmetic; the C head computes the
        same float32 arithmetic in its own order (within float32 rounding of torch's)."""
        if not _native_passes(logits) or (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
            return None
        params = self._native_params(context.shape[-1])
        if params is None:
            return None
        if allowed is None:
            allowed = torch.ones(self.shape.num_experts, features.shape[0], dtype=torch.bool)
        return native_kernels.router_head(params, features, context, allowed, fail_safe)

    def _native_fits(self, context_tokens: int) -> bool:
        """Whether the C head takes this router's layout and sizes (its tensors checked apart)."""
        shape, body = self.shape, list(self.body)
        return (len(body) == 5 and isinstance(body[0], nn.LayerNorm) and isinstance(body[1], nn.Linear)
                and isinstance(body[2], nn.GELU) and body[2].approximate == "none" and isinstance(body[3], nn.Linear)
                and isinstance(body[4], nn.GELU) and body[4].approximate == "none"
                and max(shape.num_inputs, shape.hidden) <= native_kernels.ROUTER_MAX_WIDTH
                and shape.num_experts <= native_kernels.ROUTER_MAX_EXPERTS
                and len(shape.windows) <= native_kernels.ROUTER_MAX_WINDOWS and max(shape.windows) <= context_tokens)

    def _native_params(self, context_tokens: int) -> native_kernels.RouterParams | None:
        """`native_kernels.RouterParams` pointing at this router's current tensors (remade when any of them is
        another tensor than when they were made), or None where the C head does not take this router."""
        if not self._native_fits(context_tokens):
            return None
        norm, first, _, second, _ = self.body
        gate = self.gate
        tensors = {"embed": self.embed.weight, "norm_weight": norm.weight, "norm_bias": norm.bias,
                   "w1": first.weight, "b1": first.bias, "w2": second.weight, "b2": second.bias,
                   "route_weight": self.route.weight, "route_bias": self.route.bias,
                   "comp_down": self.comp_down.weight if self.comp_down is not None else None,
                   "gate_mean": gate.mean if gate is not None else None,
                   "gate_whiten": gate.whiten if gate is not None else None}
        key = (context_tokens, id(gate), gate and (gate.limit, gate.generalist),
               *(t.data_ptr() for t in tensors.values() if t is not None))
        cached = getattr(self, "_native_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if gate is not None:  # (a gate is fitted once, never updated in place: a copy in row-major order serves)
            tensors["gate_mean"], tensors["gate_whiten"] = gate.mean.contiguous(), gate.whiten.contiguous()
        present = [t for t in tensors.values() if t is not None]
        params = None
        if all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in present):
            shape = self.shape
            params = native_kernels.RouterParams(
                experts=shape.num_experts, features=shape.num_features, embed_dim=shape.embed_dim,
                hidden=shape.hidden, comp_width=shape.comp_width if self.comp is not None else 0,
                context=context_tokens, windows=(ctypes.c_int64 * 4)(*shape.windows),
                window_count=len(shape.windows), vocabulary=self.embed.weight.shape[0], norm_eps=norm.eps,
                gate_limit=gate.limit if gate is not None else 1.0,
                generalist=gate.generalist if gate is not None else 0,
                **{name: None if t is None else t.data_ptr() for name, t in tensors.items()})
        self._native_cache = (key, params, present)  # the tensors kept alive with the pointers
        return params

    def _complementary_parts(self, h: torch.Tensor, keep: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_add_complementary`'s terms for `native_kernels.mixture`: keep · comp input (B, comp_width), Wᵀ
        (comp_width, V), the bias (V,) and keep (B,) (ones without the gate)."""
        h = self._comp_input(h)  # (B, comp_width)
        keep = torch.ones(h.shape[0], device=h.device) if keep is None else keep
        return h * keep[:, None], self.comp.weight.T, self.comp.bias, keep

    def _pull_to_generalist(self, inputs: torch.Tensor, weights: torch.Tensor, allowed: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's pull g (B,) moves weights (E, B) towards the generalist: (1 - g) w + g e_gen, and
        the complementary logit's share (1 - g) (B,)."""
        pull = self.gate.pull(inputs)  # (B,)
        if allowed is not None:  # never pull towards a generalist the request left out
            pull = pull * allowed[self.gate.generalist].to(pull.dtype)
        toward = torch.zeros_like(weights)
        toward[self.gate.generalist] = 1.0
        return (1 - pull) * weights + pull * toward, 1 - pull

    def _add_complementary(self, fused: torch.Tensor, inputs_kept: torch.Tensor, weight_t: torch.Tensor,
                           bias: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """fused + keep · (x Wᵀ + b) as one matrix product accumulated onto fused + keep · b, from
        `_complementary_parts`' terms: the layer's (B, V) output is never a tensor of its own. fused (B, V)."""
        return torch.addmm(torch.addcmul(fused, keep[:, None], bias), inputs_kept, weight_t)

    def lay_out_for_decoding(self) -> Router:
        """Keep the complementary layer's weight (V, comp_width) as the transpose of a contiguous
        (comp_width, V) matrix: the same values (and state dict), but the per-step product h Wᵀ then
        streams Wᵀ row by row, which on a CPU takes about 0.6x the time of the (V, hidden) layout."""
        if self.comp is not None and not self.comp.weight.T.is_contiguous():
            weight = self.comp.weight
            self.comp.weight = nn.Parameter(weight.detach().T.contiguous().T, requires_grad=weight.requires_grad)
        return self


# -- expert fingerprints ------------------------------------------------------------------------
def expert_fingerprint(expert: Any) -> str:
    """Identify an expert by its behaviour: the top ids it predicts on a fixed probe sequence, plus its
    vocabulary. Works the same for local and remote experts."""
    info = expert.info
    probe = [(k * 7919 + 13) % min(info.tokenizer_size, info.vocab_size) for k in range(1, 13)]
    session = f"fingerprint-{uuid.uuid4().hex}"  # never reused: a replica refuses a released session
    with single_team():  # off the compute thread, on this thread alone (fusion.compute)
        try:
            logits = expert.score(session, probe, 6)  # (6, V)
        finally:
            expert.release([session])
        top = logits[:, : info.tokenizer_size].float().topk(3, dim=-1).indices.tolist()
    payload = json.dumps([info.vocab_size, info.tokenizer_fingerprint, top])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# -- checkpoints --------------------------------------------------------------------------------
def save_router(router: Router, path: Path, expert_names: Sequence[str], fingerprints: Sequence[str],
                metadata: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "state_dict": router.state_dict(),
        "shape": asdict(router.shape),
        "experts": list(expert_names),
        "fingerprints": list(fingerprints),
        "metadata": json.dumps(metadata or {}),
        "gate": router.gate.state() if router.gate is not None else None,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    return path


def load_router(path: Path) -> tuple[Router, dict]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"router checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        router = Router(RouterShape(**payload["shape"]))  # older layouts fail on the state dict below
        router.load_state_dict(payload["state_dict"])
        if payload.get("gate") is not None:
            router.gate = FamiliarityGate(**payload["gate"])
    except (RuntimeError, KeyError, TypeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise ConfigError(f"router checkpoint {path} is not readable: {err}".splitlines()[0]) from None
    router.eval()
    return router.lay_out_for_decoding(), payload


def check_experts(payload: dict, experts: Sequence[Any], path: Path | str) -> None:
    """Refuse a router trained with other experts (by count, order and fingerprint). A router shipped with
    the project (identity "config": found by the hash of the config's expert refs, `fusion.models.
    shipped_router`) is checked by names and tokenizers: its experts are files shipped or pinned by hash
    with it, and their behaviour fingerprint may differ in its last bits between CPUs."""
    names = [e.info.name for e in experts]
    if len(payload["fingerprints"]) != len(experts):
        raise ConfigError(
            f"router {path} was trained for {len(payload['fingerprints'])} experts {payload['experts']}, "
            f"the config has {len(experts)} {names}"
        )
    if payload.get("identity") == "config":
        tokenizers = [e.info.tokenizer_fingerprint for e in experts]
        if names != list(payload["experts"]) or tokenizers != list(payload["tokenizers"]):
            raise ConfigError(f"router {path} was shipped for experts {payload['experts']}, not {names}")
        return
    for name, trained, expert in zip(payload["experts"], payload["fingerprints"], experts):
        actual = expert_fingerprint(expert)
        if actual != trained:
            raise ConfigError(
                f"router {path} was trained with other experts: expert {expert.info.name!r} "
                f"(trained as {name!r}) has fingerprint {actual}, the router expects {trained}"
            )


def trained_tau(payload: dict | None) -> float | None:
    """The confidence scaling a router checkpoint was trained under (`RouterTrainSettings.tau`), or None."""
    if payload is None:
        return None
    settings = json.loads(payload.get("metadata") or "{}").get("settings") or {}
    return settings.get("tau")


TRAINED_TAU = object()  # `Route`'s tau when a spec leaves it out: the checkpoint's own

FAIL_SAFE = True  # the default of `route`'s `fail_safe` (FamiliarityGate), chosen on out-of-template figures


class Route(FusionRule):
    """`route`: a learned router picks/weights experts per step and adds a complementary logit.
    Request weights act as a mask: experts with weight 0 are never routed to. `hard` routes each token
    to one expert; `complementary: false` leaves the complementary logit out (pure routing); `fail_safe`
    pulls steps unlike any in training towards the generalist (the router's FamiliarityGate, when its
    checkpoint has one); `tau` scales the router's weights by each expert's confidence, exp(-entropy / tau),
    as rule `confidence` does its fixed weights: left out, the tau the router was trained under (`fusion
    train-router --tau`), if any; None: the router's weights as they are."""

    name = "route"
    # What requests set: `router` is a name the service resolves to `path` (only its config names files).
    param_names = ("router", "hard", "complementary", "fail_safe", "tau")

    def __init__(self, expert_names: Sequence[str], path: str | None = None, hard: bool = False,
                 complementary: bool = True, router: Router | None = None, fail_safe: bool = FAIL_SAFE,
                 tau: float | None | object = TRAINED_TAU) -> None:
        super().__init__(expert_names)
        if tau is not TRAINED_TAU:  # checked before the checkpoint is read
            self.tau = None if tau is None else check_tau(self.name, tau)
        if router is None and not path:
            raise InvalidArgumentError("fusion.params.router: rule 'route' needs a router trained by "
                                       "`fusion train-router`")
        self.path = path
        self.hard = bool(hard)
        self.complementary = bool(complementary)
        self.fail_safe = bool(fail_safe)
        self.router = router
        self._payload = None
        if router is None:
            self.router, self._payload = load_router(Path(path))
        if tau is TRAINED_TAU:  # as recorded: `RouterTrainSettings` checked it
            self.tau = trained_tau(self._payload)
        if self.router.shape.num_experts != len(expert_names):
            raise InvalidArgumentError(
                f"fusion.params.router: the router has {self.router.shape.num_experts} experts, the config "
                f"{len(expert_names)}"
            )

    def bind(self, experts: Sequence[Any]) -> None:
        if self._payload is not None:
            check_experts(self._payload, experts, self.path)

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        if context is None:
            raise ValueError("rule 'route' needs each row's recent token ids")
        with torch.no_grad():
            router = self.router
            if router.embed.weight.device != logits.device:  # `Module.to` walks every parameter (~0.1 ms)
                router = self.router = router.to(logits.device)
            allowed = weights > 0  # (E, B)
            return router.fuse(logits, context, allowed=allowed, hard=self.hard,
                               complementary=self.complementary, fail_safe=self.fail_safe, tau=self.tau)
