"""Isolation under hostile load, on loopback: do well-behaved streams notice?

Two experts of SmolLM2-135M's shape (random weights, `--layers` layers, a 49,152-id vocabulary, bf16)
run as `fusion serve-expert` subprocesses: expert `a` on three replicas, expert `b` on one. A
`fusion serve` coordinator (API keys on) fuses them. Two phases of `--duration` seconds each:

    quiet    `--clients` well-behaved clients stream (key `good`, no limits), nothing else
    hostile  the same clients, while other clients send, in a loop: 1,000 stop strings of 4 KB, a
             64 MiB prompt, requests that outgrow an expert's context, unknown router names and
             router paths, Score of a 60,000-character continuation, and wrong secrets for a known
             key id at a high rate; a third into the phase one replica of `a` is killed (SIGKILL),
             half-way another is black-holed (SIGSTOP: its connections stay open, nothing answers)

Printed (and written with `--json`): errors seen by well-behaved clients (goal 0), their p95
inter-token latency hostile / quiet (goal <= 1.5), what the hostile requests got, the coordinator's
RSS growth over `--rss-tokens` tokens streamed on a key without limits, after a warm-up (goal
< 20 MB), and the sessions left on the live expert replicas after the run (goal 0; releases that
failed while a replica was black-holed are retried with backoff, so this waits for them, up to 2 min).
The hostile clients run in a process of their own, so the measuring clients never wait for their GIL.

    .venv/bin/python benchmarks/hostile_load.py [--duration 60] [--clients 8] [--rss-tokens 100000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import yaml

from services.client import FusionClient
from services.protos import EXPERT_SERVICE, FUSION_SERVICE, expert_pb2, fusion_pb2
from services.security import EXPERT_SECRET_HEADER, create_key

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import build_expert  # noqa: E402

PROMPTS = ["the quick brown fox", "count to ten: 1 2 3", "what is 12 + 30 ?", "the lazy dog jumps over"]


def start(args: list[str], env: dict) -> tuple[subprocess.Popen, int]:
    """A `fusion` subprocess; its bound port, read from the line it prints when serving."""
    proc = subprocess.Popen([sys.executable, "-m", "fusion.tools.cli", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        match = re.search(r"serving on \S+:(\d+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep draining
            return proc, int(match.group(1))
    raise RuntimeError(f"{args[0]} exited with {proc.wait()}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class GoodClient(threading.Thread):
    """Streams short answers back to back; records inter-token gaps and any error."""

    def __init__(self, address: str, key: str, index: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.client = FusionClient(address, api_key=key, timeout=120)
        self.index, self.stop = index, stop
        self.gaps: list[float] = []
        self.errors: list[str] = []
        self.tokens = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = PROMPTS[(self.index + n) % len(PROMPTS)]
            try:
                last = None
                for event in self.client.generate(prompt, {"max_tokens": 24, "temperature": 0.8,
                                                           "seed": self.index * 1000 + n, "ignore_eos": True}):
                    now = time.perf_counter()
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now
                    self.tokens += 1
            except Exception as err:  # what a well-behaved client must never see
                self.errors.append(f"{type(err).__name__}: {str(err)[:160]}")
        self.client.close()


def hostile_requests(address: str, key: str, stop: threading.Event, outcomes: Counter, kind: str) -> None:
    """One hostile client: the same kind of abuse in a loop, each answer's status counted. Payloads are
    serialised once, so the load is the server's work, not this client's."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 80 * 1024 * 1024)])
    generate = channel.unary_stream(f"/{FUSION_SERVICE}/Generate")
    score = channel.unary_unary(f"/{FUSION_SERVICE}/Score")
    describe = channel.unary_unary(f"/{FUSION_SERVICE}/Describe")
    auth = [("authorization", f"Bearer {key}")]
    sampling = fusion_pb2.SamplingParams
    payloads = {
        "stop_strings": lambda: fusion_pb2.GenerateRequest(prompt="hi", sampling=sampling(stop=["x" * 4096] * 1000)),
        "64MiB_prompt": lambda: fusion_pb2.GenerateRequest(prompt="y" * (64 * 1024 * 1024)),
        "outgrows_context": lambda: fusion_pb2.GenerateRequest(prompt="the quick brown fox " * 300,
                                                               sampling=sampling(max_tokens=8000)),
        "bad_router": lambda: fusion_pb2.GenerateRequest(prompt="hi", spec=fusion_pb2.FusionSpec(
            rule="route", params={"router": "nope"})),
        "router_path": lambda: fusion_pb2.GenerateRequest(prompt="hi", spec=fusion_pb2.FusionSpec(
            rule="route", params={"path": "/etc/passwd"})),
        "long_score": lambda: fusion_pb2.ScoreRequest(prompt="hi", continuation="the cat " * 7500),
    }
    payload = payloads[kind]().SerializeToString() if kind in payloads else b""
    while not stop.is_set():
        try:
            if kind == "wrong_keys":
                for i in range(50):
                    try:
                        describe(b"", timeout=10, metadata=[("authorization", f"Bearer fsk_good_wrong{time.time_ns()}{i}")])
                    except grpc.RpcError as err:
                        outcomes[(kind, err.code().name)] += 1
                time.sleep(0.05)
                continue
            if kind == "long_score":
                score(payload, metadata=auth, timeout=60)
            else:
                for _ in generate(payload, metadata=auth, timeout=60):
                    pass
            outcomes[(kind, "OK")] += 1
        except grpc.RpcError as err:
            outcomes[(kind, err.code().name)] += 1
        time.sleep(0.05)
    channel.close()


