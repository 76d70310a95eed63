"""The default trio's decode step against the base's own, with the weights in the host's caches and with them
read from memory: whether three rows over one base cost about one row depends on which bounds a step.

A one-row step reads every weight once and computes little with each byte; three rows compute three times
as much with the same bytes. Where the weights come from memory (a host whose last-level cache is smaller
than the model, or one whose cache other work fills between steps), the reads bound both and three rows
cost little more than one; where the whole model sits in the cache, the reads are fast and the extra rows'
arithmetic shows. Each case runs both ways in alternating rounds on the compute thread: "warm" steps back
to back, "cold" steps each after a read of a buffer larger than the cache (`--evict-mb`, not timed), which
leaves the step to read its weights from memory. Figures: median ms per step over rounds, and trio / base.

    python benchmarks/cold_cache_steps.py [--rounds 5] [--steps 12] [--evict-mb 1024] [--json benchmarks/results/bench_cold_cache_steps.json]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

CASES = {"base": [0], "trio": [0, 1, 2]}


def main() -> None:
    from fusion.compute import run_on_compute_thread
    from fusion.tools.loading import cache_dir, load_service, read_config
    from fusion.tools.step_timing import emit_figures, members_step_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--evict-mb", type=int, default=1024, help="the buffer read between cold steps (MB)")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()

    service = load_service(read_config(None), cache_dir(None), router=False)
    members = service.engine.experts
    # int32 so that the sum walks every byte; made on the compute thread, whose OpenMP team reads it
    buffer = run_on_compute_thread(torch.ones, options.evict_mb * 2**20 // 4, dtype=torch.int32)

    def evict() -> None:
        int(buffer.sum())

    rounds: dict[str, list[float]] = {f"{case}_{mode}": [] for case in CASES for mode in ("warm", "cold")}
    for r in range(options.rounds):
        for mode in ("warm", "cold") if r % 2 == 0 else ("cold", "warm"):
            for case, which in CASES.items():
                rounds[f"{case}_{mode}"].append(members_step_ms(
                    members, which, f"{case}-{mode}-{r}-", options.steps, warm_steps=2,
                    before_each=evict if mode == "cold" else None))
    ms = {key: statistics.median(values) for key, values in rounds.items()}
    figures = {"ms_per_step": ms,
               "trio_over_base": {mode: ms[f"trio_{mode}"] / ms[f"base_{mode}"] for mode in ("warm", "cold")},
               "evict_mb": options.evict_mb, "steps": options.steps, "rounds": rounds}
    emit_figures(figures, options.json)
    service.close()


if __name__ == "__main__":
    main()
