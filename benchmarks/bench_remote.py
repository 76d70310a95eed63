"""Remote against local expert step time, and bytes on the wire per step, measured side by side.

An expert of SmolLM2-135M's shape (LlamaForCausalLM: hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49,152; random weights, bf16) is built in a temporary folder with a
tokenizer, loaded here as a `LocalExpert` and served by `fusion serve-expert` in a subprocess. In
interleaved rounds, each of a few sessions is prefilled, then decoded step by step:

    local   LocalExpert.step in this process
    remote  RemoteExpert.step → gRPC over loopback → the expert server (logits as raw bytes)

Printed: median per-step time of each, the median of the paired step-time ratios, the request/response bytes of one step, and
whether the remote logits equal the local ones. Optionally `--soak N` also runs the end-to-end
concurrency soak of the test suite for N seconds (16 clients through a coordinator).

    .venv/bin/python benchmarks/bench_remote.py [--steps 32] [--rounds 3] [--batch 1,4] [--device cuda]
                                                [--json FILE]

With `--device cuda` the expert and its server share the GPU (the GPU check runs it at 1, 8 and 32
sessions): the ratio is what the wire costs a remote expert over one co-located.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from fusion.config import ExpertConfig, parse_config
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.services.protos import expert_pb2
from fusion.services.remote_expert import RemoteExpert
from fusion.services.wire import encode_tensor

from synthetic import build_expert  # noqa: E402  (benchmarks/ is on sys.path when run)


def serve_expert(config_path: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion.tools.cli", "serve-expert", "--config", str(config_path), "--expert", "smol",
         "--port", "0", "--host", "127.0.0.1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    for line in proc.stderr:
        match = re.search(r"serving on \S+:(\d+)", line)
        if match:
            return proc, int(match.group(1))
    raise RuntimeError(f"expert server exited with {proc.wait()}")


def paired_steps(experts: dict, prompts: list[list[int]], steps: int, tag: str):
    """Prefill every session on every expert, then `steps` batched decode steps, the experts taking
    turns at each step (so a noisy moment hits both sides). Per-expert step seconds, and each
    expert's largest logit difference from the first one's."""
    histories = {name: [list(p) for p in prompts] for name in experts}
    sessions = {name: [f"{tag}-{name}-{i}" for i in range(len(prompts))] for name in experts}
    times: dict[str, list[float]] = {name: [] for name in experts}
    diff: dict[str, float] = {name: 0.0 for name in experts}
    for name, expert in experts.items():
        expert.step([StepRequest(s, h) for s, h in zip(sessions[name], histories[name])])  # prefill
    for _ in range(steps):
        reference = None
        for name, expert in experts.items():
            requests = [StepRequest(s, h) for s, h in zip(sessions[name], histories[name])]
            start = time.perf_counter()
            logits = expert.step(requests)  # (B, V)
            times[name].append(time.perf_counter() - start)
            reference = logits if reference is None else reference
            diff[name] = max(diff[name], float((logits - reference).abs().max()))
            for history, token in zip(histories[name], logits.argmax(-1).tolist()):
                history.append(token)
    for name, expert in experts.items():
        expert.release(sessions[name])
    return times, diff


def wire_bytes(prompts: list[list[int]], vocab: int, dtype: str) -> tuple[int, int]:
    """Serialized request and response sizes of one decode step at these history lengths."""
    request = expert_pb2.StepRequest(dtype=dtype, sessions=[
        expert_pb2.SessionStep(session_id=f"req-{i:016x}-{i}", token_ids=p) for i, p in enumerate(prompts)
    ])
    response = expert_pb2.StepResponse(logits=encode_tensor(torch.zeros(len(prompts), vocab), dtype))
    return request.ByteSize(), response.ByteSize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved local/remote rounds")
    parser.add_argument("--batch", default="1,4", help="sessions stepped together, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--wire", default="bfloat16,float32", help="wire dtypes to time (bfloat16 is exact here)")
    parser.add_argument("--layers", type=int, default=30, help="fewer for a quick look")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the expert (and its server) runs")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    wires = args.wire.split(",")

    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        folder = build_expert(Path(tmp) / "smol", args.layers)
        config_path = Path(tmp) / "bench.yaml"
        config_path.write_text(yaml.safe_dump({"experts": [{"name": "smol", "model": str(folder),
                                                             "dtype": "bfloat16", "device": args.device}]}))
        config = parse_config(yaml.safe_load(config_path.read_text()))
        local = LocalExpert.load(config.expert("smol"))
        env_threads = os.environ.get("OMP_NUM_THREADS")
        proc, port = serve_expert(config_path)
        try:
            remote_config = ExpertConfig(name="smol", model=str(folder), addresses=[f"127.0.0.1:{port}"])
            remotes = {w: RemoteExpert(remote_config, wire_dtype=w) for w in wires}
            vocab = local.info.vocab_size
            print(f"expert: {args.layers} layers, hidden 576, vocab {vocab}, bf16; {args.threads} threads here "
                  f"(OMP_NUM_THREADS={env_threads}); {args.steps} decode steps x {args.rounds} rounds")
            experts = {"local": local, **remotes}
            figures: dict = {"device": args.device, "vocab": vocab, "layers": args.layers, "batches": {}}
            for batch in batches:
                prompts = [[(7 * i + 3 * b) % 900 + 3 for i in range(args.prompt_tokens)] for b in range(batch)]
                times: dict[str, list[float]] = {name: [] for name in experts}
                diff: dict[str, float] = {}
                for round_ in range(args.rounds):
                    round_times, diff = paired_steps(experts, prompts, args.steps, f"b{batch}r{round_}")
                    for name in experts:
                        times[name] += round_times[name]
                local_ms = statistics.median(times["local"]) * 1e3
                print(f"\nbatch {batch}: local {local_ms:.1f} ms/step (median of {len(times['local'])})")
                for w in wires:
                    remote_ms = statistics.median(times[w]) * 1e3
                    ratio = statistics.median(r / l for r, l in zip(times[w], times["local"]))
                    sent, received = wire_bytes(prompts, vocab, w)
                    figures["batches"].setdefault(str(batch), {"local_ms": local_ms})[w] = {
                        "remote_ms": remote_ms, "remote_over_local": ratio, "max_logit_difference": diff[w]}
                    print(f"  remote, logits as {w:<8}: {remote_ms:6.1f} ms/step; remote/local {ratio:.3f} "
                          f"(median of paired steps), +{remote_ms - local_ms:.1f} ms; per step {sent:,} B sent, "
                          f"{received:,} B received; max |remote - local| logit {diff[w]:.3g}")
            for remote in remotes.values():
                remote.close()
            if args.json is not None:
                args.json.write_text(json.dumps(figures, indent=2))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