HOSTILE_KINDS = ["stop_strings", "64MiB_prompt", "outgrows_context", "bad_router", "router_path", "long_score",
                 "wrong_keys"]


def hostile_process(address: str, key: str, duration: float, results) -> None:
    """Every hostile client, in a process of its own (so its threads never hold the measuring
    clients' GIL); puts the outcome counts on `results`."""
    stop = threading.Event()
    outcomes: Counter = Counter()
    threads = [threading.Thread(target=hostile_requests, args=(address, key, stop, outcomes, kind), daemon=True)
               for kind in HOSTILE_KINDS]
    for thread in threads:
        thread.start()
    time.sleep(duration)
    stop.set()
    for thread in threads:
        thread.join(120)
    results.put(dict(outcomes))


def phase(address: str, keys: dict, duration: float, clients: int, hostile: bool,
          replicas: list[subprocess.Popen]) -> dict:
    stop = threading.Event()
    good = [GoodClient(address, keys["good"], i, stop) for i in range(clients)]
    others = []
    results = multiprocessing.get_context("spawn").Queue()
    if hostile:
        others = [multiprocessing.get_context("spawn").Process(
            target=hostile_process, args=(address, keys["hostile"], duration, results), daemon=True)]
    for worker in good + others:
        worker.start()
    faults = []
    started = time.monotonic()
    while time.monotonic() - started < duration:
        elapsed = time.monotonic() - started
        if hostile and not faults and elapsed > duration / 3:
            replicas[1].send_signal(signal.SIGKILL)
            faults.append(f"killed a replica at {elapsed:.0f} s")
        if hostile and len(faults) == 1 and elapsed > duration / 2:
            replicas[2].send_signal(signal.SIGSTOP)
            faults.append(f"black-holed a replica at {elapsed:.0f} s")
        time.sleep(0.2)
    stop.set()
    outcomes = results.get(timeout=300) if hostile else {}
    for worker in good + others:
        worker.join(180)
    gaps = sorted(g for c in good for g in c.gaps)
    return {
        "tokens": sum(c.tokens for c in good),
        "errors": [e for c in good for e in c.errors],
        "p50_itl_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "p95_itl_ms": 1000 * gaps[int(0.95 * (len(gaps) - 1))] if gaps else float("nan"),
        "hostile_outcomes": {f"{k}:{c}": n for (k, c), n in sorted(outcomes.items())},
        "p99_itl_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else float("nan"),
        "max_itl_ms": 1000 * gaps[-1] if gaps else float("nan"),
        "faults": faults,
    }


