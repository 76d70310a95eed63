"""The default trio's decode step with this tree's kernels against another revision's, side by side in one
process: the same loaded experts and caches, only the C step's library swapped between the two builds round
by round (`NativeLayers.library`: the layer table's layout must be the same in both revisions), the steps on
the compute thread as the engine runs them.

Checks first that both builds give the same logits bit for bit (a prompt of 60 ids row by row, then decode
steps, for the base member alone and for the trio), then prints the median milliseconds per step of each
case (the base member alone: one row; the trio: three rows, two with adapters) and the ratio this tree / the
other revision. Where `benchmarks/kernel_builds.py` times the products alone, this times everything the
C step does (the adapters, attention, the activations) and what the step does around it.

    python benchmarks/step_builds.py --before HEAD~1 [--rounds 7] [--steps 20] [--history 60] [--json benchmarks/results/bench_step_builds.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from kernel_builds import REPO, build, checkout_kernels

CASES = {"base": [0], "trio": [0, 1, 2]}


def main() -> None:
    from fusion.forward import native_kernels
    from fusion.compute import run_on_compute_thread
    from fusion.experts.expert import StepRequest
    from fusion.tools.loading import cache_dir, load_service, read_config
    from fusion.tools.step_timing import emit_figures, members_step_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="the git revision to compare this tree's kernels with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--history", type=int, default=60, help="ids each session holds before the timed steps")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="step-builds-"))
    (scratch / "before").mkdir()
    libraries = {"before": build(checkout_kernels(options.before, scratch / "before"), scratch / "before.so"),
                 "after": build(REPO / "fusion" / "kernels", scratch / "after.so")}
    for library in libraries.values():
        native_kernels.declare(library)
    service = load_service(read_config(None), cache_dir(None), router=False)
    members = service.engine.experts
    group = members[0].shared_base
    group.prefixes = None  # every prompt computed, by the build under test
    native = run_on_compute_thread(group._fast_step.decoder._native_step)
    if not native:
        raise SystemExit("the default trio's layers do not run in the C step here: nothing to compare")

    def use(name: str) -> None:
        native.library = libraries[name]

    def logits_of(name: str) -> list[torch.Tensor]:
        use(name)
        history = [100 + (7 * k) % 900 for k in range(60)]
        out = []
        for which in CASES.values():
            session = f"check-{name}-{len(which)}"
            for _ in range(3):
                parts = [(members[m], [StepRequest(session, history)]) for m in which]
                logits = run_on_compute_thread(group.step_members, parts)
                out += logits
                history = history + [int(logits[0][0].argmax())]
            for m in which:
                members[m].release([session])
        return out

    def compare() -> tuple[bool, float]:
        before, after = logits_of("before"), logits_of("after")
        return (all(torch.equal(a, b) for a, b in zip(before, after)),
                max(float((a - b).abs().max()) for a, b in zip(before, after)))

    # On the compute thread, as everything else: torch work on this thread would start a second OpenMP team,
    # whose threads then contend with the compute thread's for the cores through every timed step.
    same, largest = run_on_compute_thread(compare)
    print(f"same logits bit for bit: {same} (largest difference {largest:.3g})")

    times = {name: {case: [] for case in CASES} for name in libraries}
    for r in range(options.rounds):
        order = list(libraries) if r % 2 == 0 else list(reversed(libraries))
        for case, which in CASES.items():
            for name in order:
                use(name)
                times[name][case].append(members_step_ms(members, which, f"{name}-{case}-{r}-", options.steps,
                                                               history_len=options.history))
    medians = {name: {case: statistics.median(v) for case, v in by.items()} for name, by in times.items()}
    figures = {
        "before": options.before, "same_bits": same, "largest_difference": largest,
        "ms_per_step": medians,
        "after_over_before": {case: medians["after"][case] / medians["before"][case] for case in CASES},
        "trio_over_base": {name: medians[name]["trio"] / medians[name]["base"] for name in libraries},
        "rounds": times, "steps": options.steps, "history": options.history,
    }
    service.close()
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
