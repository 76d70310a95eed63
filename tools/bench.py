"""Benchmarks. Every figure is a ratio of two timings measured side by side in one run, because the
machines are shared and noisy; absolute times are printed for context only."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.fuse import sampler
from fusion.compute import run_on_compute_thread
from fusion.config import SamplingParams
from fusion.engine.types import GenerationRequest
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward.llama import DecodeStep, FastDecoder, decode_on_layers, unsupported_reason
from fusion.forward.kv_cache import new_cache
from fusion.forward.static_step import KVSlots, StaticStep
from fusion.frontdoor.service import FusionRequest, FusionService

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


_REFERENCES: dict[int, LocalExpert] = {}  # id(shared base) -> a plain copy of its base model


def plain_experts(service: FusionService) -> list[tuple[int, LocalExpert]]:
    """(index of the expert, a model to time plainly) per in-process expert: the expert itself, or for
    experts that are adapters over one base (fusion.experts.shared_base) one plain copy of that base, loaded
    once, under the first member's index (the base's own forward is the reference their step is held
    to)."""
    out, seen = [], set()
    for index, expert in enumerate(service.engine.experts):
        group = getattr(expert, "shared_base", None)
        if isinstance(expert, LocalExpert):
            out.append((index, expert))
        elif group is not None and id(group) not in seen:
            seen.add(id(group))
            if id(group) not in _REFERENCES:
                config = expert.config.model_copy(update={"name": "base", "adapter": None, "share_base": False})
                _REFERENCES[id(group)] = LocalExpert.load(config, group.info.model)
            out.append((index, _REFERENCES[id(group)]))
    return out


def shares_a_base(service: FusionService) -> bool:
    return any(getattr(e, "shared_base", None) is not None for e in service.engine.experts)


def _prompt_ids(service: FusionService) -> list[list[int]]:
    return service.prompt_ids(BENCH_PROMPT)


def plain_forward_ms(expert: LocalExpert, prompt: list[int], steps: int) -> float:
    """Mean time of one decode forward of the bare model with its KV cache (the reference), on the
    compute thread like the engine's forwards."""
    return run_on_compute_thread(_plain_forward_ms, expert, prompt, steps)


def _plain_forward_ms(expert: LocalExpert, prompt: list[int], steps: int) -> float:
    forwards = _plain_forward_times(expert, prompt)
    times = [next(forwards) for _ in range(steps + 2)]
    forwards.close()
    return statistics.mean(times[2:]) * 1e3


def _plain_forward_times(expert: LocalExpert, prompt: list[int]) -> Iterator[float]:
    """Seconds of each decode forward of the bare model with transformers' own cache, after the prefill."""
    from transformers import DynamicCache

    model = expert.model
    group = getattr(expert, "shared_base", None)
    if group is not None:  # the bare base, not the rows the members' last step left (a batch of another size)
        group.select_base_rows()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt], device=expert.device), cache=cache, use_cache=True,
                    logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    while True:
        with torch.no_grad():
            start = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            elapsed = time.perf_counter() - start
        yield elapsed


def runtime_step_ms(expert: LocalExpert, prompt: list[int], steps: int) -> float:
    """Mean decode step of the expert runtime alone (`expert.step` on one session, through the decode
    path its config chose), on the compute thread."""
    return run_on_compute_thread(_runtime_step_ms, expert, prompt, steps)


def _runtime_step_ms(expert: LocalExpert, prompt: list[int], steps: int) -> float:
    runtime_steps = _runtime_step_times(expert, prompt)
    times = [next(runtime_steps) for _ in range(steps + 3)]
    runtime_steps.close()
    return statistics.mean(times[3:]) * 1e3  # the first is the prefill


def _runtime_step_times(expert: LocalExpert, prompt: list[int]) -> Iterator[float]:
    """Seconds of each `expert.step` on one session (the prefill first); its session is released when
    the generator closes."""
    session = f"bench-runtime-{time.time_ns()}"
    history = list(prompt)
    try:
        while True:
            start = time.perf_counter()
            logits = expert.step([StepRequest(session, history)])
            token = int(logits[0].argmax())  # a host sync, as the engine's sampler makes
            elapsed = time.perf_counter() - start
            history.append(token)
            yield elapsed
    finally:
        expert.release([session])


