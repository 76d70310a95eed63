"""Benchmarks. Every figure is a ratio of two timings measured side by side in one run, because the
machines are shared and noisy; absolute times are printed for context only."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.compute import run_on_compute_thread
from fusion.config import SamplingParams
from fusion.engine import GenerationRequest
from fusion.expert import LocalExpert
from fusion.service import FusionRequest, FusionService

logger = logging.getLogger(__name__)

BENCH_PROMPT = "Write a short paragraph about why the sky is blue, and then explain it to a child."


@dataclass
class BenchReport:
    figures: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def add(self, key: str, value: Any, line: str) -> None:
        self.figures[key] = value
        self.lines.append(line)
        logger.info(line)


def machine_description() -> str:
    import os
    import platform

    return (f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, cuda={'yes' if torch.cuda.is_available() else 'no'}")


def _prompt_ids(service: FusionService) -> list[list[int]]:
    return service.prompt_ids(BENCH_PROMPT)


def plain_forward_ms(expert: LocalExpert, prompt: list[int], steps: int) -> float:
    """Mean time of one decode forward of the bare model with its KV cache (the reference), on the
    compute thread like the engine's forwards."""
    return run_on_compute_thread(_plain_forward_ms, expert, prompt, steps)


def _plain_forward_ms(expert: LocalExpert, prompt: list[int], steps: int) -> float:
    from transformers import DynamicCache

    model = expert.model
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt], device=expert.device), cache=cache, use_cache=True,
                    logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return statistics.mean(times[2:]) * 1e3


def cross_step_ms(service: FusionService, steps: int) -> tuple[float, float]:
    """Experts of different tokenizers: the mean fused text step (each expert's forward over its
    lookahead rows, alignment, fusion, sampling, re-tokenization) and the mean ids per expert forward."""
    return run_on_compute_thread(_cross_step_ms, service, steps)


def _cross_step_ms(service: FusionService, steps: int) -> tuple[float, float]:
    from fusion.crosstok import decode

    rule, weights = service.resolve_spec(None)
    rows: list[int] = []
    originals = {}
    for expert in service.engine.experts:  # count the ids each extend call computes
        if isinstance(expert, LocalExpert):
            originals[expert] = expert.extend

            def counted(session_id, token_ids, extensions, _inner=expert.extend):
                rows.append(sum(1 for e in extensions if e))
                return _inner(session_id, token_ids, extensions)

            expert.extend = counted
    try:
        pieces = decode(service.cross, _prompt_ids(service), SamplingParams(max_tokens=steps + 3, ignore_eos=True),
                        rule, weights)
        next(pieces)  # prefill
        next(pieces)  # warm-up
        rows.clear()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            next(pieces)
            times.append(time.perf_counter() - start)
        pieces.close()
    finally:
        for expert, extend in originals.items():
            expert.extend = extend
    lookahead = [r for r in rows if r]
    return statistics.mean(times) * 1e3, statistics.mean(lookahead) if lookahead else 0.0


def fused_step_ms(service: FusionService, steps: int) -> tuple[float, float, dict[str, float]]:
    """Mean fused decode step (all experts overlapped + fusion + sampling) and its fusion+sampling part."""
    engine = service.engine
    rule, weights = service.resolve_spec(None)
    request = GenerationRequest(_prompt_ids(service), SamplingParams(max_tokens=steps + 3, ignore_eos=True),
                                rule, weights)
    batch = engine.new_batch()
    batch.add(request)
    batch.step()  # prefill
    batch.step()  # warm-up
    step_times, fuse_times = [], []
    per_expert: dict[str, list[float]] = {n: [] for n in engine.names}
    for _ in range(steps):
        start = time.perf_counter()
        batch.step()
        step_times.append(time.perf_counter() - start)
        fuse_times.append(engine.last_timings.fuse_sample_s)
        for name, seconds in engine.last_timings.per_expert_s.items():
            per_expert[name].append(seconds)
    batch.cancel_all()
    return (statistics.mean(step_times) * 1e3, statistics.mean(fuse_times) * 1e3,
            {n: statistics.mean(v) * 1e3 for n, v in per_expert.items() if v})


