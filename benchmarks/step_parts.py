"""Where a decode step's time goes, inside the C step's layers and around them, for the default trio's shared
base stepping

- `base`: the base member alone, one session (one row);
- `base_3_rows`: the base member with three sessions (three rows, no adapters);
- `trio`: the three members, one session each (three rows, two of them with adapters), as the engine steps
  the default trio.

The kernels are built with -DFUSION_STEP_CLOCKS (a library file of their own, beside the usual one), which
clocks each phase of the layers (`fusion_step_clocks` in fusion/forward/kernels/decoder_step.c). Around the call,
the head (`FastDecoder._head`) and the layers' call from Python (`NativeLayers.run`) are timed too; what
remains of the step (embedding, the rotary table, sessions and caches, Python) is the step's time less both.
Over 4-bit weights a projection's adapter deltas run inside its product (decoder_step.c's `project`), so the
`adapters` phase is then part of `products`; `extra_ms.adapters` (the trio less the base's three rows) still
says what they cost.
The cases alternate over rounds on the compute thread; the figures are medians over rounds, in ms per step.

    python benchmarks/step_parts.py [--rounds 5] [--steps 20] [--history 60] [--sessions 1] [--json benchmarks/results/bench_step_parts.json]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
from pathlib import Path

PHASES = ("norms", "products", "adapters", "rotary_kv", "attention", "activation", "residual", "setup")
CASES = {"base": ([0], 1), "base_3_rows": ([0], 3), "trio": ([0, 1, 2], 1)}


def main() -> None:
    from fusion.forward import native_kernels
    # Before anything loads the library: the clocked build is a file of its own (FLAGS are in its name's hash).
    native_kernels.FLAGS = (*native_kernels.FLAGS, "-DFUSION_STEP_CLOCKS")
    native_kernels.library.cache_clear()

    from fusion.forward.llama import FastDecoder
    from fusion.models import default_cache_dir
    from fusion.forward.native_step import NativeLayers
    from fusion.tools.loading import read_config, load_service
    from fusion.tools.step_timing import Timings, emit_figures, members_step_ms, wrap

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--history", type=int, default=60, help="ids each session holds before the timed steps")
    parser.add_argument("--sessions", type=int, default=1,
                        help="above 1, a fourth case: the trio with this many sessions a member")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()

    library = native_kernels.library()
    if library is None or library.fusion_step_clocks(None, 0) == 0:
        raise SystemExit("the clocked kernels could not be built (a C compiler with OpenMP is needed)")
    clocks = (ctypes.c_double * len(PHASES))()
    service = load_service(read_config(None), default_cache_dir(), router=False)
    members = service.engine.experts
    calls: Timings = collections.defaultdict(list)
    wrap(FastDecoder, "_head", "head", calls)
    wrap(NativeLayers, "run", "layers_call", calls)

    def clear() -> None:
        library.fusion_step_clocks(clocks, len(PHASES))
        calls.clear()

    cases = dict(CASES)
    if options.sessions > 1:
        cases[f"trio_{options.sessions}_sessions"] = ([0, 1, 2], options.sessions)
    rounds: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    for r in range(options.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for case in order:
            which, sessions = cases[case]
            step_ms = members_step_ms(members, which, f"parts{r}-{case}-", options.steps, options.history,
                                      sessions=sessions, on_start=clear)
            library.fusion_step_clocks(clocks, len(PHASES))
            per_step = 1e3 / options.steps
            parts = {phase: clocks[i] * per_step for i, phase in enumerate(PHASES)}
            parts["layers_call"] = sum(calls["layers_call"]) / options.steps
            parts["layers_call_outside_phases"] = parts["layers_call"] - sum(parts[phase] for phase in PHASES)
            parts["head"] = sum(calls["head"]) / options.steps
            parts["around"] = step_ms - parts["layers_call"] - parts["head"]
            parts["step"] = step_ms
            rounds[case].append(parts)
    medians = {case: {part: statistics.median(r[part] for r in runs) for part in runs[0]}
               for case, runs in rounds.items()}
    figures = {
        "ms_per_step": medians,
        "trio_over_base": medians["trio"]["step"] / medians["base"]["step"],
        "extra_ms": {
            "two_more_rows": {p: medians["base_3_rows"][p] - medians["base"][p] for p in medians["base"]},
            "adapters": {p: medians["trio"][p] - medians["base_3_rows"][p] for p in medians["base"]},
        },
        "history": options.history, "steps": options.steps, "sessions": options.sessions, "rounds": rounds,
    }
    service.close()
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