def cross_step_rounds(service: FusionService, steps: int, rounds: int) -> list[dict[str, float]]:
    """Experts of different tokenizers, per round: the fused text step (each expert's forward over its
    lookahead rows, alignment, fusion, sampling, re-tokenization), each expert's plain forward and its
    own runtime decode step, interleaved step by step (a plain forward of each expert, a runtime step of
    each, a fused step) so that a host whose speed drifts slows all three alike; and the mean ids per
    lookahead forward. Each round's figures are mean ms per step."""
    return run_on_compute_thread(_cross_step_rounds, service, steps, rounds)


def _cross_step_rounds(service: FusionService, steps: int, rounds: int) -> list[dict[str, float]]:
    from fusion.crosstok.decode import decode

    rule, weights = service.resolve_spec(None)
    experts = [e for e in service.engine.experts if isinstance(e, LocalExpert)]
    prompts = _prompt_ids(service)
    rows: list[int] = []
    originals = {}
    for expert in experts:  # count the ids each extend call computes
        originals[expert] = expert.extend

        def counted(session_id, token_ids, extensions, _inner=expert.extend):
            rows.append(sum(1 for e in extensions if e))
            return _inner(session_id, token_ids, extensions)

        expert.extend = counted
    results = []
    try:
        for _ in range(rounds):
            plains = [_plain_forward_times(e, prompts[i]) for i, e in enumerate(experts)]
            runtimes = [_runtime_step_times(e, prompts[i]) for i, e in enumerate(experts)]
            pieces = decode(service.cross, prompts, SamplingParams(max_tokens=steps + 3, ignore_eos=True), rule,
                            weights)
            for _ in range(2):  # prefill, warm-up
                next(pieces)
                for timings in plains + runtimes:
                    next(timings)
            rows.clear()
            totals = {"fused": 0.0, "runtime": 0.0, **{f"plain.{e.info.name}": 0.0 for e in experts}}
            for _ in range(steps):
                for expert, timings in zip(experts, plains):
                    totals[f"plain.{expert.info.name}"] += next(timings)
                totals["runtime"] += sum(next(timings) for timings in runtimes)
                start = time.perf_counter()
                next(pieces)
                totals["fused"] += time.perf_counter() - start
            for generator in [pieces, *plains, *runtimes]:
                generator.close()
            lookahead = [r for r in rows if r]
            results.append({**{k: v / steps * 1e3 for k, v in totals.items()},
                            "lookahead_rows": statistics.mean(lookahead) if lookahead else 0.0})
    finally:
        for expert, extend in originals.items():
            expert.extend = extend
    return results


def warm_decode_batch(service: FusionService, steps: int, rule=None, weights=None, rows: int = 1,
                      structured: dict | None = None):
    """A decode batch of `rows` requests (the bench prompt, the config's rule unless given) past their
    prefill and one warm-up step, with `steps` more tokens to go. With `structured`, each request is
    admitted through the service with that grammar (its matcher is built at admission)."""
    if rule is None:
        rule, weights = service.resolve_spec(None)
    batch = service.engine.new_batch()
    sampling = {"max_tokens": steps + 3, "ignore_eos": True}
    for _ in range(rows):
        if structured is not None:
            batch.add(service.admit(FusionRequest(BENCH_PROMPT, {**sampling, "structured": structured})))
        else:
            batch.add(GenerationRequest(_prompt_ids(service), SamplingParams(**sampling), rule, weights))
    batch.step()  # prefill
    batch.step()  # warm-up
    return batch


