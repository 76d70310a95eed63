"""What the OpenAI-compatible HTTP API costs next to gRPC: the same streamed request to the same server,
side by side in one run.

One `fusion serve --http-port` process (its own process, as in production) serves two in-process experts
of SmolLM2-135M's shape (random weights, `--layers` of its 30, bf16, vocabulary 49,152). This process
streams the same greedy request (`--tokens` tokens, EOS ignored) over

    grpc   fusion.services.client.FusionClient.generate (the Fusion gRPC service)
    http   the official `openai` client, chat.completions.create(stream=True) (HTTP + server-sent events)

in interleaved rounds, and reports per transport the median time to first token (request sent to the
first token's text received) and the median time per token after it, and HTTP's ratio to gRPC for each.

    .venv/bin/python benchmarks/bench_http.py [--layers 2] [--tokens 64] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from synthetic import build_expert  # noqa: E402  (benchmarks/ is on sys.path when run)

MESSAGES = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]


def serve(config: Path) -> tuple[subprocess.Popen, int, int]:
    """`fusion serve` with both APIs on free ports: (process, gRPC port, HTTP port)."""
    proc = subprocess.Popen([sys.executable, "-m", "fusion.tools.cli", "serve", "--config", str(config), "--host",
                             "127.0.0.1", "--port", "0", "--http-port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, FUSION_CACHE_DIR=str(config.parent / "cache")))
    for line in proc.stderr:
        match = re.search(r"serving on \S+:(\d+), HTTP API on \S+:(\d+)", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, int(match.group(1)), int(match.group(2))
    raise SystemExit(f"fusion serve exited ({proc.wait()})")


def timed(request) -> tuple[float, list[float]]:
    """(time to the first token, seconds between consecutive tokens) of `request()`'s tokens, from the
    call on (an HTTP stream's response starts with its first token)."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in request()]
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (one request per transport)")
    opts = parser.parse_args()

    import openai

    from fusion.services.client import FusionClient

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_expert(root / "expert", opts.layers)
        config = root / "bench.yaml"
        experts = [{"name": name, "model": str(model), "dtype": "bfloat16"} for name in ("a", "b")]
        config.write_text(yaml.safe_dump({"experts": experts, "limits": {"max_tokens": opts.tokens}}))
        proc, grpc_port, http_port = serve(config)
        try:
            grpc_client = FusionClient(f"127.0.0.1:{grpc_port}", timeout=300)
            http_client = openai.OpenAI(api_key="none", base_url=f"http://127.0.0.1:{http_port}/v1", max_retries=0)
            sampling = {"max_tokens": opts.tokens, "ignore_eos": True}

            def over_grpc():
                return (e for e in grpc_client.generate(MESSAGES, sampling) if e.text)

            def over_http():
                stream = http_client.chat.completions.create(model="fusion", messages=MESSAGES, stream=True,
                                                             max_tokens=opts.tokens, extra_body={"ignore_eos": True})
                return (c for c in stream if c.choices and c.choices[0].delta.content)

            runs = {"grpc": over_grpc, "http": over_http}
            for run in runs.values():  # warm up: first-request costs of either path
                timed(run)
            first: dict[str, list[float]] = {name: [] for name in runs}
            per_token: dict[str, list[float]] = {name: [] for name in runs}
            for i in range(opts.rounds):
                for name in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                    ttft, gaps = timed(runs[name])
                    first[name].append(ttft)
                    per_token[name].append(statistics.median(gaps))
            grpc_client.close()
        finally:
            proc.terminate()
            proc.wait(60)

    ttft = {name: statistics.median(values) * 1e3 for name, values in first.items()}
    tpot = {name: statistics.median(values) * 1e3 for name, values in per_token.items()}
    print(f"{opts.layers} layers, {opts.tokens} tokens, {opts.rounds} interleaved rounds, medians")
    print(f"{'transport':<22}{'first token ms':>16}{'ms/token':>12}")
    for name, label in (("grpc", "gRPC stream"), ("http", "HTTP + SSE (openai)")):
        print(f"{label:<22}{ttft[name]:>16.2f}{tpot[name]:>12.2f}")
    print(f"{'HTTP / gRPC':<22}{ttft['http'] / ttft['grpc']:>15.2f}x{tpot['http'] / tpot['grpc']:>11.2f}x")


if __name__ == "__main__":
    main()
