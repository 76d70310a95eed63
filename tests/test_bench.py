"""The benchmark suites run end to end on the tiny trio and report consistent figures (timings
themselves are never asserted: they live in `fusion bench`, not in tests)."""

from __future__ import annotations

import json
import math

import pytest

from fusion.tools import bench


def test_suites_report_ratios_and_plot(tiny_service, tmp_path):
    report = bench.BenchReport()
    bench.bench_step(tiny_service, report, steps=2, rounds=1)
    bench.bench_concurrency(tiny_service, report, levels=(2,), max_tokens=4, rounds=2)
    bench.bench_long_context(tiny_service, report, sessions=3, context=40, steps=3)
    bench.bench_sampling(tiny_service, report, sessions=3, steps=3)
    bench.bench_memory(tiny_service, report)
    bench.bench_decode(tiny_service, report, steps=2, rounds=1, static=False)
    bench.bench_generate(tiny_service, report, max_tokens=3, rounds=2)
    bench.bench_structured(tiny_service, report, steps=2, rounds=1, levels=(1, 2))
    figures = report.figures
    ratios = ["sampling_over_full_sort", "long_context_step_over_transformers", "fused_step_over_sum_of_forwards",
              "fused_step_over_sum_of_runtime_steps", "decode_fast_over_transformers", "decode_step_over_floor",
              "fused_over_generate.a", "structured_step_over_free.1", "structured_step_over_free.2"]
    for name in ratios:  # each a positive, finite ratio of two timings measured side by side
        assert math.isfinite(figures[name]) and figures[name] > 0, name
    assert 0.0 <= figures["sampling_ms"]["candidates_fit"] <= 1.0
    assert not any(e.cache for e in tiny_service.engine.experts)  # its sessions were released
    assert tiny_service.active == 0  # every concurrency-round request finished through the service
    assert figures["concurrency.1"]["ratio"] == 1.0  # the baseline level against itself
    two = figures["concurrency.2"]
    assert two["ratio"] > 0 and two["itl_p95_ms"] >= two["itl_p50_ms"] > 0
    for expert in tiny_service.engine.experts:  # the weights' bytes, each storage once (tied embeddings)
        storages = {p.data_ptr(): p.numel() * p.element_size()
                    for _, p in expert.model.named_parameters(remove_duplicate=False)}
        assert figures[f"weights_mb.{expert.info.name}"] == pytest.approx(sum(storages.values()) / 2**20)
    assert figures["read_bandwidth_gbs"] > 0 and set(figures) >= {"decode_ms.transformers", "decode_ms.fast"}
    json.dumps(figures)  # what --json writes
    out = tmp_path / "bench.png"
    bench.plot(figures, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_suite_on_experts_of_different_tokenizers(tiny_dir):
    """The text step's figures: against transformers' plain forwards and the experts' own decode steps."""
    from fusion.config import parse_config
    from fusion.frontdoor.service import FusionService
    from tests.conftest import tiny_config_dict

    service = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, names=("a", "other"))))
    try:
        assert service.cross is not None
        report = bench.BenchReport()
        bench.bench_step(service, report, steps=3, rounds=1)
        figures = report.figures
        for name in ("cross_step_over_sum_of_forwards", "cross_step_over_sum_of_runtime_steps", "cross_lookahead_rows"):
            assert math.isfinite(figures[name]) and figures[name] > 0, name
        assert not any(e.cache for e in service.engine.experts)  # its sessions were released
    finally:
        service.close()


def test_suites_on_experts_sharing_a_base(tiny_dir, tmp_path):
    """Adapters over one base: the fused step is held to the base's own step (a plain copy of the base,
    loaded once), and the base's weights are counted once."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fusion.config import parse_config
    from fusion.frontdoor.service import FusionService
    from tests.conftest import tiny_config_dict

    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "a")
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
                   ).save_pretrained(tmp_path / "lora")
    data = tiny_config_dict(tiny_dir, names=("a",))
    data["experts"].append({**data["experts"][0], "name": "a_lora", "adapter": str(tmp_path / "lora")})
    service = FusionService.from_config(parse_config(data))
    try:
        report = bench.BenchReport()
        bench.bench_step(service, report, steps=2, rounds=1)
        bench.bench_decode(service, report, steps=2, rounds=1, static=False)
        bench.bench_memory(service, report)
        figures = report.figures
        for name in ("fused_step_over_base_step", "fused_step_over_plain_forward", "decode_fast_over_transformers"):
            assert math.isfinite(figures[name]) and figures[name] > 0, name
        assert [k for k in figures if k.startswith("weights_mb.")] == ["weights_mb.a+a_lora"]
        assert service.experts[0].active_sessions == 0 and service.experts[1].active_sessions == 0
    finally:
        service.close()


def test_weights_suite_reports_each_format_and_cold_starts(tiny_service, tmp_path):
    """Dense, int8 and int4 steps of the first expert side by side, their ratios, and a fresh `fusion
    generate` process per format; llama.cpp's figures need a GGUF beside the model (none here)."""
    from fusion.tools.bench_weights import bench_weights, gguf_beside

    report = bench.BenchReport()
    bench_weights(tiny_service, report, steps=2, rounds=1, tokens=3, cache_dir=tmp_path)
    figures = report.figures
    assert {f"weights.decode_ms.{w} fast" for w in ("dense", "int8", "int4")} <= set(figures)
    for name in ("weights.int8 fast_over_dense", "weights.int4 fast_over_dense", "weights.cold_start_int4_over_dense"):
        assert math.isfinite(figures[name]) and figures[name] > 0, name
    for weights in ("dense", "int4"):
        start = figures[f"weights.cold_start_s.{weights}"]
        assert 0 < start["first_output"] <= start["exit"]
    assert gguf_beside(tiny_service.engine.experts[0].info.model) is None
    assert not any(k.startswith("weights.llama") or "llamacpp" in k for k in figures)
    assert list((tmp_path / "compiled" / "weights").glob("*-int4-*.safetensors"))  # the processes' codes, kept
    assert not any(e.cache for e in tiny_service.engine.experts)
    json.dumps(figures)


def test_llamacpp_runs_in_a_worker_process_that_reports_why_it_cannot_load(tmp_path):
    """The weights suite's llama.cpp runs in a process of its own (its OpenMP threads never spin against the
    project's); a worker that cannot load answers with the reason, which the handle raises (ImportError where no
    binding is installed, as in CI), and leaves no process behind."""
    from pathlib import Path

    from fusion.tools.llamacpp_engine import LlamaCppProcess

    def workers() -> set[str]:
        found = set()
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if b"fusion.tools.llamacpp_engine" in cmdline.read_bytes():
                    found.add(cmdline.parent.name)
            except OSError:  # a process that ended meanwhile
                pass
        return found

    missing = tmp_path / "missing.gguf"
    started = workers()
    with pytest.raises((ImportError, RuntimeError)) as raised:
        LlamaCppProcess(missing, threads=1)
    if raised.type is RuntimeError:  # a binding is installed: it names the file it could not load
        assert str(missing) in str(raised.value)
    assert workers() == started
