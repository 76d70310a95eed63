"""A learned token-level router (FusionRoute style) and the `route` fusion rule.

At every step a light network reads what is known at decode time — each expert's confidence
(entropy, top-1 log-prob, top-1/top-2 margin), how much each expert believes the others' top
choice, an embedding of the previous token, and bags of the recent tokens' embeddings (which tell
arithmetic from code from prose) — and outputs

  * routing weights over the experts `w (E, B)` (softmax), and
  * a complementary logit `c (B, V)` added in log space, which lets the fused distribution reach
    tokens no single expert ranks first (pure routing between fixed experts cannot).

    fused = logsumexp_i(log w_i + log_softmax z_i) + c

The experts are never changed. A checkpoint stores the router's weights, its shape, and the
fingerprints of the experts it was trained with; loading it against other experts is refused.
"""

from __future__ import annotations

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

from fusion.errors import ConfigError
from fusion.rules import CONTEXT_TOKENS, FusedLogits, FusionRule, log_softmax_and_normalizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterShape:
    num_experts: int
    vocab_size: int
    embed_dim: int = 32
    hidden: int = 96
    complementary: bool = True
    windows: tuple[int, ...] = (8, CONTEXT_TOKENS)  # recent-token bags, each the mean over its last w ids

    def __post_init__(self) -> None:
        object.__setattr__(self, "windows", tuple(int(w) for w in self.windows))
        if not self.windows or not all(0 < w <= CONTEXT_TOKENS for w in self.windows):
            raise ValueError(f"router windows must be in [1, {CONTEXT_TOKENS}], got {self.windows}")

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
    entropy = -(probs * log_probs.clamp(min=-1e4)).sum(-1)  # (E, B)
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
        self.comp = nn.Linear(shape.hidden, shape.vocab_size) if shape.complementary else None
        if self.comp is not None:  # start as pure routing; training grows the complementary logit
            nn.init.zeros_(self.comp.weight)
            nn.init.zeros_(self.comp.bias)

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
        route_logits = self.route(h)  # (B, E)
        if allowed is not None:
            route_logits = route_logits.masked_fill(~allowed.T, float("-inf"))
        weights = torch.softmax(route_logits, dim=-1).T  # (E, B)
        comp = self.comp(h) if self.comp is not None else None
        return route_logits, weights, comp

    def fuse(self, logits: torch.Tensor, context: torch.Tensor, allowed: torch.Tensor | None = None,
             hard: bool = False, complementary: bool = True, fail_safe: bool = False) -> FusedLogits:
        log_probs, normalizer = log_softmax_and_normalizer(logits.float())  # (E, B, V), (E, B)
        inputs = self.inputs(log_probs, context)  # (B, F), computed once for the head and the gate
        _, weights, comp = self.head(inputs, allowed)
        if fail_safe and self.gate is not None:
            pull = self.gate.pull(inputs)  # (B,)
            if allowed is not None:  # never pull towards a generalist the request left out
                pull = pull * allowed[self.gate.generalist].to(pull.dtype)
            toward = torch.zeros_like(weights)
            toward[self.gate.generalist] = 1.0
            weights = (1 - pull) * weights + pull * toward  # (E, B)
            comp = comp * (1 - pull)[:, None] if comp is not None else None
        if hard:  # pick one expert per row
            weights = torch.nn.functional.one_hot(weights.argmax(0), weights.shape[0]).T.to(weights.dtype)
        fused = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)  # (B, V)
        if comp is not None and complementary:
            fused = fused + comp
        return FusedLogits(fused, weights, normalizer)


# -- expert fingerprints ------------------------------------------------------------------------
def expert_fingerprint(expert: Any) -> str:
    """Identify an expert by its behaviour: the top ids it predicts on a fixed probe sequence, plus its
    vocabulary. Works the same for local and remote experts."""
    info = expert.info
    probe = [(k * 7919 + 13) % min(info.tokenizer_size, info.vocab_size) for k in range(1, 13)]
    session = f"fingerprint-{uuid.uuid4().hex}"  # never reused: a replica refuses a released session
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
    return router, payload


def check_experts(payload: dict, experts: Sequence[Any], path: Path | str) -> None:
    """Refuse a router trained with other experts (by count, order and fingerprint)."""
    names = [e.info.name for e in experts]
    if len(payload["fingerprints"]) != len(experts):
        raise ConfigError(
            f"router {path} was trained for {len(payload['fingerprints'])} experts {payload['experts']}, "
            f"the config has {len(experts)} {names}"
        )
    for name, trained, expert in zip(payload["experts"], payload["fingerprints"], experts):
        actual = expert_fingerprint(expert)
        if actual != trained:
            raise ConfigError(
                f"router {path} was trained with other experts: expert {expert.info.name!r} "
                f"(trained as {name!r}) has fingerprint {actual}, the router expects {trained}"
            )


FAIL_SAFE = True  # the default of `route`'s `fail_safe` (FamiliarityGate), chosen on out-of-template figures


class Route(FusionRule):
    """`route`: a learned router picks/weights experts per step and adds a complementary logit.
    Request weights act as a mask: experts with weight 0 are never routed to. `hard` routes each token
    to one expert; `complementary: false` leaves the complementary logit out (pure routing); `fail_safe`
    pulls steps unlike any in training towards the generalist (the router's FamiliarityGate, when its
    checkpoint has one)."""

    name = "route"
    # What requests set: `router` is a name the service resolves to `path` (only its config names files).
    param_names = ("router", "hard", "complementary", "fail_safe")

    def __init__(self, expert_names: Sequence[str], path: str | None = None, hard: bool = False,
                 complementary: bool = True, router: Router | None = None, fail_safe: bool = FAIL_SAFE) -> None:
        super().__init__(expert_names)
        if router is None and not path:
            raise ValueError("rule 'route' needs params.router, a router trained by `fusion train-router`")
        self.path = path
        self.hard = bool(hard)
        self.complementary = bool(complementary)
        self.fail_safe = bool(fail_safe)
        self.router = router
        self._payload = None
        if router is None:
            self.router, self._payload = load_router(Path(path))
        if self.router.shape.num_experts != len(expert_names):
            raise ValueError(
                f"rule 'route': the router has {self.router.shape.num_experts} experts, the config "
                f"{len(expert_names)}"
            )

    def bind(self, experts: Sequence[Any]) -> None:
        if self._payload is not None:
            check_experts(self._payload, experts, self.path)

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, context: torch.Tensor | None = None) -> FusedLogits:
        if context is None:
            raise ValueError("rule 'route' needs each row's recent token ids")
        with torch.no_grad():
            router = self.router.to(logits.device)
            return router.fuse(logits, context, allowed=weights > 0, hard=self.hard,
                               complementary=self.complementary, fail_safe=self.fail_safe)
