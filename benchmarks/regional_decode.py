"""The default trio's decode step, eager (`decode: fast`, the default) against one decoder layer compiled
and reused by every layer (`decode: regional`), side by side in one run, alternating rounds: the three
members' step (one session each) and the base member's step alone, at a short and a longer history. The
regional expert's load reports its compile (or its load from inductor's on-disk cache: `--cold` starts
from an empty one).

    python benchmarks/regional_decode.py --cold --json benchmarks/results/bench_regional_decode.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cold", action="store_true", help="compile from an empty inductor cache")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    if options.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

    import torch

    from fusion.config import load_config
    from fusion.models import default_cache_dir
    from fusion.tools.loading import DEFAULT_CONFIG, load_service
    from fusion.tools.step_timing import emit_figures, members_step_ms

    config = load_config(DEFAULT_CONFIG)
    groups, load_s = {}, {}
    for decode in ("fast", "regional"):
        started = time.perf_counter()
        variant = config.model_copy(update={"experts": [e.model_copy(update={"decode": decode}) for e in config.experts]})
        groups[decode] = load_service(variant, default_cache_dir(), router=False).engine.experts
        load_s[decode] = time.perf_counter() - started

    rounds: dict[str, list[float]] = {}
    for r in range(options.rounds):
        for decode, members in groups.items():
            for history_len in (60, 600):
                for part, which in (("three_members", [0, 1, 2]), ("base_only", [0])):
                    rounds.setdefault(f"{decode}_{part}_history{history_len}", []).append(
                        members_step_ms(members, which, f"{decode}{r}{part}{history_len}-", options.steps,
                                        history_len))
    median = {k: statistics.median(v) for k, v in rounds.items()}
    figures = {
        "host": {"machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": torch.get_num_threads(), "torch": torch.__version__},
        "cold_inductor_cache": options.cold,
        "load_s": load_s,
        "rounds_ms": rounds, "median_ms": median,
        "regional_over_fast": {k.removeprefix("regional_"): median[k] / median["fast_" + k.removeprefix("regional_")]
                               for k in median if k.startswith("regional_")},
        "three_members_over_base_only": {k.replace("_three_members", ""): median[k] / median[k.replace("three_members", "base_only")]
                                         for k in median if "three_members" in k},
    }
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
