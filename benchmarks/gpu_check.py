"""The figures of the GPU check (run by benchmarks/gpu_check.sh): the local build with three experts on
one device, a CUDA stream each, measured with `fusion bench`'s suites, side by side in one run.

  1. three SmolLM2-sized experts (SmolLM2-135M's shape, random weights: a decode step's time does not
     depend on the weights' values), built here so that no checkpoint has to travel;
  2. the same shape as one base with two LoRA adapters (random, of the shipped specialists' rank and
     target modules): the three experts' rows of a step as one batch over one copy of the base, the
     fused step against the base's own decode step (#31's ratio);
  3. the default trio (SmolLM2-135M-Instruct + the two specialists + the router), if `--cache` holds
     it (`fusion prepare` fills a cache on a machine with network; copy it along).

A build whose captured decode step (decode: fast on CUDA, fusion.forward.static_step) fails is reported
(its error in the figures) and measured again with `decode: transformers`, so that a run gives every
build's figures. Beside the fused generation, transformers' own `generate` with its static cache (compiled
by transformers on a GPU) of each expert alone. Writes OUT/gpu_check.json (every figure) and
OUT/gpu_check.txt (the report's lines).
`--device cpu --size tiny` runs the same code on a CPU in seconds (what the tests do).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from fusion.config import parse_config
from fusion.frontdoor.service import FusionService
from fusion.tools import bench

logger = logging.getLogger("gpu_check")

SHIPPED_ADAPTER = Path(__file__).resolve().parent.parent / "fusion" / "adapters" / "arith-lora"

# SmolLM2-135M's shape (its config.json); "tiny" is for runs of the script's logic on a CPU.
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=512, max_position_embeddings=512,
                 tie_word_embeddings=True),
}
CORPUS = ["the quick brown fox jumps over the lazy dog", "what is 12 + 35 ? the answer is 47 .",
          "def add ( a , b ) : return a + b", "why is the sky blue ? light scatters"] * 4
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_model(folder: Path, size: str, dtype: str) -> Path:
    """A randomly initialised Llama of the given shape with a small byte-level BPE tokenizer (its
    embedding has more rows than the tokenizer has ids, as padded vocabularies do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[size], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_adapters(base: Path, folder: Path, count: int, dtype: str) -> list[Path]:
    """Random (non-zero) LoRA adapters over `base` in the PEFT format, with the rank, scale and target
    modules of the shipped arithmetic specialist, so that a step does the same work as the default's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shipped = json.loads((SHIPPED_ADAPTER / "adapter_config.json").read_text(encoding="utf-8"))
    paths = []
    for k in range(count):
        torch.manual_seed(100 + k)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
        lora = get_peft_model(model, LoraConfig(r=shipped["r"], lora_alpha=shipped["lora_alpha"],
                                                target_modules=shipped["target_modules"], init_lora_weights=False))
        lora.save_pretrained(folder / f"adapter-{k}")
        paths.append(folder / f"adapter-{k}")
    return paths


def measure(label: str, config_data: dict, resolve, cache_dir: Path | None, args, figures: dict,
            lines: list[str]) -> None:
    """Every suite of `fusion bench` that the check reports, on one local build."""
    start = time.perf_counter()
    service = FusionService.from_config(parse_config(config_data), resolve_model=resolve, cache_dir=cache_dir)
    lines.append(f"== {label}: {', '.join(e['name'] for e in config_data['experts'])} on {args.device} "
                 f"(decode: {config_data['experts'][0].get('decode', 'fast')}), loaded in "
                 f"{time.perf_counter() - start:.1f} s")
    report = bench.BenchReport()
    try:
        # The engine's suites first (its steps on its pool threads, a CUDA stream each), then the decode
        # suite, which captures a static step of its own on this thread.
        bench.bench_step(service, report, steps=args.steps, rounds=3)
        bench.bench_generate(service, report, max_tokens=args.max_tokens)
        bench.bench_generate(service, report, max_tokens=args.max_tokens, cache_implementation="static")
        bench.bench_concurrency(service, report, levels=tuple(args.levels), max_tokens=args.max_tokens, rounds=2)
        bench.bench_decode(service, report, steps=args.steps, rounds=3, static=not args.no_static)
        bench.bench_memory(service, report)
    finally:
        service.close()
    figures[label] = report.figures
    lines.extend(report.lines)
    write(args.out, figures, lines)  # after each build, so that a run stopped later keeps these


def measure_or_eager(label: str, config_data: dict, resolve, cache_dir: Path | None, args, figures: dict,
                     lines: list[str]) -> None:
    """`measure`; where the captured decode step fails, says how and measures the same build with
    transformers' forward (`decode: transformers`), so that a run still gives that build's figures."""
    try:
        measure(label, config_data, resolve, cache_dir, args, figures, lines)
    except Exception as err:  # noqa: BLE001  reported in the figures, then measured the other way
        if all(e.get("decode", "fast") not in ("fast", "static") for e in config_data["experts"]):
            raise
        logger.exception("%s with the captured step failed", label)
        lines.append(f"({label} with the captured step failed: {type(err).__name__}: {err}; measured with decode "
                     "transformers)")
        figures[f"{label} (captured step failed)"] = {"error": f"{type(err).__name__}: {err}"}
        eager = {**config_data, "experts": [{**e, "decode": "transformers"} for e in config_data["experts"]]}
        measure(f"{label} (decode transformers)", eager, resolve, cache_dir, args, figures, lines)


def write(out: Path, figures: dict, lines: list[str]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=2, default=str))
    (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.txt")
    parser.add_argument("--cache", type=Path, default=None, help="a model cache holding the default trio")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check of the script itself)")
    parser.add_argument("--size", choices=sorted(SHAPES), default="smollm2", help="shape of the built experts")
    parser.add_argument("--decode", choices=["transformers", "fast", "static"], default="fast",
                        help="the experts' decode path in the local builds")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing round")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request in generate/concurrency")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64], help="concurrency levels")
    parser.add_argument("--no-static", action="store_true", help="leave the static step out of the decode suite")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="the default trio is measured only if the first build took under half of this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    figures: dict = {"machine": bench.machine_description(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.device.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name(0)
    lines = [f"machine: {figures['machine']}" + (f", {figures['gpu']}" if "gpu" in figures else "")]
    dtype = "bfloat16" if args.size == "smollm2" else "float32"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        folder = make_model(Path(tmp) / "expert", args.size, dtype)
        trio = {"experts": [{"name": name, "model": str(folder), "dtype": dtype, "device": args.device,
                             "decode": args.decode, "weight": weight}
                            for name, weight in (("one", 0.5), ("two", 0.3), ("three", 0.2))],
                "fusion": {"rule": "weighted_logits"}}
        measure_or_eager(f"{args.size}-sized trio", trio, lambda ref: ref, None, args, figures, lines)
        if time.perf_counter() - started > args.budget_s / 2:
            lines.append(f"(the adapter trio was not measured: the first build took over half of --budget-s "
                         f"{args.budget_s:.0f})")
        else:
            adapters = make_adapters(folder, Path(tmp), 2, dtype)
            shared = {"experts": [{**trio["experts"][0], "name": "base", "weight": 1.0}]
                      + [{**trio["experts"][0], "name": f"lora{k}", "adapter": str(path), "weight": 1.0}
                         for k, path in enumerate(adapters)],
                      "fusion": {"rule": "weighted_logits"}}
            try:
                measure_or_eager(f"{args.size}-sized adapter trio (one base)", shared, lambda ref: ref, None, args,
                                 figures, lines)
            except Exception as err:  # noqa: BLE001  the first build's figures stand; say what failed
                logger.exception("the adapter trio failed")
                lines.append(f"(the adapter trio failed: {type(err).__name__}: {err})")
    if args.cache is not None and time.perf_counter() - started > args.budget_s * 2 / 3:
        lines.append(f"(the default trio was not measured: the first builds took over two thirds of --budget-s "
                     f"{args.budget_s:.0f})")
    elif args.cache is not None:
        from fusion.errors import AssetError
        from fusion.models import model_resolver

        data = _default_trio(args)
        try:
            measure("default trio", data, model_resolver(args.cache), args.cache, args, figures, lines)
        except AssetError as err:  # no trained router for these experts in the cache
            lines.append(f"(default trio with its router: {err}; measured with rule mixture instead)")
            data["fusion"] = {"rule": "mixture"}
            measure("default trio", data, model_resolver(args.cache), args.cache, args, figures, lines)
    else:
        lines.append("(no --cache: the default trio was not measured)")
    write(args.out, figures, lines)
    print("\n".join(lines))
    return 0


def _default_trio(args) -> dict:
    import yaml

    import fusion

    default_config = Path(fusion.__file__).parent / "configs" / "default-gpu.yaml"
    data = yaml.safe_load(default_config.read_text(encoding="utf-8"))
    for expert in data["experts"]:
        expert.update(device=args.device, decode=args.decode)
    return data


if __name__ == "__main__":
    sys.exit(main())
