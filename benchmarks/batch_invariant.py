"""What a prompt costs row by row through the C step (`batch_invariant: true`, and prompts of at most
`c_step_prompt_ids` ids, docs/configuration.md) against transformers' forward: the default trio with every
prompt through the forward (`c_step_prompt_ids: 0`) and the same trio batch-invariant, loaded side by side in
one process, timed in alternating rounds on the compute thread (as the engine steps them):

- a new prompt of N ids for each of the three members at once (through the forward, its three members'
  prompts in one left-padded batch; row by row through the C step for the batch-invariant one), for several
  N: where the ratio crosses 1 is where `c_step_prompt_ids` (3 N ids in all) belongs;
- a decode step of S sessions of each member (3 S rows), which both run through the C step.

Prints the median of each and the ratio row by row / forward.

    python benchmarks/batch_invariant.py --json benchmarks/results/bench_batch_invariant.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    from fusion.compute import run_on_compute_thread
    from fusion.config import load_config
    from fusion.experts.expert import StepRequest
    from fusion.models import default_cache_dir
    from fusion.tools.loading import DEFAULT_CONFIG, load_service
    from fusion.tools.step_timing import emit_figures, members_step_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="16,48,85,128,256,1024", help="prompt lengths in ids")
    parser.add_argument("--sessions", default="1,8", help="sessions of each member in the decode step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    lengths = [int(n) for n in options.lengths.split(",")]
    sessions = [int(n) for n in options.sessions.split(",")]
    config = load_config(DEFAULT_CONFIG)
    variants = {}
    # No kept prefixes: each round's prompts repeat the round before's, and are timed read in full.
    for name, fields in (("forward", {"c_step_prompt_ids": 0, "prefix_cache_tokens": 0}),
                         ("batch_invariant", {"batch_invariant": True, "prefix_cache_tokens": 0})):
        experts = [e.model_copy(update=fields) for e in config.experts]
        service = load_service(config.model_copy(update={"experts": experts}), default_cache_dir(), router=False)
        variants[name] = service.engine.experts

    def prompt_s(members, n: int, tag: str) -> float:
        group = members[0].shared_base
        ids = [100 + (7 * k + 3) % 900 for k in range(n)]
        parts = [(member, [StepRequest(tag, ids)]) for member in members]
        started = time.perf_counter()
        group.step_members(parts)
        elapsed = time.perf_counter() - started
        for member in members:
            member.release([tag])
        return elapsed

    prompts = {name: {n: [] for n in lengths} for name in variants}
    steps = {name: {s: [] for s in sessions} for name in variants}
    for r in range(options.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for n in lengths:
            for name in order:
                prompts[name][n].append(run_on_compute_thread(prompt_s, variants[name], n, f"p{r}-{n}"))
        for s in sessions:
            for name in order:
                steps[name][s].append(members_step_ms(variants[name], [0, 1, 2], f"d{r}-{s}-", options.steps,
                                                      sessions=s))
    median_prompt = {name: {n: statistics.median(v) for n, v in by.items()} for name, by in prompts.items()}
    median_step = {name: {s: statistics.median(v) for s, v in by.items()} for name, by in steps.items()}
    figures = {
        "prompt_s": median_prompt, "decode_step_ms": median_step,
        "prompt_ratio": {n: median_prompt["batch_invariant"][n] / median_prompt["forward"][n] for n in lengths},
        "decode_step_ratio": {s: median_step["batch_invariant"][s] / median_step["forward"][s] for s in sessions},
        "rounds": {"prompt_s": prompts, "decode_step_ms": steps},
    }
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
