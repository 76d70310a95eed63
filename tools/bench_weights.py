"""The `weights` benchmark suite: the first expert's base model decoding from dense, int8 and int4
weights (fusion.forward.quantized), eagerly, beside llama.cpp running the same model from its GGUF
file when `llama-cpp-python` is installed (an optional extra, for benchmarks only; in a process of its own,
fusion.tools.llamacpp_engine), and the config's fused single stream against llama.cpp's. Every ratio
compares timings taken in alternating rounds of one run; a cold start is timed as a whole `fusion generate`
process per format."""

from __future__ import annotations

import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from fusion.experts.expert import LocalExpert
from fusion.forward.quantized import WEIGHT_FORMATS
from fusion.frontdoor.service import FusionRequest, FusionService
from fusion.tools.bench import (
    BENCH_PROMPT,
    BenchReport,
    _prompt_ids,
    clear_kept_prefixes,
    plain_experts,
    runtime_step_ms,
)
from fusion.tools.llamacpp_engine import LlamaCppProcess

logger = logging.getLogger(__name__)


def gguf_beside(model_path: str) -> Path | None:
    """The GGUF file kept in a model's folder (the builtin SmolLM2 keeps the one it was converted
    from), if there is exactly one."""
    folder = Path(model_path).expanduser()
    found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    return found[0] if len(found) == 1 else None


def _load_base(expert: LocalExpert, weights: str, decode: str) -> LocalExpert:
    config = expert.config.model_copy(update={"name": f"base-{weights}-{decode}", "weights": weights,
                                              "decode": decode, "adapter": None, "share_base": False})
    return LocalExpert.load(config, expert.info.model)


def bench_weights(service: FusionService, report: BenchReport, steps: int = 16, rounds: int = 3,
                  tokens: int = 48, cold_start: bool = True,
                  cache_dir: Path | None = None) -> None:
    """`cache_dir`: the model cache the cold-start processes use (default: theirs, `$FUSION_CACHE_DIR` or
    the XDG cache)."""
    index, reference = plain_experts(service)[0]
    prompt = _prompt_ids(service)[index]
    name = service.expert_names[index]
    # (quantized weights run on a CPU: the eager step is the C step)
    paths = {f"{w} fast": _load_base(reference, w, "fast") for w in WEIGHT_FORMATS}
    gguf = gguf_beside(reference.info.model)
    llama = None
    try:
        llama = LlamaCppProcess(gguf, torch.get_num_threads()) if gguf is not None else None
    except ImportError:
        logger.warning("weights suite: no llama.cpp binding is installed; no llama.cpp figures (pip install "
                       "'logit-fusion[llamacpp-wheel]', or 'logit-fusion[llamacpp]' to build it from source)")
    except RuntimeError as err:  # the worker could not load the file or decode (a crash in its build)
        logger.warning("weights suite: llama.cpp could not run; no llama.cpp figures: %s", err)
    if gguf is None:
        logger.warning("weights suite: no GGUF file beside %s; no llama.cpp figures", reference.info.model)
    try:
        timings: dict[str, list[float]] = {path: [] for path in paths}
        if llama is not None:
            timings["llama.cpp"] = []
        for _ in range(rounds):
            for path, expert in paths.items():
                timings[path].append(runtime_step_ms(expert, prompt, steps))
            if llama is not None:
                timings["llama.cpp"].append(statistics.mean(llama.step_times(prompt, steps + 2)[2:]) * 1e3)
        ms = {path: statistics.median(values) for path, values in timings.items()}
        for path, value in ms.items():
            report.add(f"weights.decode_ms.{path}", value, f"decode step, {name}'s base, {path}: {value:.2f} ms"
                       + (f" ({llama.binding}, {llama.threads} threads, {llama.path.name})" if path == "llama.cpp" else ""))
        for path in paths:
            if path != "dense fast":
                report.add(f"weights.{path}_over_dense", ms[path] / ms["dense fast"],
                           f"decode step {path} / dense fast: {ms[path] / ms['dense fast']:.3f}")
        if llama is not None:
            report.add("weights.llamacpp_build", {"binding": llama.binding, "system_info": llama.system_info.strip()},
                       f"llama.cpp: {llama.binding}; {llama.system_info.strip()}")
            for path in paths:
                if path.startswith("int4"):
                    ratio = ms[path] / ms["llama.cpp"]
                    report.add(f"weights.{path}_over_llamacpp", ratio,
                               f"decode step {path} / llama.cpp on the same GGUF: {ratio:.3f}  (goal <= 1.0)")
            _fused_against_llamacpp(service, report, llama, prompt, tokens, rounds)
    finally:
        if llama is not None:
            llama.close()
        for expert in paths.values():
            expert.close()
    if cold_start:
        _cold_starts(service, report, tokens, cache_dir)


def _stream_tokens_per_s(service: FusionService, request: FusionRequest) -> float:
    start = time.perf_counter()
    n = sum(1 for _ in service.submit(request))
    return n / (time.perf_counter() - start)