def fused_step_ms(service: FusionService, steps: int) -> tuple[float, float, dict[str, float]]:
    """Mean fused decode step (all experts overlapped + fusion + sampling) and its fusion+sampling part."""
    engine = service.engine
    batch = warm_decode_batch(service, steps)
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
    """Fused step / Σ plain forwards, and fusion+sampling / one forward. Rounds interleave the
    measurements so drift in machine load hits them alike (experts of different tokenizers: step by step,
    `cross_step_rounds`)."""
    if service.cross is not None:
        _bench_cross_step(service, report, steps, rounds)
        return
    if shares_a_base(service):
        _bench_shared_base_step(service, report, steps, rounds)
        return
    experts = [e for e in service.engine.experts if isinstance(e, LocalExpert)]
    prompts = _prompt_ids(service)
    plain_sums, runtime_sums, fused, fuse = [], [], [], []
    per_expert_plain: dict[str, list[float]] = {e.info.name: [] for e in experts}
    per_expert_runtime: dict[str, list[float]] = {e.info.name: [] for e in experts}
    for r in range(rounds):
        logger.info("step benchmark round %d/%d", r + 1, rounds)
        times = [plain_forward_ms(e, prompts[i], steps) for i, e in enumerate(experts)]
        for e, t in zip(experts, times):
            per_expert_plain[e.info.name].append(t)
        plain_sums.append(sum(times))
        own = [runtime_step_ms(e, prompts[i], steps) for i, e in enumerate(experts)]
        for e, t in zip(experts, own):
            per_expert_runtime[e.info.name].append(t)
        runtime_sums.append(sum(own))
        step_ms, fuse_ms, _ = fused_step_ms(service, steps)
        fused.append(step_ms)
        fuse.append(fuse_ms)
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
    slowest = max(statistics.median(values) for values in per_expert_plain.values())
    report.add("fused_step_over_slowest_forward", fused_ms / slowest,
               f"fused step / slowest expert's plain forward: {fused_ms / slowest:.3f}  (goal on a GPU, experts "
               "overlapped: <= 1.10)")
    slowest_own = max(statistics.median(values) for values in per_expert_runtime.values())
    report.add("fused_step_over_slowest_runtime_step", fused_ms / slowest_own,
               f"fused step / slowest expert's own runtime decode step ({slowest_own:.1f} ms): "
               f"{fused_ms / slowest_own:.3f}  (goal on a GPU, separate models: <= 1.5)")
    runtime_sum = statistics.median(runtime_sums)
    report.add("fused_step_over_sum_of_runtime_steps", fused_ms / runtime_sum,
               f"fused step / sum of the experts' own runtime decode steps ({runtime_sum:.1f} ms, each expert's "
               f"decode path): {fused_ms / runtime_sum:.3f}")
    report.add("fusion_sampling_ms", fuse_ms, f"fusion + sampling: {fuse_ms:.2f} ms at vocabulary "
               f"{service.engine.vocab_size}")
    report.add("fusion_sampling_over_one_forward", fuse_ms / one_forward,
               f"fusion + sampling / one forward ({experts[0].info.name}): {fuse_ms / one_forward:.4f}  "
               "(goal <= 0.02)")


def _bench_shared_base_step(service: FusionService, report: BenchReport, steps: int, rounds: int) -> None:
    """Experts that are adapters over one base: the fused step (their rows in one batch, fusion, sampling)
    against one plain forward of the base, transformers' own and this runtime's decode step, per round
    side by side."""
    index, base = plain_experts(service)[0]
    prompt = _prompt_ids(service)[index]
    fused, fuse, plain, runtime = [], [], [], []
    for r in range(rounds):
        logger.info("step benchmark round %d/%d", r + 1, rounds)
        plain.append(plain_forward_ms(base, prompt, steps))
        runtime.append(runtime_step_ms(base, prompt, steps))
        step_ms, fuse_ms, _ = fused_step_ms(service, steps)
        fused.append(step_ms)
        fuse.append(fuse_ms)
    fused_ms, fuse_ms = statistics.median(fused), statistics.median(fuse)
    plain_ms, runtime_ms = statistics.median(plain), statistics.median(runtime)
    n = len(service.engine.experts)
    report.add("plain_forward_ms.base", plain_ms, f"plain decode forward of the shared base: {plain_ms:.1f} ms")
    report.add("runtime_step_ms.base", runtime_ms, f"the runtime's decode step of the base alone: {runtime_ms:.1f} ms")
    report.add("fused_step_ms", fused_ms, f"fused decode step ({n} experts over one base): {fused_ms:.1f} ms")
    report.add("fused_step_over_base_step", fused_ms / runtime_ms,
               f"fused step / the base's own decode step: {fused_ms / runtime_ms:.3f}  (goal <= 1.2; {n} separate "
               f"models would cost about {n})")
    report.add("fused_step_over_plain_forward", fused_ms / plain_ms,
               f"fused step / one plain transformers forward of the base: {fused_ms / plain_ms:.3f}")
    report.add("fusion_sampling_ms", fuse_ms, f"fusion + sampling: {fuse_ms:.2f} ms at vocabulary "
               f"{service.engine.vocab_size}")


