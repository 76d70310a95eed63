"""Why llguidance masks the fused distribution: its cost against outlines-core's, side by side in one run.

For SmolLM2-135M-Instruct's vocabulary (49,152 ids) and three constraints (a JSON Schema with nested
objects, an enum and a number; any JSON object; a regex), each library compiles the constraint for
the vocabulary, then walks a valid answer token by token, computing the allowed-token mask before
each token: the work `fusion.fuse.structured` does per constrained row per step. Reports the compile time
and the mask time per step (median, p95), and prints one JSON object (`--json` writes it).

xgrammar is the third well-kept choice; its wheel depends on triton and apache-tvm-ffi (for its GPU
mask kernels), hundreds of MB that a CPU install of this project would carry for nothing, so it is
left out here (see docs/apis.md).

    pip install outlines-core      # benchmark only
    python benchmarks/grammar_masks.py [--model DIR] [--json benchmarks/results/grammar_masks.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "kind": {"enum": ["person", "place", "thing"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "kind", "age", "address"], "additionalProperties": False}
ANSWERS = {
    "json_schema": json.dumps({"name": "Ada Lovelace", "kind": "person", "age": 36, "tags": ["math", "poet"],
                               "address": {"city": "London", "zip": "W1"}}, separators=(",", ":")),
    "json_object": json.dumps({"answer": 85, "steps": ["7+8=15", "4+3+1=8"]}, separators=(",", ":")),
    "regex": "2026-12-02 at 14:05, 85 apples",
}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2} at [0-9]{2}:[0-9]{2}, [0-9]+ [a-z]+"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_llguidance(tokenizer, kind: str, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    from fusion.config import StructuredOutput
    from fusion.fuse.structured import grammar_text

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152)
    tokenizer_s = time.perf_counter() - start
    spec = {"json_schema": StructuredOutput(json_schema=SCHEMA), "json_object": StructuredOutput(json_object=True),
            "regex": StructuredOutput(regex=REGEX)}[kind]
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar_text(spec), log_level=0)
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, 49152)
    times = []
    for token in ids:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token} of the {kind} answer")
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_ms_p50": 1e3 * statistics.median(times),
            "mask_ms_p95": 1e3 * percentile(times, 0.95), "steps": len(times)}


def bench_outlines(tokenizer, kind: str, ids: list[int], token_bytes: list[bytes]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, raw in enumerate(token_bytes):
        if raw and token_id != eos:
            by_bytes.setdefault(raw, []).append(token_id)
    vocabulary = Vocabulary(eos, by_bytes)
    vocabulary_s = time.perf_counter() - start
    if kind == "json_schema":
        regex = build_regex_from_schema(json.dumps(SCHEMA))
    elif kind == "json_object":
        regex = build_regex_from_schema(json.dumps({"type": "object"}))
    else:
        regex = REGEX
    start = time.perf_counter()
    index = Index(regex, vocabulary)
    compile_s = time.perf_counter() - start
    guide = Guide(index)
    mask = torch.zeros(49152 // 32, dtype=torch.int32)
    times = []
    for token in ids:
        start = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        times.append(time.perf_counter() - start)
        guide.advance(token)
    return {"tokenizer_s": vocabulary_s, "compile_s": compile_s, "mask_ms_p50": 1e3 * statistics.median(times),
            "mask_ms_p95": 1e3 * percentile(times, 0.95), "steps": len(times)}


def main() -> None:
    from transformers import AutoTokenizer

    from fusion.models import default_cache_dir, model_dir
    from fusion.crosstok.spelling import token_bytes_of

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=model_dir(default_cache_dir(), "smollm2-135m-instruct"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    token_bytes = token_bytes_of(tokenizer)
    results: dict[str, dict] = {}
    for kind, answer in ANSWERS.items():
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        results[kind] = {"llguidance": bench_llguidance(tokenizer, kind, ids)}
        try:
            results[kind]["outlines_core"] = bench_outlines(tokenizer, kind, ids, token_bytes)
        except ImportError:
            results[kind]["outlines_core"] = "not installed (pip install outlines-core)"
        except Exception as err:  # noqa: BLE001  a constraint outlines-core cannot compile: say so
            results[kind]["outlines_core"] = f"failed: {type(err).__name__}: {str(err)[:200]}"
        for library, figures in results[kind].items():
            if isinstance(figures, dict):
                print(f"{kind:12} {library:14} compile {figures['compile_s'] * 1e3:9.1f} ms   mask p50 "
                      f"{figures['mask_ms_p50']:.3f} ms  p95 {figures['mask_ms_p95']:.3f} ms  ({figures['steps']} steps)")
            else:
                print(f"{kind:12} {library:14} {figures}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