def bench_step(service: FusionService, report: BenchReport, steps: int = 24, rounds: int = 3) -> None:
    """Fused step / Σ plain forwards, and fusion+sampling / one forward. Rounds interleave the two
    measurements so drift in machine load hits both alike."""
    experts = [e for e in service.engine.experts if isinstance(e, LocalExpert)]
    prompts = _prompt_ids(service)
    plain_sums, fused, fuse, rows = [], [], [], []
    per_expert_plain: dict[str, list[float]] = {e.info.name: [] for e in experts}
    for r in range(rounds):
        logger.info("step benchmark round %d/%d", r + 1, rounds)
        times = [plain_forward_ms(e, prompts[i], steps) for i, e in enumerate(experts)]
        for e, t in zip(experts, times):
            per_expert_plain[e.info.name].append(t)
        plain_sums.append(sum(times))
        if service.cross is not None:
            step_ms, lookahead = cross_step_ms(service, steps)
            fuse_ms = 0.0
            rows.append(lookahead)
        else:
            step_ms, fuse_ms, _ = fused_step_ms(service, steps)
        fused.append(step_ms)
        fuse.append(fuse_ms)
    if service.cross is not None:
        plain_sum, fused_ms = statistics.median(plain_sums), statistics.median(fused)
        for name, values in per_expert_plain.items():
            report.add(f"plain_forward_ms.{name}", statistics.median(values),
                       f"plain decode forward, {name}: {statistics.median(values):.1f} ms")
        report.add("cross_step_ms", fused_ms, f"fused text step ({len(experts)} experts, different tokenizers): "
                   f"{fused_ms:.1f} ms")
        report.add("cross_step_over_sum_of_forwards", fused_ms / plain_sum,
                   f"fused text step / sum of plain forwards: {fused_ms / plain_sum:.3f}  (goal <= 1.15)")
        report.add("cross_lookahead_rows", statistics.mean(rows),
                   f"ids per lookahead forward: {statistics.mean(rows):.2f}")
        return
    plain_sum = statistics.median(plain_sums)
    fused_ms = statistics.median(fused)
    fuse_ms = statistics.median(fuse)
    one_forward = statistics.median(per_expert_plain[experts[0].info.name])
    for name, values in per_expert_plain.items():
        report.add(f"plain_forward_ms.{name}", statistics.median(values),
                   f"plain decode forward, {name}: {statistics.median(values):.1f} ms")
    report.add("fused_step_ms", fused_ms, f"fused decode step ({len(experts)} experts): {fused_ms:.1f} ms")
    report.add("fused_step_over_sum_of_forwards", fused_ms / plain_sum,
               f"fused step / sum of plain forwards: {fused_ms / plain_sum:.3f}  (goal <= 1.05)")
    report.add("fusion_sampling_ms", fuse_ms, f"fusion + sampling: {fuse_ms:.2f} ms at vocabulary "
               f"{service.engine.vocab_size}")
    report.add("fusion_sampling_over_one_forward", fuse_ms / one_forward,
               f"fusion + sampling / one forward ({experts[0].info.name}): {fuse_ms / one_forward:.4f}  "
               "(goal <= 0.02)")


def bench_generate(service: FusionService, report: BenchReport, max_tokens: int = 48) -> None:
    """Fused single-stream tokens/s against each expert's plain transformers `generate`."""
    from transformers import GenerationConfig

    prompts = _prompt_ids(service)
    request = FusionRequest(BENCH_PROMPT, {"max_tokens": max_tokens, "ignore_eos": True})
    list(service.submit(request))  # warm-up
    start = time.perf_counter()
    n = sum(1 for _ in service.submit(request))  # the front door: admission, scheduler, text
    fused_tps = n / (time.perf_counter() - start)
    report.add("fused_tokens_per_s", fused_tps, f"fused generation: {fused_tps:.1f} tokens/s")
    for i, expert in enumerate(service.engine.experts):
        if not isinstance(expert, LocalExpert):
            continue
        ids = torch.tensor([prompts[i]], device=expert.device)
        gen_config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=0)

        def timed_generate(model=expert.model, ids=ids, gen_config=gen_config) -> tuple[torch.Tensor, float]:
            with torch.no_grad():
                model.generate(ids, generation_config=gen_config)  # warm-up
                start = time.perf_counter()
                return model.generate(ids, generation_config=gen_config), time.perf_counter() - start

        out, seconds = run_on_compute_thread(timed_generate)
        tps = (out.shape[1] - ids.shape[1]) / seconds
        report.add(f"generate_tokens_per_s.{expert.info.name}", tps,
                   f"plain generate, {expert.info.name}: {tps:.1f} tokens/s; fused / plain = {fused_tps / tps:.3f}")


def _concurrency_round(service: FusionService, level: int, max_tokens: int) -> tuple[float, list[float]]:
    """`level` sessions through the service at once: (aggregate tokens/s, inter-token gaps in s)."""
    gaps: list[float] = []
    lock = threading.Lock()
    counts = [0] * level

    def consume(i: int) -> None:
        request = FusionRequest(f"{BENCH_PROMPT} ({i})", {"max_tokens": max_tokens, "ignore_eos": True})
        last = None
        local = []
        for _ in service.submit(request):
            now = time.perf_counter()
            if last is not None:
                local.append(now - last)
            last = now
            counts[i] += 1
        with lock:
            gaps.extend(local)

    start = time.perf_counter()
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return sum(counts) / elapsed, gaps


