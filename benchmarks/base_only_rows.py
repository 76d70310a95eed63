"""A decode step whose rows run no adapter (the default trio's base member alone: the `general`
profile, a single-expert request) through the shared base: the adapters' products skipped (as the
runtime does) against computed with zero deltas (forced), and the three members' step, in
alternating rounds of 20 steps each, one session each.

    python benchmarks/base_only_rows.py --json benchmarks/results/bench_base_only_rows.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def main() -> None:
    from fusion.config import load_config
    from fusion.models import default_cache_dir
    from fusion.experts.multi_lora import AdapterRows
    from fusion.tools.loading import DEFAULT_CONFIG, load_service
    from fusion.tools.step_timing import emit_figures, members_step_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    service = load_service(load_config(DEFAULT_CONFIG), default_cache_dir(), router=False)
    members = service.engine.experts
    skipping = AdapterRows.set

    def computing(self, rows):  # as before the skip: every row's adapter products, zero or not
        skipping(self, rows)
        self.any_adapter = True

    def step_ms(which: list[int], session: str) -> float:
        return members_step_ms(members, which, session, options.steps)

    rounds: dict[str, list[float]] = {"base_only_skipped": [], "base_only_computed": [], "three_members": []}
    for r in range(options.rounds):
        rounds["base_only_skipped"].append(step_ms([0], f"skip{r}-"))
        AdapterRows.set = computing
        rounds["base_only_computed"].append(step_ms([0], f"compute{r}-"))
        AdapterRows.set = skipping
        rounds["three_members"].append(step_ms([0, 1, 2], f"trio{r}-"))
    median = {k: statistics.median(v) for k, v in rounds.items()}
    figures = {"rounds_ms": rounds, "median_ms": median,
               "skipped_over_computed": median["base_only_skipped"] / median["base_only_computed"]}
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