def rss_growth(address: str, key: str, pid: int, tokens: int, clients: int) -> dict:
    """Coordinator RSS after a warm-up and after `tokens` more tokens on a key without limits."""
    stop = threading.Event()
    good = [GoodClient(address, key, i, stop) for i in range(clients)]
    for thread in good:
        thread.start()
    warm = max(2000, tokens // 20)
    while sum(c.tokens for c in good) < warm:
        time.sleep(0.5)
    before, counted = rss_mb(pid), sum(c.tokens for c in good)
    started = time.monotonic()
    last = 0
    while sum(c.tokens for c in good) - counted < tokens:
        done = sum(c.tokens for c in good) - counted
        if done - last >= tokens // 10:
            print(f"  rss: {done}/{tokens} tokens, {rss_mb(pid):.1f} MB", file=sys.stderr, flush=True)
            last = done
        time.sleep(0.5)
    after = rss_mb(pid)
    stop.set()
    for thread in good:
        thread.join(120)
    return {"tokens": sum(c.tokens for c in good) - counted, "rss_before_mb": before, "rss_after_mb": after,
            "growth_mb": after - before, "seconds": time.monotonic() - started,
            "errors": [e for c in good for e in c.errors]}


def sessions_left(ports: list[int]) -> dict[int, int]:
    left = {}
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = channel.unary_unary(f"/{EXPERT_SERVICE}/Info", response_deserializer=expert_pb2.ExpertInfo.FromString)
            left[port] = info(b"", metadata=[(EXPERT_SECRET_HEADER, "bench-secret")], timeout=10).active_sessions
    return left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="Seconds of each phase.")
    parser.add_argument("--clients", type=int, default=8, help="Well-behaved streaming clients.")
    parser.add_argument("--layers", type=int, default=2, help="Layers of each synthetic expert.")
    parser.add_argument("--rss-tokens", type=int, default=100_000, help="Tokens of the RSS phase (0: skip).")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args()

    env = {**os.environ, "FUSION_BENCH_SECRET": "bench-secret", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("building two synthetic experts ...", file=sys.stderr, flush=True)
        models = {name: build_expert(root / name, args.layers) for name in ("a", "b")}
        keys_file = root / "keys.yaml"
        keys = {"good": create_key(keys_file, "good"), "hostile": create_key(keys_file, "hostile")}
        config = {
            "experts": [{"name": n, "model": str(p), "dtype": "bfloat16", "chat_template": False}
                        for n, p in models.items()],
            "fusion": {"rule": "mixture"},
            "sampling": {"max_tokens": 24},
            "limits": {"max_tokens": 8192, "max_concurrent_sessions": 32, "max_batch_size": 16},
            "security": {"expert_secret_env": "FUSION_BENCH_SECRET", "api_keys_file": str(keys_file)},
        }
        expert_config = root / "experts.yaml"
        expert_config.write_text(yaml.safe_dump(config))
        try:
            replicas, ports = [], {}
            for name, count in (("a", 3), ("b", 1)):
                for _ in range(count):
                    proc, port = start(["serve-expert", "--config", str(expert_config), "--expert", name, "--port", "0",
                                        "--host", "127.0.0.1"], env)
                    procs.append(proc)
                    ports.setdefault(name, []).append(port)
                    if name == "a":
                        replicas.append(proc)
            for expert in config["experts"]:
                expert["addresses"] = [f"127.0.0.1:{p}" for p in ports[expert["name"]]]
            coordinator_config = root / "coordinator.yaml"
            coordinator_config.write_text(yaml.safe_dump(config))
            coordinator, port = start(["serve", "--config", str(coordinator_config), "--port", "0",
                                       "--host", "127.0.0.1"], env)
            procs.append(coordinator)
            address = f"127.0.0.1:{port}"
            results: dict = {"duration_s": args.duration, "clients": args.clients, "layers": args.layers}
            if args.rss_tokens:
                print(f"rss: {args.rss_tokens} tokens on a key without limits ...", file=sys.stderr, flush=True)
                results["rss"] = rss_growth(address, keys["good"], coordinator.pid, args.rss_tokens, args.clients)
            print("quiet phase ...", file=sys.stderr, flush=True)
            results["quiet"] = phase(address, keys, args.duration, args.clients, False, replicas)
            print("hostile phase ...", file=sys.stderr, flush=True)
            results["hostile"] = phase(address, keys, args.duration, args.clients, True, replicas)
            replicas[2].send_signal(signal.SIGCONT)  # the black-holed replica answers again
            live = [p for name, ps in ports.items() for p in ps if not (name == "a" and ps.index(p) == 1)]
            resumed = time.monotonic()
            left = sessions_left(live)
            while any(left.values()) and time.monotonic() - resumed < 120:  # failed releases are retried
                time.sleep(2)
                left = sessions_left(live)
            results["sessions_left"] = left
            results["sessions_freed_after_s"] = round(time.monotonic() - resumed, 1)
            results["coordinator_alive"] = coordinator.poll() is None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    quiet, hostile = results["quiet"], results["hostile"]
    ratio = hostile["p95_itl_ms"] / quiet["p95_itl_ms"]
    print(f"well-behaved clients ({args.clients}, {args.duration:.0f} s per phase):")
    print(f"  quiet:   {quiet['tokens']} tokens, p50 {quiet['p50_itl_ms']:.1f} ms, p95 {quiet['p95_itl_ms']:.1f} ms, "
          f"errors {len(quiet['errors'])}")
    print(f"  hostile: {hostile['tokens']} tokens, p50 {hostile['p50_itl_ms']:.1f} ms, "
          f"p95 {hostile['p95_itl_ms']:.1f} ms, errors {len(hostile['errors'])} {hostile['errors'][:3]}")
    print(f"  p99 / max gap: quiet {quiet['p99_itl_ms']:.0f} / {quiet['max_itl_ms']:.0f} ms, "
          f"hostile {hostile['p99_itl_ms']:.0f} / {hostile['max_itl_ms']:.0f} ms")
    print(f"  p95 inter-token latency hostile / quiet: {ratio:.2f} (goal <= 1.5)")
    print(f"  faults: {hostile['faults']}")
    print(f"hostile requests: {hostile['hostile_outcomes']}")
    if "rss" in results:
        rss = results["rss"]
        print(f"coordinator RSS over {rss['tokens']} tokens (key without limits): {rss['rss_before_mb']:.1f} -> "
              f"{rss['rss_after_mb']:.1f} MB, growth {rss['growth_mb']:.1f} MB (goal < 20)")
    print(f"sessions left on live expert replicas: {results['sessions_left']} (goal 0), "
          f"{results['sessions_freed_after_s']} s after the black-holed replica resumed; "
          f"coordinator alive: {results['coordinator_alive']}")
    results["p95_ratio"] = ratio
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