def bench_concurrency(service: FusionService, report: BenchReport, levels=(1, 4, 8, 16),
                      max_tokens: int = 32, rounds: int = 3) -> None:
    """Aggregate tokens/s at N concurrent sessions / 1 session, with p50/p95 inter-token latency.
    Each round runs every level once, so machine drift hits all levels alike; a level's ratio is the
    median over rounds of its tokens/s over the same round's single-session tokens/s."""
    levels = sorted(set(levels) | {1})
    tps: dict[int, list[float]] = {level: [] for level in levels}
    gaps: dict[int, list[float]] = {level: [] for level in levels}
    for r in range(rounds):
        logger.info("concurrency round %d/%d", r + 1, rounds)
        for level in levels:
            rate, level_gaps = _concurrency_round(service, level, max_tokens)
            tps[level].append(rate)
            gaps[level].extend(level_gaps)
    for level in levels:
        ratio = statistics.median(t / one for t, one in zip(tps[level], tps[1]))
        ordered = sorted(gaps[level])
        p50 = ordered[len(ordered) // 2] * 1e3
        p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1e3
        rate = statistics.median(tps[level])
        report.add(f"concurrency.{level}", {"tokens_per_s": rate, "ratio": ratio, "itl_p50_ms": p50,
                                            "itl_p95_ms": p95},
                   f"{level:>2} sessions: {rate:6.1f} tokens/s ({ratio:.2f}x one session), "
                   f"inter-token p50 {p50:.0f} ms, p95 {p95:.0f} ms")
    base = report.figures["concurrency.1"]["itl_p95_ms"]
    for level in levels[1:]:
        figures = report.figures[f"concurrency.{level}"]
        figures["itl_p95_ratio"] = figures["itl_p95_ms"] / base


def bench_long_context(service: FusionService, report: BenchReport, sessions: int = 8, context: int = 1024,
                       steps: int = 16) -> None:
    """Batched decode at long context: the expert runtime's step (sessions batched from their own
    in-place caches) / transformers' own batched decode through one DynamicCache, on the same batch
    of the first local expert. The two decode in alternation, so machine drift hits both alike."""
    expert = next(e for e in service.engine.experts if isinstance(e, LocalExpert))
    if expert.info.max_positions:
        context = min(context, expert.info.max_positions - steps - 1)
    ours, theirs = run_on_compute_thread(_long_context_steps, expert, sessions, context, steps)
    name = expert.info.name
    report.add("long_context_step_ms", {"runtime": ours, "transformers": theirs},
               f"batched decode, {name}, {sessions} sessions x {context} ids: runtime {ours:.1f} ms, "
               f"transformers DynamicCache {theirs:.1f} ms")
    report.add("long_context_step_over_transformers", ours / theirs,
               f"long-context batched step / transformers' own: {ours / theirs:.3f}")


def _long_context_steps(expert: LocalExpert, sessions: int, context: int, steps: int) -> tuple[float, float]:
    from transformers import DynamicCache

    from fusion.expert import StepRequest

    generator = torch.Generator().manual_seed(0)
    limit = min(expert.info.vocab_size, expert.info.tokenizer_size)
    prompts = torch.randint(0, limit, (sessions, context), generator=generator)  # (B, context)
    histories = {f"long-{row}": prompts[row].tolist() for row in range(sessions)}
    logger.info("long-context benchmark: prefilling %d x %d ids twice", sessions, context)
    with torch.no_grad():
        expert.step([StepRequest(s, h) for s, h in histories.items()])
        cache = DynamicCache(config=expert.model.config)
        expert.model(input_ids=prompts.to(expert.device), cache=cache, use_cache=True, logits_to_keep=1)
        ours, theirs = [], []
        for step in range(steps + 1):
            next_id = 1 + step % (limit - 1)
            for history in histories.values():
                history.append(next_id)
            start = time.perf_counter()
            expert.step([StepRequest(s, h) for s, h in histories.items()])
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            expert.model(input_ids=torch.full((sessions, 1), next_id, device=expert.device), cache=cache,
                         use_cache=True, logits_to_keep=1)
            theirs.append(time.perf_counter() - start)
    expert.release(list(histories))
    return statistics.median(ours[1:]) * 1e3, statistics.median(theirs[1:]) * 1e3


def bench_sampling(service: FusionService, report: BenchReport, sessions: int = 8, steps: int = 12,
                   sampling: dict | None = None) -> None:
    """The sampler on real fused distributions: `sample` (on a CPU: top-k/top-p among each row's best
    ids) / the full-sort path, timed in alternation on the same logits, with the share of rows whose
    nucleus fit among the candidates."""
    from fusion import sampler

    sampling = sampling or {"temperature": 0.8, "top_p": 0.9}
    fused_rows = run_on_compute_thread(_fused_distributions, service, sessions, steps, sampling)
    params = [SamplingParams(**sampling)] * sessions
    ours, full, fits = [], [], []
    for fused in fused_rows:  # (B, V) each
        md = sampler.SamplingMetadata.build(params[: fused.shape[0]], fused.shape[-1], {}, fused.device)
        scaled = fused / md.temperature[:, None]
        for timings, run in ((ours, lambda: sampler.sample(fused, md)),
                             (full, lambda: sampler._sample_full(scaled, md))):
            start = time.perf_counter()
            run()
            timings.append(time.perf_counter() - start)
        if not (md.no_top_k and md.no_top_p):
            fits.extend(sampler._candidates(scaled, md)[2].tolist())
    ours_ms, full_ms = statistics.median(ours) * 1e3, statistics.median(full) * 1e3
    share = sum(fits) / len(fits) if fits else 1.0
    report.add("sampling_ms", {"sample": ours_ms, "full_sort": full_ms, "candidates_fit": share},
               f"sampling {sampling}, {sessions} rows: {ours_ms:.2f} ms, full sort {full_ms:.2f} ms; "
               f"{share:.0%} of rows fit among {sampler.CANDIDATES} candidates")
    report.add("sampling_over_full_sort", ours_ms / full_ms, f"sampling / full-sort sampling: {ours_ms / full_ms:.3f}")


def _fused_distributions(service: FusionService, sessions: int, steps: int, sampling: dict) -> list[torch.Tensor]:
    """The fused (B, V) logits of `steps` decode steps of `sessions` concurrent requests."""
    batch = service.engine.new_batch()
    for i in range(sessions):
        batch.add(service.admit(FusionRequest(f"{BENCH_PROMPT} ({i})", {**sampling, "max_tokens": steps + 1,
                                                                    "ignore_eos": True, "seed": i})))
    captured = []
    while batch.active:
        step = batch.fused_logits()
        if step.fused is not None and len(step.rows) == sessions:
            captured.append(step.fused.clone())
        batch.emit_tokens(step)
    return captured


def bench_memory(service: FusionService, report: BenchReport) -> None:
    for expert in service.engine.experts:
        if isinstance(expert, LocalExpert):
            size = sum(p.numel() * p.element_size() for p in expert.model.parameters())
            report.add(f"weights_mb.{expert.info.name}", size / 2**20,
                       f"weights, {expert.info.name}: {size / 2**20:.1f} MiB ({expert.info.dtype})")


def plot(figures: dict[str, Any], path) -> None:
    """A PNG: throughput ratio and inter-token latency per concurrency level, and the overhead ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(k.split(".")[1]) for k in figures if k.startswith("concurrency."))
    labels = {"fused_step_over_sum_of_forwards": "fused step\n/ sum of\nforwards",
              "fusion_sampling_over_one_forward": "fusion +\nsampling /\none forward",
              "long_context_step_over_transformers": "long-context\nstep /\ntransformers'",
              "sampling_over_full_sort": "top-p sampling\n/ full sort"}
    ratios = {k: figures[k] for k in labels if k in figures}
    panels = (2 if levels else 0) + (1 if ratios else 0)
    if not panels:
        raise ValueError("no concurrency or step figures to plot")
    widths = [1.0] * (2 if levels else 0) + ([0.45 * len(ratios)] if ratios else [])
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * sum(widths), 4.0), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    axes = list(axes[0])
    if levels:
        conc = [figures[f"concurrency.{n}"] for n in levels]
        ax = axes.pop(0)
        ax.bar([str(n) for n in levels], [c["ratio"] for c in conc], color="#66c2a5")
        ax.axhline(4.0, color="grey", linestyle="--", linewidth=1, label="goal at 8 sessions")
        ax.set(title="aggregate tokens/s vs 1 session", xlabel="concurrent sessions", ylabel="ratio")
        ax.legend(fontsize=8)
        ax = axes.pop(0)
        ax.plot(levels, [c["itl_p50_ms"] for c in conc], marker="o", label="p50")
        ax.plot(levels, [c["itl_p95_ms"] for c in conc], marker="o", label="p95")
        ax.set(title="inter-token latency", xlabel="concurrent sessions", ylabel="ms", xticks=levels)
        ax.legend(fontsize=8)
    if ratios:
        ax = axes.pop(0)
        ax.bar([labels[k] for k in ratios], list(ratios.values()), color="#fc8d62")
        ax.set(title="side-by-side time ratios (lower is faster)", ylabel="ratio")
    fig.suptitle(figures.get("machine", ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
