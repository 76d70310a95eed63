"""Where a decode step's fusion + sampling time goes, part by part, on a config's experts.

The engine decodes one request step by step (as `fusion bench --suites step` does) with timers
wrapped around each part of the fusion and sampling path; SmolLM2's (the first expert's) plain decode
forward is timed in alternating rounds, so every part is also given as a share of one forward:

    finiteness check      FusionEngine.check_finite: one amax over the (E, B, V) logits
    rule (engine side)    DecodeBatch._fuse less the rule: weights, context rows, grouping
    router features       logit_statistics: entropy, top-1, margin, agreement and the normalizers
    context features      Router.context_features: previous-token and window embeddings
    familiarity gate      Router._pull_to_generalist
    complementary logit   Router._add_complementary: the (hidden, V) product onto the fused scores
    router head and pick  the rest of Route.fuse: the body, route weights, the hard pick
    sampling metadata     SamplingMetadata.build
    sampler               fusion.fuse.sampler.sample
    attribution, lists    the rest of the engine's sampling: attribution, results to host lists

    .venv/bin/python benchmarks/fusion_parts.py [--config F] [--cache DIR] [--steps 24] [--rounds 4]
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
from pathlib import Path
from typing import Callable

from fusion.engine import batch as decode_batch_module
from fusion.fuse import router as router_module
from fusion.engine.batch import DecodeBatch
from fusion.engine.core import FusionEngine
from fusion.fuse.sampler import SamplingMetadata
from fusion.tools.bench import _prompt_ids, plain_forward_ms, warm_decode_batch
from fusion.tools.loading import cache_dir, load_service, read_config
from fusion.tools.step_timing import Timings, wrap

logger = logging.getLogger("fusion_parts")


def instrument(timings: Timings) -> list[Callable[[], None]]:
    """Wrap each part's function with a timer."""
    targets = [
        (FusionEngine, "check_finite", "finiteness check"),
        (DecodeBatch, "_fuse", "_fuse"),
        (router_module.Route, "fuse", "router.fuse"),
        (SamplingMetadata, "build", "sampling metadata"),
        (decode_batch_module, "sample", "sampler"),
        (DecodeBatch, "_sample", "_sample"),
        (router_module, "logit_statistics", "router features"),
        (router_module.Router, "context_features", "context features"),
        (router_module.Router, "_pull_to_generalist", "familiarity gate"),
        (router_module.Router, "_add_complementary", "complementary logit"),
    ]
    return [wrap(owner, name, label, timings) for owner, name, label in targets]


def decode_steps(service, rule, weights, steps: int, timings: Timings, totals: list[float], rows: int = 1) -> None:
    engine = service.engine
    batch = warm_decode_batch(service, steps, rule, weights, rows)
    for values in timings.values():
        values.clear()
    for _ in range(steps):
        batch.step()
        totals.append(engine.last_timings.fuse_sample_s * 1e3)
    batch.cancel_all()


def step_parts(timings: Timings) -> dict[str, float]:
    """Mean ms per step of each part, the nested ones taken out of their callers."""
    mean = collections.defaultdict(float, {label: statistics.mean(values) for label, values in timings.items() if values})
    router_parts = ("router features", "context features", "familiarity gate", "complementary logit")
    parts = {"finiteness check": mean["finiteness check"],
             "rule (engine side)": mean["_fuse"] - mean["router.fuse"]}
    parts.update({label: mean[label] for label in router_parts})
    parts["router head and pick"] = mean["router.fuse"] - sum(mean[label] for label in router_parts)
    parts["sampling metadata"] = mean["sampling metadata"]
    parts["sampler"] = mean["sampler"]
    parts["attribution, lists"] = mean["_sample"] - mean["sampling metadata"] - mean["sampler"]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1, help="requests decoded together (the batch's rows)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    service = load_service(read_config(args.config), cache_dir(args.cache))
    rule, weights = service.resolve_spec(None)
    first = service.engine.experts[0]
    prompt = _prompt_ids(service)[0]
    timings: Timings = collections.defaultdict(list)
    undo = instrument(timings)
    per_round: list[dict[str, float]] = []
    forwards, totals = [], []
    try:
        for r in range(args.rounds):
            forwards.append(plain_forward_ms(first, prompt, args.steps))
            round_totals: list[float] = []
            decode_steps(service, rule, weights, args.steps, timings, round_totals, args.rows)
            totals.append(statistics.mean(round_totals))
            per_round.append(step_parts(timings))
            logger.info("round %d/%d: forward %.1f ms, fusion + sampling %.2f ms", r + 1, args.rounds,
                        forwards[-1], totals[-1])
    finally:
        for restore in undo:
            restore()
        service.close()
    forward = statistics.median(forwards)
    print(f"rule {rule.name} ({args.rows} row(s)), vocabulary {service.engine.vocab_size}; "
          f"{first.info.name}'s plain forward {forward:.1f} ms (median of {args.rounds} rounds)")
    print(f"{'part':24s} {'ms / step':>10s} {'/ forward':>10s}")
    for label in per_round[0]:
        ms = statistics.median(p[label] for p in per_round)
        print(f"{label:24s} {ms:10.3f} {ms / forward:10.4f}")
    total = statistics.median(totals)
    print(f"{'fusion + sampling':24s} {total:10.3f} {total / forward:10.4f}   (the engine's fuse_sample_s)")


if __name__ == "__main__":
    main()
