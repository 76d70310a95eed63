"""The benchmark suites run end to end on the tiny trio and report consistent figures (timings
themselves are never asserted: they live in `fusion bench`, not in tests)."""

from __future__ import annotations

import json

from fusion import bench


def test_suites_report_ratios_and_plot(tiny_pipeline, tmp_path):
    report = bench.BenchReport()
    bench.bench_step(tiny_pipeline, report, steps=2, rounds=1)
    bench.bench_concurrency(tiny_pipeline, report, levels=(2,), max_tokens=4, rounds=2)
    bench.bench_long_context(tiny_pipeline, report, sessions=3, context=40, steps=3)
    bench.bench_sampling(tiny_pipeline, report, sessions=3, steps=3)
    bench.bench_memory(tiny_pipeline, report)
    figures = report.figures
    sampling = figures["sampling_ms"]
    assert figures["sampling_over_full_sort"] == sampling["sample"] / sampling["full_sort"]
    assert 0.0 <= sampling["candidates_fit"] <= 1.0
    long = figures["long_context_step_ms"]
    assert figures["long_context_step_over_transformers"] == long["runtime"] / long["transformers"]
    assert not any(e.cache for e in tiny_pipeline.engine.experts)  # its sessions were released
    assert figures["concurrency.1"]["ratio"] == 1.0
    two = figures["concurrency.2"]
    assert two["ratio"] > 0 and two["itl_p95_ms"] >= two["itl_p50_ms"] > 0
    assert two["itl_p95_ratio"] == two["itl_p95_ms"] / figures["concurrency.1"]["itl_p95_ms"]
    assert figures["fused_step_over_sum_of_forwards"] == figures["fused_step_ms"] / sum(
        figures[f"plain_forward_ms.{n}"] for n in tiny_pipeline.expert_names)
    assert set(figures) >= {f"weights_mb.{n}" for n in tiny_pipeline.expert_names}
    json.dumps(figures)  # what --json writes
    out = tmp_path / "bench.png"
    bench.plot(figures, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