def _bench_cross_step(service: FusionService, report: BenchReport, steps: int, rounds: int) -> None:
    """The text step's figures: each round's ratios (its timings interleaved step by step), then their
    median across rounds."""
    logger.info("text step benchmark: %d rounds of %d steps", rounds, steps)
    results = cross_step_rounds(service, steps, rounds)
    names = [e.info.name for e in service.engine.experts if isinstance(e, LocalExpert)]
    for name in names:
        ms = statistics.median(r[f"plain.{name}"] for r in results)
        report.add(f"plain_forward_ms.{name}", ms, f"plain decode forward, {name}: {ms:.1f} ms")
    fused_ms = statistics.median(r["fused"] for r in results)
    report.add("cross_step_ms", fused_ms, f"fused text step ({len(names)} experts, different tokenizers): "
               f"{fused_ms:.1f} ms")
    over_plain = [r["fused"] / sum(r[f"plain.{n}"] for n in names) for r in results]
    report.add("cross_step_over_sum_of_forwards", statistics.median(over_plain),
               f"fused text step / sum of plain forwards: {statistics.median(over_plain):.3f}  (goal <= 1.15; "
               f"rounds {', '.join(f'{x:.3f}' for x in over_plain)})")
    over_runtime = [r["fused"] / r["runtime"] for r in results]
    runtime_ms = statistics.median(r["runtime"] for r in results)
    report.add("cross_step_over_sum_of_runtime_steps", statistics.median(over_runtime),
               f"fused text step / sum of the experts' own runtime decode steps ({runtime_ms:.1f} ms, each "
               f"expert's decode path): {statistics.median(over_runtime):.3f}")
    rows = statistics.mean(r["lookahead_rows"] for r in results)
    report.add("cross_lookahead_rows", rows, f"ids per lookahead forward: {rows:.2f}")


