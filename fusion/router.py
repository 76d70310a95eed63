"""A learned token-level router (FusionRoute style) and the `route` fusion rule.

At every step a light network reads what is known at decode time — each expert's confidence
(entropy, top-1 log-prob, top-1/top-2 margin), how much each expert believes the others' top
choice, and an embedding of the previous token — and outputs

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from fusion.errors import ConfigError
from fusion.rules import FusedLogits, FusionRule, register_rule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterShape:
    num_experts: int
    vocab_size: int
    embed_dim: int = 32
    hidden: int = 64
    complementary: bool = True

    @property
    def num_features(self) -> int:
        return 3 * self.num_experts + self.num_experts**2


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


class Router(nn.Module):
    def __init__(self, shape: RouterShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.embed_dim)
        self.body = nn.Sequential(
            nn.Linear(shape.num_features + shape.embed_dim, shape.hidden), nn.GELU(),
            nn.Linear(shape.hidden, shape.hidden), nn.GELU(),
        )
        self.route = nn.Linear(shape.hidden, shape.num_experts)
        self.comp = nn.Linear(shape.hidden, shape.vocab_size) if shape.complementary else None
        if self.comp is not None:  # start as pure routing; training grows the complementary logit
            nn.init.zeros_(self.comp.weight)
            nn.init.zeros_(self.comp.bias)

    def forward(
        self, log_probs: torch.Tensor, prev_ids: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """log_probs (E, B, V), prev_ids (B,), allowed (E, B) bool → route logits (B, E),
        weights (E, B), complementary logit (B, V) or None."""
        feats = logit_features(log_probs)
        h = self.body(torch.cat([feats, self.embed(prev_ids)], dim=-1))  # (B, hidden)
        route_logits = self.route(h)  # (B, E)
        if allowed is not None:
            route_logits = route_logits.masked_fill(~allowed.T, float("-inf"))
        weights = torch.softmax(route_logits, dim=-1).T  # (E, B)
        comp = self.comp(h) if self.comp is not None else None
        return route_logits, weights, comp

    def fuse(self, logits: torch.Tensor, prev_ids: torch.Tensor, allowed: torch.Tensor | None = None,
             hard: bool = False) -> FusedLogits:
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # (E, B, V)
        _, weights, comp = self(log_probs, prev_ids, allowed)
        if hard:  # pick one expert per row
            weights = torch.nn.functional.one_hot(weights.argmax(0), weights.shape[0]).T.to(weights.dtype)
        fused = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)  # (B, V)
        if comp is not None:
            fused = fused + comp
        return FusedLogits(fused, weights)


# -- expert fingerprints ------------------------------------------------------------------------
def expert_fingerprint(expert: Any) -> str:
    """Identify an expert by its behaviour: the top ids it predicts on a fixed probe sequence, plus its
    vocabulary. Works the same for local and remote experts."""
    info = expert.info
    probe = [(k * 7919 + 13) % min(info.tokenizer_size, info.vocab_size) for k in range(1, 13)]
    session = f"fingerprint-{id(expert)}"
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
        router = Router(RouterShape(**payload["shape"]))
        router.load_state_dict(payload["state_dict"])
    except (RuntimeError, KeyError, TypeError, EOFError, ValueError) as err:
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


class Route(FusionRule):
    """`route`: a learned router picks/weights experts per step and adds a complementary logit.
    Request weights act as a mask: experts with weight 0 are never routed to."""

    name = "route"
    param_names = ("path", "hard")

    def __init__(self, expert_names: Sequence[str], path: str | None = None, hard: bool = False,
                 router: Router | None = None) -> None:
        super().__init__(expert_names)
        if router is None and not path:
            raise ValueError("rule 'route' needs params.path, a router checkpoint from `fusion train-router`")
        self.path = path
        self.hard = bool(hard)
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

    def fuse(self, logits: torch.Tensor, weights: torch.Tensor, prev_ids: torch.Tensor | None = None) -> FusedLogits:
        if prev_ids is None:
            raise ValueError("rule 'route' needs the previous token ids")
        with torch.no_grad():
            router = self.router.to(logits.device)
            return router.fuse(logits, prev_ids, allowed=weights > 0, hard=self.hard)


register_rule(Route.name, Route)
