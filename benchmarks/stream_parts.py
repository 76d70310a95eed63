"""Where a streamed token of the default trio goes: the bench's 48-token stream (`fusion bench`'s weights
suite streams the same prompt), served as `fusion serve` serves it, with the engine's parts and the C calls
timed inside it.

Each listed function (and each call into the C library: the layers, the head's product, the route rule's two
passes) is wrapped with a timer; a part's figure is its inclusive time per streamed token, averaged over the
rounds, so a caller's figure holds its callees'. What no C call covers is Python and torch operators around
them (`python_around_c` = the compute thread's whole step less every C call). By default each round keeps the
prompt from the round before (the decode steps alone, as the suite's "keeping the prompt" figure); with
--read-prompt each round reads it (its prefill counted in the C layers' time and `FastDecoder.prefill`).

    python benchmarks/stream_parts.py [--rounds 8] [--read-prompt] [--json benchmarks/results/bench_stream_parts.json]
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

TOKENS = 48
C_CALLS = ("fusion_decode_layers", "fusion_int8_mm", "fusion_logit_statistics", "fusion_router_head", "fusion_mixture")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--read-prompt", action="store_true", help="each round reads its prompt (no kept prefix)")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()

    from fusion.engine import batch as decode_batch
    from fusion.engine import core as engine
    from fusion.experts import batching as expert_batching
    from fusion.experts import expert
    from fusion.forward import llama as fast_decode
    from fusion.forward import native_kernels
    from fusion.forward import native_step as native_decoder
    from fusion.fuse import router
    from fusion.models import default_cache_dir
    from fusion.frontdoor.service import FusionRequest
    from fusion.tools.bench import BENCH_PROMPT, clear_kept_prefixes
    from fusion.tools.loading import load_service, read_config
    from fusion.tools.step_timing import Timings, emit_figures, wrap

    service = load_service(read_config(None), default_cache_dir())
    request = FusionRequest(BENCH_PROMPT, {"max_tokens": TOKENS, "ignore_eos": True})
    list(service.submit(request))  # warm: the kernels built, the first prompt kept
    timings: Timings = collections.defaultdict(list)
    parts = [(decode_batch.DecodeBatch, "_step"), (decode_batch.DecodeBatch, "fused_logits"),
             (engine.FusionEngine, "step_experts"), (expert.LocalExpert, "step"),
             (expert_batching.BatchedForwardsMixin, "_decode_batch"), (fast_decode.FastDecoder, "forward"),
             (native_decoder.NativeLayers, "run"), (fast_decode.FastDecoder, "_head"),
             (fast_decode.FastDecoder, "prefill"), (decode_batch.DecodeBatch, "_fuse"),
             (router.Router, "fuse"), (decode_batch.DecodeBatch, "_sample"), (decode_batch.DecodeBatch, "emit_tokens"),
             (engine.FusionEngine, "check_finite")]
    for owner, name in parts:
        wrap(owner, name, f"{owner.__name__}.{name}", timings)
    library = native_kernels.library()
    if library is not None:
        for name in C_CALLS:
            wrap(library, name, f"C {name}", timings)

    elapsed = 0.0
    for _ in range(options.rounds):
        if options.read_prompt:
            clear_kept_prefixes(service)
        started = time.perf_counter()
        streamed = sum(1 for _ in service.submit(request))
        elapsed += time.perf_counter() - started
        if streamed != TOKENS:
            raise SystemExit(f"the stream gave {streamed} tokens, not {TOKENS}")
    tokens = TOKENS * options.rounds
    per_token = {label: sum(ms) / tokens for label, ms in sorted(timings.items(), key=lambda kv: -sum(kv[1]))}
    c_total = sum(per_token.get(f"C {name}", 0.0) for name in C_CALLS)
    figures = {
        "reads_prompt": options.read_prompt, "rounds": options.rounds, "tokens_per_stream": TOKENS,
        "stream_ms_per_token": elapsed * 1e3 / tokens, "tokens_per_s": tokens / elapsed,
        "ms_per_token": per_token,
        "c_calls_ms_per_token": c_total,
        "python_around_c_ms_per_token": per_token["DecodeBatch._step"] - c_total,
    }
    service.close()
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