def read_bandwidth_gbs(device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 7) -> float:
    """Memory read bandwidth, GB/s: the best of `repeats` sums over a buffer far larger than the caches
    (the best, since the floor it gives is a bound)."""
    device = torch.device(device)
    buffer = torch.ones(megabytes * 2**20 // 4, device=device)  # touched, so its pages are real
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.sum().item()
        best = min(best, time.perf_counter() - start)
    del buffer
    return megabytes * 2**20 / best / 1e9


def bench_decode(service: FusionService, report: BenchReport, steps: int = 16, rounds: int = 3,
                 static: bool = True) -> None:
    """The first local expert's decode step against the hardware floor (its weights' bytes / the read
    bandwidth measured in this run): transformers' eager forward, the eager fast step (fusion.forward.llama)
    and, with `static`, the static-shape step over KV slots (fusion.forward.static_step: on CUDA its captured
    graphs, with the capture's seconds; on a CPU eagerly), timed in alternation on the same history."""
    index, expert = plain_experts(service)[0]
    reason = unsupported_reason(expert.model)
    if reason is not None:
        logger.warning("decode suite: %s has no fast decode step (%s)", expert.info.name, reason)
        return
    prompt = _prompt_ids(service)[index]
    figures = run_on_compute_thread(_decode_paths, expert, prompt, steps, rounds, static)
    name = expert.info.name
    floor = figures["floor_ms"]
    report.add("read_bandwidth_gbs", figures["bandwidth_gbs"],
               f"read bandwidth ({expert.device}): {figures['bandwidth_gbs']:.1f} GB/s; {name}'s weights "
               f"{figures['weights_mb']:.0f} MB -> floor {floor:.1f} ms per decode step")
    for path in ("transformers", "fast", "static"):
        if path in figures["decode_ms"]:
            ms = figures["decode_ms"][path]
            report.add(f"decode_ms.{path}", ms, f"decode step, {name}, {path}: {ms:.1f} ms = {ms / floor:.2f}x the "
                       "floor" + ("  (goal <= 2x)" if path != "transformers" else ""))
    for path in ("fast", "static"):
        if path in figures["decode_ms"]:
            ratio = figures["decode_ms"][path] / figures["decode_ms"]["transformers"]
            report.add(f"decode_{path}_over_transformers", ratio,
                       f"decode step {path} / transformers' eager: {ratio:.3f}")
    best = min(figures["decode_ms"].values())
    report.add("decode_step_over_floor", best / floor, f"best decode step / bandwidth floor: {best / floor:.2f}")
    if "capture_s" in figures:
        report.add("capture_s", figures["capture_s"],
                   f"capturing {name}'s static step ({figures['graphs']} CUDA graphs): {figures['capture_s']:.1f} s")


def _decode_paths(expert: LocalExpert, prompt: list[int], steps: int, rounds: int, static: bool) -> dict:
    from transformers import DynamicCache

    model, device = expert.model, expert.device
    decoder = expert._fast_step.decoder if expert._fast_step is not None else FastDecoder(model)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    figures: dict[str, Any] = {"weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6}
    figures["bandwidth_gbs"] = read_bandwidth_gbs(device)
    figures["floor_ms"] = figures["weights_mb"] / figures["bandwidth_gbs"]  # MB / (GB/s) = ms
    paths: dict[str, DecodeStep | StaticStep | None] = {"transformers": None, "fast": DecodeStep(model, decoder)}
    ids = torch.tensor([prompt], device=device)
    token = len(prompt) % 100 + 1
    with torch.no_grad():
        if static:  # one slot (and scratch), wide enough for every round's steps
            paths["static"] = StaticStep(decoder, KVSlots(decoder, 2, len(prompt) + steps + 8), max_batch=1)
        caches, slot = {}, None
        for path in paths:
            caches[path] = DynamicCache(config=model.config) if path == "transformers" else new_cache(model.config)
            model(input_ids=ids, cache=caches[path], use_cache=True, logits_to_keep=1)
        if static:
            slot = paths["static"].slots.claim(caches["static"])
            if device.type == "cuda":
                figures["capture_s"], figures["graphs"] = paths["static"].capture(), paths["static"].captured
        timings: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(rounds):
            for path, step in paths.items():
                cache = caches[path]
                times = []
                for i in range(steps + 2):
                    start = time.perf_counter()
                    if step is None:
                        model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True,
                              logits_to_keep=1)
                    elif path == "static":  # writes column len(prompt) + i of its slot; the cache's mark stays
                        step([token], [len(prompt) + i], [slot])
                    else:
                        decode_on_layers(step, cache.layers, [token], [len(prompt) + i])
                    sync()
                    times.append(time.perf_counter() - start)
                if path != "static":
                    cache.crop(-(steps + 2))  # back to the prompt: every round decodes the same positions
                timings[path].append(statistics.mean(times[2:]) * 1e3)
    figures["decode_ms"] = {path: statistics.median(values) for path, values in timings.items()}
    return figures


def clear_kept_prefixes(service: FusionService) -> None:
    """Forget the in-process experts' kept prefixes (`fusion.experts.prefix_pool`): a stream timed after this reads
    its whole prompt, as a plain engine it is compared with does, instead of starting from the columns the
    round before left."""
    for expert in service.engine.experts:
        pool = getattr(getattr(expert, "shared_base", expert), "prefixes", None)
        if pool is not None:
            pool.clear()


def bench_generate(service: FusionService, report: BenchReport, max_tokens: int = 48, rounds: int = 3,
                   cache_implementation: str | None = None) -> None:
    """Fused single-stream tokens/s against each expert's plain transformers `generate`. Each round
    times the fused request and then every plain `generate` once; a ratio is the median over rounds of
    the same round's two rates, so drift in machine load hits both alike. `cache_implementation="static"`:
    `generate` with transformers' static cache, which it compiles itself on a GPU (the warm-up round pays
    the compilation)."""
    from transformers import GenerationConfig

    prompts = _prompt_ids(service)
    request = FusionRequest(BENCH_PROMPT, {"max_tokens": max_tokens, "ignore_eos": True})
    list(service.submit(request))  # warm-up
    experts = plain_experts(service)
    gen_config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=0, cache_implementation=cache_implementation)
    suffix = f"_{cache_implementation}_cache" if cache_implementation else ""

    def timed_generate(expert: LocalExpert, ids: torch.Tensor) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            out = expert.model.generate(ids, generation_config=gen_config)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)

    inputs = {e.info.name: torch.tensor([prompts[i]], device=e.device) for i, e in experts}
    for _, expert in experts:  # warm-up
        run_on_compute_thread(timed_generate, expert, inputs[expert.info.name])
    fused_rates: list[float] = []
    plain_rates: dict[str, list[float]] = {e.info.name: [] for _, e in experts}
    for _ in range(rounds):
        clear_kept_prefixes(service)  # plain `generate` reads the prompt every round
        start = time.perf_counter()
        n = sum(1 for _ in service.submit(request))  # the front door: admission, scheduler, text
        fused_rates.append(n / (time.perf_counter() - start))
        for _, expert in experts:
            plain_rates[expert.info.name].append(run_on_compute_thread(timed_generate, expert,
                                                                       inputs[expert.info.name]))
    fused_tps = statistics.median(fused_rates)
    report.add(f"fused_tokens_per_s{suffix}", fused_tps, f"fused generation: {fused_tps:.1f} tokens/s")
    for name, rates in plain_rates.items():
        tps = statistics.median(rates)
        ratio = statistics.median(f / p for f, p in zip(fused_rates, rates))
        kind = f" ({cache_implementation} cache)" if cache_implementation else ""
        report.add(f"generate_tokens_per_s{suffix}.{name}", tps,
                   f"plain generate{kind}, {name}: {tps:.1f} tokens/s; fused / plain = {ratio:.3f} (median of "
                   f"{rounds} rounds)")
        report.figures[f"fused_over_generate{suffix}.{name}"] = ratio


