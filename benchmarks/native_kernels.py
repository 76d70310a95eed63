"""The default trio's decode step with torch's quantized kernels against the project's own
(fusion/forward/native_kernels.py), side by side in one run, alternating rounds: the three members' step (one
session each) and the base member's step alone, at a short and a longer history, eager (`decode: fast`).
The eager step with the project's kernels runs twice: its layers in the C step (`fast_native`, fusion/forward/native_step.py, the default) and as torch
operators calling the kernels one product at a time (`fast_native_ops`).

    python benchmarks/native_kernels.py --json benchmarks/results/bench_native_kernels.json
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()

    import torch

    import fusion.forward.quantized as quantized
    from fusion.config import load_config
    from fusion.models import default_cache_dir
    from fusion.tools.loading import DEFAULT_CONFIG, load_service
    from fusion.tools.step_timing import emit_figures, members_step_ms

    @contextlib.contextmanager
    def kernel(name: str):
        """Projections quantized inside use `name`'s layout and kernel (it is fixed at load)."""
        saved = quantized.default_kernel
        quantized.default_kernel = lambda: name
        try:
            yield
        finally:
            quantized.default_kernel = saved

    config = load_config(DEFAULT_CONFIG)
    groups, load_s = {}, {}
    for decode in ("fast",):
        for name in quantized.KERNELS:
            started = time.perf_counter()
            variant = config.model_copy(update={"experts": [e.model_copy(update={"decode": decode})
                                                            for e in config.experts]})
            with kernel(name):
                experts = load_service(variant, default_cache_dir(), router=False).engine.experts
            assert experts[0].shared_base.model.model.layers[0].mlp.down_proj.base.kernel == name
            groups[f"{decode}_{name}"] = experts
            load_s[f"{decode}_{name}"] = time.perf_counter() - started

    groups["fast_native_ops"] = groups["fast_native"]  # the same experts, their layers as torch operators

    def use_c_step(members, on: bool) -> None:
        members[0].shared_base._fast_step.decoder.native_layers = on

    rounds: dict[str, list[float]] = {}
    for r in range(options.rounds):
        for variant, members in groups.items():
            if variant.startswith("fast_native"):
                use_c_step(members, variant == "fast_native")
            for history_len in (60, 600):
                for part, which in (("three_members", [0, 1, 2]), ("base_only", [0])):
                    rounds.setdefault(f"{variant}_{part}_history{history_len}", []).append(
                        members_step_ms(members, which, f"{variant}{r}{part}{history_len}-", options.steps,
                                        history_len))
    median = {k: statistics.median(v) for k, v in rounds.items()}
    figures = {
        "host": {"machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": torch.get_num_threads(), "torch": torch.__version__},
        "load_s": load_s,
        "rounds_ms": rounds, "median_ms": median,
        "native_over_torch": {k.replace("_native", ""): median[k] / median[k.replace("_native", "_torch")]
                              for k in median if "_native_" in k and "_ops_" not in k},
        "c_step_over_native_ops": {k.replace("_native", ""): median[k] / median[k.replace("_native", "_native_ops")]
                                   for k in median if k.startswith("fast_native_") and "_ops_" not in k},
        "three_members_over_base_only": {k.replace("_three_members", ""): median[k] / median[k.replace("three_members", "base_only")]
                                         for k in median if "three_members" in k},
    }
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
