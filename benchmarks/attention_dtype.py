"""Attention's products in a CPU decode step: float32 (the eager step's choice, `attention_dtype`) against
bf16 (the cache's own dtype), side by side in one run, alternating rounds. First `attend` alone at a
decode step's shapes (SmolLM2: 9 query heads over 3 kv heads of 64) for 1 and 3 rows at several cache
widths; then the default trio's decode step (its three members, one session each) and the base member's
step alone, each with the products in either dtype.

    python benchmarks/attention_dtype.py --json benchmarks/results/bench_attention_dtype.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch


def timed_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    import fusion.forward.ops as ops
    from fusion.config import load_config
    from fusion.models import default_cache_dir
    from fusion.tools.loading import DEFAULT_CONFIG, load_service
    from fusion.tools.step_timing import emit_figures, members_step_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    float32 = ops.attention_dtype
    dtypes = {"float32": float32, "bf16": lambda q: q.dtype}

    def use(name: str) -> None:
        ops.attention_dtype = dtypes[name]

    generator = torch.Generator().manual_seed(0)
    attend_us: dict[str, list[float]] = {}
    for rows in (1, 3):
        for width in (60, 500, 2000):
            q = torch.randn(rows, 9, 64, generator=generator).bfloat16()
            k, v = (torch.randn(rows, 3, 64, generator=generator).bfloat16() for _ in range(2))
            keys, values = (torch.randn(rows, 3, width, 64, generator=generator).bfloat16() for _ in range(2))
            for _ in range(options.rounds):
                for name in dtypes:
                    use(name)
                    attend_us.setdefault(f"{name}_rows{rows}_width{width}", []).append(
                        timed_us(lambda: ops.attend(q, k, v, keys, values, 0.125), 50))

    service = load_service(load_config(DEFAULT_CONFIG), default_cache_dir(), router=False)
    members = service.engine.experts

    def step_ms(which: list[int], session: str) -> float:
        return members_step_ms(members, which, session, options.steps)

    step_rounds: dict[str, list[float]] = {}
    for r in range(options.rounds):
        for name in dtypes:
            use(name)
            step_rounds.setdefault(f"{name}_three_members", []).append(step_ms([0, 1, 2], f"{name}{r}t-"))
            step_rounds.setdefault(f"{name}_base_only", []).append(step_ms([0], f"{name}{r}b-"))
    use("float32")
    attend_median = {k: statistics.median(v) for k, v in attend_us.items()}
    step_median = {k: statistics.median(v) for k, v in step_rounds.items()}
    figures = {
        "host": {"machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": torch.get_num_threads(), "torch": torch.__version__},
        "attend_median_us": attend_median,
        "attend_float32_over_bf16": {k.removeprefix("float32_"): attend_median[k] / attend_median["bf16_" + k[8:]]
                                     for k in attend_median if k.startswith("float32_")},
        "step_rounds_ms": step_rounds, "step_median_ms": step_median,
        "step_float32_over_bf16": {part: step_median[f"float32_{part}"] / step_median[f"bf16_{part}"]
                                   for part in ("three_members", "base_only")},
    }
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