def _concurrency_round(service: FusionService, level: int, max_tokens: int) -> tuple[float, list[float]]:
    """`level` sessions through the service at once: (aggregate tokens/s, inter-token gaps in s). Each
    level's sessions read their whole prompts (not the columns the level before kept), so that levels and
    runs compare."""
    clear_kept_prefixes(service)
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
    _, expert = plain_experts(service)[0]
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

    from fusion.experts.expert import StepRequest

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
    sampling = sampling or {"temperature": 0.8, "top_p": 0.9}
    fused_rows = run_on_compute_thread(_fused_distributions, service, sessions, steps, sampling)
    ours, full, fits = run_on_compute_thread(_sampling_times, fused_rows, SamplingParams(**sampling))
    ours_ms, full_ms = statistics.median(ours) * 1e3, statistics.median(full) * 1e3
    share = sum(fits) / len(fits) if fits else 1.0
    report.add("sampling_ms", {"sample": ours_ms, "full_sort": full_ms, "candidates_fit": share},
               f"sampling {sampling}, {sessions} rows: {ours_ms:.2f} ms, full sort {full_ms:.2f} ms; "
               f"{share:.0%} of rows fit among {sampler.CANDIDATES} candidates")
    report.add("sampling_over_full_sort", ours_ms / full_ms, f"sampling / full-sort sampling: {ours_ms / full_ms:.3f}")


