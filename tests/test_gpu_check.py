"""The prepared GPU check's CPU-side logic: the script parses, refuses a machine without CUDA with a
clear message, and its Python part runs end to end (on a CPU, tiny experts) and writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_script_parses_and_documents_its_options():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shown = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for option in ("--out", "--wheels", "--cache", "--dry-run"):
        assert option in shown
    wheels = [line for line in (ROOT / "benchmarks" / "gpu_wheels.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert wheels and all("==" in line for line in wheels)


def test_script_refuses_a_machine_without_cuda(tmp_path):
    if torch.cuda.is_available():  # on a GPU machine the refusal cannot be seen; the bad argument still is
        args = ["--no-such-option"]
        expected_rc, expected = 2, "unknown argument"
    else:
        args = ["--python", sys.executable, "--out", str(tmp_path / "out"), "--dry-run"]
        expected_rc, expected = 3, "no CUDA device"
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == expected_rc
    assert expected in done.stderr


def _gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_check


def test_a_captured_build_that_fails_is_reported_and_measured_with_transformers(tmp_path, monkeypatch):
    gpu_check = _gpu_check()
    measured = []

    def measure(label, data, resolve, cache_dir, args, figures, lines):
        decodes = {e["decode"] for e in data["experts"]}
        measured.append((label, decodes))
        if decodes == {"fast"}:
            raise RuntimeError("a capture failed")
        figures[label] = {"fused_tokens_per_s": 1.0}

    monkeypatch.setattr(gpu_check, "measure", measure)
    data = {"experts": [{"name": n, "model": "m", "decode": "fast"} for n in ("a", "b")]}
    figures, lines = {}, []
    gpu_check.measure_or_eager("trio", data, None, None, None, figures, lines)
    assert measured == [("trio", {"fast"}), ("trio (decode transformers)", {"transformers"})]
    assert "RuntimeError: a capture failed" in figures["trio (captured step failed)"]["error"]
    assert any("captured step failed" in line for line in lines) and "trio (decode transformers)" in figures
    eager = {"experts": [{"name": "a", "model": "m", "decode": "transformers"}]}
    def failing(*args):
        raise RuntimeError("eager fails")

    monkeypatch.setattr(gpu_check, "measure", failing)
    with pytest.raises(RuntimeError, match="eager fails"):  # an eager build's failure is the run's
        gpu_check.measure_or_eager("trio", eager, None, None, None, {}, [])


def test_python_part_writes_figures_on_a_cpu(tmp_path):
    gpu_check = _gpu_check()
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--size", "tiny", "--decode", "fast",
                         "--steps", "2", "--max-tokens", "3", "--levels", "1", "2"])
    assert rc == 0
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    trio = figures["tiny-sized trio"]
    for key in ("fused_step_over_slowest_forward", "fused_step_over_slowest_runtime_step",
                "fused_step_over_sum_of_forwards", "decode_step_over_floor",
                "fused_tokens_per_s", "fused_tokens_per_s_static_cache", "decode_ms.static", "concurrency.2"):
        assert key in trio, key
    shared = figures["tiny-sized adapter trio (one base)"]
    for key in ("fused_step_over_base_step", "runtime_step_ms.base", "concurrency.2"):
        assert key in shared, key
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "fused step / slowest expert's plain forward" in text and "no --cache" in text


def test_the_remote_step_of_the_check_runs_on_a_cpu(tmp_path):
    """benchmarks/bench_remote.py, as the check runs it (there `--device cuda --batch 1,8,32`): a served
    expert over loopback gRPC against the same expert in-process, exactly equal logits, figures as JSON."""
    out = tmp_path / "remote.json"
    done = subprocess.run([sys.executable, "bench_remote.py", "--device", "cpu", "--layers", "1", "--steps", "2",
                           "--rounds", "1", "--batch", "1,2", "--wire", "bfloat16", "--json", str(out)],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["vocab"] == 49152 and set(figures["batches"]) == {"1", "2"}
    for batch in figures["batches"].values():
        assert batch["bfloat16"]["max_logit_difference"] == 0.0 and batch["bfloat16"]["remote_ms"] > 0
