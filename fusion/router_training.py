"""Train a router on logged expert outputs (the experts are frozen and never touched).

For each training text the experts' teacher-forced logits are computed once through the engine
(so local and remote experts both work), then the router takes a few optimiser steps on them:

    loss = CE(fused distribution, reference next token)
         + route_weight · CE(route logits, best expert)   only where the experts' top-1 choices differ

"Best expert" is the one giving the reference token the highest probability, as FusionRoute does.
The training mix draws from each domain's training split; evaluation texts are held out.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from fusion.pipeline import FusionPipeline
from fusion.router import Router, RouterShape, expert_fingerprint, save_router

logger = logging.getLogger(__name__)


@dataclass
class RouterTrainSettings:
    minutes: float = 5.0
    max_texts: int | None = None
    steps_per_text: int = 2
    lr: float = 3e-3
    route_weight: float = 0.5
    seq_tokens: int = 192
    seed: int = 0


@dataclass
class RouterTrainResult:
    path: Path
    texts: int
    steps: int
    first_loss: float
    last_loss: float
    seconds: float


def router_loss(router: Router, logits: torch.Tensor, prev_ids: torch.Tensor, targets: torch.Tensor,
                route_weight: float) -> torch.Tensor:
    """logits (E, n, V) of the frozen experts, prev_ids (n,), targets (n,) → scalar loss."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (E, n, V)
    route_logits, weights, comp = router(log_probs, prev_ids)
    fused = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)  # (n, V)
    if comp is not None:
        fused = fused + comp
    loss = torch.nn.functional.cross_entropy(fused, targets)
    top1 = log_probs.argmax(-1)  # (E, n)
    disagree = (top1 != top1[:1]).any(0)  # (n,)
    if route_weight > 0 and bool(disagree.any()):
        best = log_probs.gather(-1, targets[None, :, None].expand(log_probs.shape[0], -1, 1))[..., 0].argmax(0)
        loss = loss + route_weight * torch.nn.functional.cross_entropy(route_logits[disagree], best[disagree])
    return loss


def default_training_texts(seed: int) -> Iterator[str]:
    """An endless shuffled mix of the training splits: arithmetic transcripts, Python source,
    and English prose (the standard library's pydoc topics)."""
    import pydoc_data.topics as topics

    from fusion.training.arithmetic import answer_text, question_text, training_problem
    from fusion.training.python_code import stdlib_files

    rng = random.Random(f"router:{seed}")
    code_files = stdlib_files(held_out=False)
    prose = [t for t in topics.topics.values() if len(t) > 400]

    def arithmetic() -> str:
        lines = []
        for _ in range(6):
            p = training_problem(rng)
            lines.append(f"{question_text(p, rng)}\n{answer_text(p)}")
        return "\n".join(lines)

    def code() -> str:
        text = rng.choice(code_files).read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(max(1, len(text) - 1500))
        return text[start:start + 1500]

    def general() -> str:
        text = rng.choice(prose)
        start = rng.randrange(max(1, len(text) - 1500))
        return text[start:start + 1500]

    sources = [arithmetic, code, general]
    while True:
        yield sources[rng.randrange(len(sources))]()


def train_router(
    pipeline: FusionPipeline,
    out: Path,
    *,
    texts: Iterator[str] | None = None,
    settings: RouterTrainSettings | None = None,
    shape: RouterShape | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> RouterTrainResult:
    settings = settings or RouterTrainSettings()
    engine = pipeline.engine
    torch.manual_seed(settings.seed)
    shape = shape or RouterShape(num_experts=len(engine.experts), vocab_size=engine.vocab_size)
    router = Router(shape)
    optimiser = torch.optim.AdamW(router.parameters(), lr=settings.lr, weight_decay=0.0)
    texts = texts or default_training_texts(settings.seed)
    tokenizer = pipeline.tokenizers[0]
    start = time.perf_counter()
    deadline = start + settings.minutes * 60
    n_texts = steps = 0
    first_loss = last_loss = math.nan
    ema = None
    while time.perf_counter() < deadline and (settings.max_texts is None or n_texts < settings.max_texts):
        ids = tokenizer(next(texts), add_special_tokens=False)["input_ids"][: settings.seq_tokens + 1]
        if len(ids) < 8:
            continue
        prompt, continuation = ids[:1], ids[1:]
        with torch.no_grad():
            logits = engine.continuation_logits([prompt] * len(engine.experts), continuation)  # (E, n, V)
        prev = torch.tensor(ids[:-1], device=logits.device)
        targets = torch.tensor(continuation, device=logits.device)
        router.train()
        for _ in range(settings.steps_per_text):
            loss = router_loss(router, logits, prev, targets, settings.route_weight)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(router.parameters(), 1.0)
            optimiser.step()
            steps += 1
            value = float(loss.detach())
            first_loss = value if math.isnan(first_loss) else first_loss
            last_loss = value
            ema = value if ema is None else 0.9 * ema + 0.1 * value
            if on_step:
                on_step(steps, value)
        n_texts += 1
        if n_texts % 10 == 0:
            logger.info("router: %d texts, %d steps, loss %.3f (ema %.3f), %.0f s", n_texts, steps, last_loss, ema,
                        time.perf_counter() - start)
    router.eval()
    fingerprints = [expert_fingerprint(e) for e in engine.experts]
    seconds = time.perf_counter() - start
    save_router(router, out, engine.names, fingerprints, {
        "texts": n_texts, "steps": steps, "first_loss": first_loss, "last_loss": last_loss, "seconds": seconds,
        "seed": settings.seed,
    })
    logger.info("router saved to %s (%d texts, %d steps, loss %.3f → %.3f)", out, n_texts, steps, first_loss,
                last_loss)
    return RouterTrainResult(Path(out), n_texts, steps, first_loss, last_loss, seconds)