def _sampling_times(fused_rows: list[torch.Tensor], params: SamplingParams
                    ) -> tuple[list[float], list[float], list[bool]]:
    """On the compute thread (as the engine samples): `sample` and the full-sort path timed in
    alternation on each step's fused rows, and whether each row's nucleus fit among the candidates."""
    ours, full, fits = [], [], []
    for fused in fused_rows:  # (B, V) each
        md = sampler.SamplingMetadata.build([params] * fused.shape[0], fused.shape[-1], {}, fused.device)
        scaled = fused / md.temperature[:, None]
        for timings, run in ((ours, lambda: sampler.sample(fused, md)),
                             (full, lambda: sampler._sample_full(scaled, md))):
            start = time.perf_counter()
            run()
            timings.append(time.perf_counter() - start)
        if not (md.no_top_k and md.no_top_p):
            fits.extend(sampler._candidates(scaled, md)[2].tolist())
    return ours, full, fits


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


# A schema whose answers run long (at least 64 items), so a timed step is always inside the grammar.
LONG_JSON = {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
             "minItems": 64}


def bench_structured(service: FusionService, report: BenchReport, steps: int = 24, rounds: int = 3,
                     levels: tuple[int, ...] = (1, 8)) -> None:
    """The grammar mask's cost (fusion.fuse.structured): the fused decode step of `level` requests under a JSON
    Schema against the same requests free, in alternating rounds (machine drift hits both alike)."""
    if service.cross is not None:
        logger.warning("structured suite: experts of different tokenizers take no grammar")
        return
    for level in levels:
        free, constrained = [], []
        for r in range(rounds):
            logger.info("structured benchmark, %d sessions, round %d/%d", level, r + 1, rounds)
            for structured, times in ((None, free), ({"json_schema": LONG_JSON}, constrained)):
                times.append(_structured_step_ms(service, steps, level, structured))
        ratio = statistics.median(c / f for c, f in zip(constrained, free))
        report.add(f"structured_step_over_free.{level}", ratio,
                   f"fused step under a JSON Schema / free, {level} sessions: {ratio:.3f}  (goal <= 1.05; "
                   f"{statistics.median(constrained):.1f} against {statistics.median(free):.1f} ms)")


def _structured_step_ms(service: FusionService, steps: int, rows: int, structured: dict | None) -> float:
    batch = warm_decode_batch(service, steps, rows=rows, structured=structured)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            batch.step()
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        batch.cancel_all()


def bench_memory(service: FusionService, report: BenchReport) -> None:
    """Weights held per loaded model: an expert's own, or once for experts sharing a base (with their
    adapters' stacked matrices)."""
    seen = set()
    for expert in service.engine.experts:
        loaded = getattr(expert, "shared_base", expert)
        if not isinstance(loaded, LocalExpert) or id(loaded) in seen:
            continue
        seen.add(id(loaded))
        tensors = {p.data_ptr(): p for p in loaded.model.parameters()}  # each storage once (tied embeddings)
        multi = getattr(loaded, "multi", None)
        if multi is not None:  # the adapters' stacked matrices
            tensors.update({b.data_ptr(): b for m in loaded.model.modules() if type(m).__name__ == "AdapterStack"
                            for b in m.buffers()})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        report.add(f"weights_mb.{loaded.info.name}", size / 2**20,
                   f"weights, {loaded.info.name}: {size / 2**20:.1f} MiB ({loaded.info.dtype})")


def plot(figures: dict[str, Any], path) -> None:
    """A PNG: throughput ratio and inter-token latency per concurrency level, and the overhead ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(k.split(".")[1]) for k in figures if k.startswith("concurrency."))
    labels = {"fused_step_over_sum_of_forwards": "fused step\n/ sum of\nforwards",
              "fusion_sampling_over_one_forward": "fusion +\nsampling /\none forward",
              "decode_step_over_floor": "decode step\n/ bandwidth\nfloor",
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