def _fused_against_llamacpp(service: FusionService, report: BenchReport, llama: LlamaCppProcess, prompt: list[int],
                            tokens: int, rounds: int) -> None:
    """The config's fused single stream (through the front door) against llama.cpp generating as many
    tokens alone, round by round: each reading the whole prompt, and (llama-cpp-python) each keeping the
    prompt the round before read (the experts' kept prefixes, llama.cpp's context)."""
    request = FusionRequest(BENCH_PROMPT, {"max_tokens": tokens, "ignore_eos": True})
    list(service.submit(request))  # warm-up
    fused, plain, fused_kept, plain_kept = [], [], [], []
    for _ in range(rounds):
        clear_kept_prefixes(service)
        fused.append(_stream_tokens_per_s(service, request))
        plain.append(llama.tokens_per_s(prompt, tokens))
        if llama.keeps_prompts:
            fused_kept.append(_stream_tokens_per_s(service, request))  # the round before kept its prompt
            plain_kept.append(llama.tokens_per_s(prompt, tokens, prompt_kept=True))
    weights = sorted({e.config.weights for e in service.engine.experts if hasattr(e, "config")})
    fused_tps, plain_tps = statistics.median(fused), statistics.median(plain)
    report.add("weights.fused_tokens_per_s", fused_tps,
               f"fused single stream ({len(service.expert_names)} experts, {'/'.join(weights)} weights, "
               f"{service.config.fusion.rule}): {fused_tps:.1f} tokens/s")
    report.add("weights.llamacpp_tokens_per_s", plain_tps, f"llama.cpp alone, same GGUF: {plain_tps:.1f} tokens/s")
    ratio = statistics.median(f / p for f, p in zip(fused, plain))
    report.add("weights.fused_over_llamacpp", ratio,
               f"fused tokens/s / llama.cpp's, both reading the prompt: {ratio:.3f}  (goal >= 1.0)")
    if fused_kept:
        kept = statistics.median(f / p for f, p in zip(fused_kept, plain_kept))
        report.add("weights.fused_tokens_per_s_prompt_kept", statistics.median(fused_kept),
                   f"fused single stream, its prompt kept from the round before: "
                   f"{statistics.median(fused_kept):.1f} tokens/s")
        report.add("weights.llamacpp_tokens_per_s_prompt_kept", statistics.median(plain_kept),
                   f"llama.cpp alone, its prompt kept likewise: {statistics.median(plain_kept):.1f} tokens/s")
        report.add("weights.fused_over_llamacpp_prompt_kept", kept,
                   f"fused tokens/s / llama.cpp's, both keeping the prompt: {kept:.3f}")


def _cold_starts(service: FusionService, report: BenchReport, tokens: int, cache_dir: Path | None,
                 rounds: int = 2) -> None:
    """A fresh `fusion generate` process per weights format (every in-process expert dense, then int4,
    alternating; `tokens` tokens, end of text ignored): seconds from launch to its first output, and to
    its exit; the best of `rounds` each. Codes and models come from their caches, as on a second start."""
    from fusion.tools.evaluation import with_weights

    first: dict[str, list[float]] = {"dense": [], "int4": []}
    done: dict[str, list[float]] = {"dense": [], "int4": []}
    with tempfile.TemporaryDirectory() as folder:
        files = {}
        for weights in first:
            files[weights] = Path(folder) / f"{weights}.yaml"
            data = with_weights(service.config, weights).model_dump(mode="json", exclude_defaults=True)
            data.setdefault("sampling", {}).update({"ignore_eos": True, "max_tokens": tokens})
            files[weights].write_text(yaml.safe_dump(data))
        for _ in range(rounds):
            for weights, path in files.items():
                start = time.perf_counter()
                command = [sys.executable, "-m", "fusion.tools.cli", "generate", BENCH_PROMPT, "--config", str(path)]
                if cache_dir is not None:
                    command += ["--cache-dir", str(cache_dir)]
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                process.stdout.read(1)
                first[weights].append(time.perf_counter() - start)
                process.stdout.read()
                errors = process.stderr.read().decode(errors="replace").strip().splitlines()
                if process.wait() != 0:
                    raise RuntimeError(f"`fusion generate` with {weights} weights failed (exit {process.returncode})"
                                       f": {errors[-1] if errors else 'no message'}")
                done[weights].append(time.perf_counter() - start)
    for weights in first:
        report.add(f"weights.cold_start_s.{weights}", {"first_output": min(first[weights]), "exit": min(done[weights])},
                   f"`fusion generate` ({tokens} tokens), {weights} weights: first output {min(first[weights]):.2f} s, "
                   f"exit {min(done[weights]):.2f} s after launch")
    ratio = min(first["int4"]) / min(first["dense"])
    report.add("weights.cold_start_int4_over_dense", ratio,
               f"launch to first output, int4 / dense: {ratio:.3f}  (goal <= 1.0)")
