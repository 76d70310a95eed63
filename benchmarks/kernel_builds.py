"""The project's quantized products, this tree's kernels against another revision's, side by side in one
process on the default trio's real weights: every 4-bit projection of SmolLM2's layers (120, one pass reads
their 66 MB of codes from memory, as a decode step does) and the 8-bit output head, at 1 and 3 rows by default
(one session of the base alone; the trio's three members), in alternating rounds on the compute thread.

Checks first that both builds give the same bits on each kind of weight (a kernel change that keeps each
output's arithmetic and its order must; with --bits-may-differ, reports how far apart they are), then prints the median milliseconds of each and the ratio
this tree / the other revision.

    python benchmarks/kernel_builds.py --before HEAD~1 [--rows 1,3] [--rounds 9] [--json benchmarks/results/bench_kernel_builds.json]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def build(kernels: Path, target: Path) -> ctypes.CDLL:
    from fusion.forward import native_kernels
    subprocess.run(["gcc", *native_kernels.FLAGS, str(kernels / "library.c"), "-o", str(target), "-lm"], check=True)
    library = ctypes.CDLL(str(target))
    native_kernels.declare_products(library)
    return library


def checkout_kernels(revision: str, into: Path) -> Path:
    """fusion/forward/kernels/*.c as of `revision`, written under `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:fusion/kernels"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        source = subprocess.run(["git", "show", f"{revision}:fusion/forward/kernels/{name}"], cwd=REPO, check=True,
                                capture_output=True).stdout
        (into / name).write_bytes(source)
    return into


def main() -> None:
    from fusion.compute import run_on_compute_thread
    from fusion.forward.llama import FastDecoder
    from fusion.tools.loading import cache_dir, load_service, read_config
    from fusion.tools.step_timing import emit_figures

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="the git revision to compare this tree's kernels with")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", default="1,3", help="row counts (49: a prompt of 49 ids)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--bits-may-differ", action="store_true",
                        help="a change that reorders a product's sums: report how far the builds' outputs lie "
                             "apart (largest difference over the largest output) instead of requiring the same bits")
    options = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="kernel-builds-"))
    (scratch / "before").mkdir()
    libraries = {"before": build(checkout_kernels(options.before, scratch / "before"), scratch / "before.so"),
                 "after": build(REPO / "fusion" / "kernels", scratch / "after.so")}
    service = load_service(read_config(None), cache_dir(None), router=False)
    decoder = service.engine.experts[0].shared_base._fast_step.decoder
    if not isinstance(decoder, FastDecoder):
        raise SystemExit("the default trio's decode step is not the fast one: nothing to compare")
    projections = [getattr(block, name) for block in decoder.blocks for name in ("qkv", "o_proj", "gate_up", "down")]
    head = decoder.lm_head
    weights = {"int4": [(p.in_features, p.out_features, p.nibbles, p.scale_bias) for p in projections],
               "int8": [(head.in_features, head.out_features, head.codes, head.scales)]}
    cases = [(kind, rows) for kind in weights for rows in map(int, options.rows.split(","))]
    generator = torch.Generator().manual_seed(0)

    def calls(library: ctypes.CDLL, kind: str, rows: int, outputs: list[torch.Tensor]) -> list[tuple]:
        function = library.fusion_int4_mm if kind == "int4" else library.fusion_int8_mm
        return [(function, (x.data_ptr(), rows, k, codes.data_ptr(), params.data_ptr(), n, out.data_ptr(), 0,
                            torch.get_num_threads()))
                for (k, n, codes, params), x, out in zip(weights[kind], inputs[kind, rows], outputs)]

    # Everything on the compute thread: a second thread's OpenMP team would slow every parallel region.
    def prepare() -> dict[str, float]:
        apart = {}
        for kind, rows in cases:
            inputs[kind, rows] = [torch.randn(rows, k, generator=generator) for k, _, _, _ in weights[kind]]
        for kind, rows in cases:
            results = {}
            for name, library in libraries.items():
                outputs = [torch.empty(rows, n) for _, n, _, _ in weights[kind]]
                for function, arguments in calls(library, kind, rows, outputs):
                    function(*arguments)
                results[name] = outputs
            pairs = list(zip(results["before"], results["after"]))
            apart[f"{kind}_{rows}_rows"] = max(float((a - b).abs().max() / a.abs().max()) for a, b in pairs)
            if not options.bits_may_differ and not all(torch.equal(a, b) for a, b in pairs):
                raise SystemExit(f"{kind} at {rows} rows: the two builds give different bits")
        return apart

    def one_pass(name: str, kind: str, rows: int) -> float:
        outputs = [torch.empty(rows, n) for _, n, _, _ in weights[kind]]
        work = calls(libraries[name], kind, rows, outputs)
        started = time.perf_counter()
        for function, arguments in work:
            function(*arguments)
        return (time.perf_counter() - started) * 1e3

    inputs: dict[tuple[str, int], list[torch.Tensor]] = {}
    apart = run_on_compute_thread(prepare)
    timings = {name: {f"{kind}_{rows}_rows": [] for kind, rows in cases} for name in libraries}
    for r in range(options.rounds):
        order = list(libraries) if r % 2 == 0 else list(reversed(libraries))
        for kind, rows in cases:
            for name in order:
                timings[name][f"{kind}_{rows}_rows"].append(run_on_compute_thread(one_pass, name, kind, rows))
    medians = {name: {case: statistics.median(v) for case, v in by.items()} for name, by in timings.items()}
    emit_figures({"before": options.before, "same_bits": not any(apart.values()), "relative_difference": apart,
                  "pass_ms": medians,
                  "after_over_before": {case: medians["after"][case] / medians["before"][case]
                                        for case in medians["after"]},
                  "rounds": timings}, options.json)


if __name__ == "__main__":
    main()
