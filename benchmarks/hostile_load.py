"""Isolation under hostile load, on loopback: do well-behaved streams notice?

`--suite tenants`: can one team starve another? Team B streams one request at a time (time to first
token, inter-token gaps) alone, then while team A runs each attack in a process of its own: 32 long
streams (exactly its key_share), 200 (most refused), 48 concurrent Scores of long continuations, and
one 4 MB chat body of 120,000 messages at a time over HTTP. Then 20 concurrent Scores on a key of 2
calls and 200 tokens a minute, /metrics' size after 10,000 random paths, /health's time with 20,000
idle connections open, the coordinator's RSS over `--rss-tokens` tokens and the sessions left.

`--suite faults` (the default):

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

from fusion.services.client import FusionClient
from fusion.services.protos import EXPERT_SERVICE, FUSION_SERVICE, expert_pb2, fusion_pb2
from fusion.services.api_keys import create_key
from fusion.services.expert_auth import EXPERT_SECRET_HEADER

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import build_expert  # noqa: E402

PROMPTS = ["the quick brown fox", "count to ten: 1 2 3", "what is 12 + 30 ?", "the lazy dog jumps over"]


def start(args: list[str], env: dict) -> tuple[subprocess.Popen, int]:
    """A `fusion` subprocess; its bound port, read from the line it prints when serving (and its HTTP
    port as `proc.http_port`, when it serves one)."""
    proc = subprocess.Popen([sys.executable, "-m", "fusion.tools.cli", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        match = re.search(r"serving on \S+:(\d+)", line)
        http = re.search(r"HTTP API on \S+:(\d+)", line)
        proc.http_port = int(http.group(1)) if http else None
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


def run_clients(work, address: str, key: str, tags: list[str], duration: float, join_s: float) -> dict:
    """One thread per tag running `work(address, key, stop, outcomes, tag)` for `duration` seconds;
    the outcome counts."""
    stop, outcomes = threading.Event(), Counter()
    threads = [threading.Thread(target=work, args=(address, key, stop, outcomes, tag), daemon=True) for tag in tags]
    for thread in threads:
        thread.start()
    time.sleep(duration)
    stop.set()
    for thread in threads:
        thread.join(join_s)
    return dict(outcomes)


def hostile_process(address: str, key: str, duration: float, results) -> None:
    """Every hostile client, in a process of its own (so its threads never hold the measuring
    clients' GIL); puts the outcome counts on `results`."""
    results.put(run_clients(hostile_requests, address, key, HOSTILE_KINDS, duration, 120))


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


# -- tenants: can one team starve another? ------------------------------------------------------------
class TeamB(threading.Thread):
    """Team B streams one request at a time; records time to first token, inter-token gaps, errors."""

    def __init__(self, address: str, key: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.client = FusionClient(address, api_key=key, timeout=300)
        self.stop = stop
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            last = time.perf_counter()
            first = True
            try:
                for _ in self.client.generate(PROMPTS[n % len(PROMPTS)], {"max_tokens": 24, "ignore_eos": True,
                                                                           "temperature": 0.8, "seed": n}):
                    now = time.perf_counter()
                    (self.ttft if first else self.gaps).append(now - last)
                    first, last = False, now
            except Exception as err:
                self.errors.append(f"{type(err).__name__}: {str(err)[:160]}")
        self.client.close()


def _team_a_streams(address: str, key: str, stop: threading.Event, outcomes: Counter, _: str) -> None:
    """One of team A's streamers: long streams back to back; a refusal is retried at once."""
    generate = grpc.insecure_channel(address).unary_stream(f"/{FUSION_SERVICE}/Generate")
    payload = fusion_pb2.GenerateRequest(prompt="the quick brown fox", sampling=fusion_pb2.SamplingParams(
        max_tokens=4000, ignore_eos=True)).SerializeToString()
    while not stop.is_set():
        try:
            for _ in generate(payload, metadata=[("authorization", f"Bearer {key}")], timeout=60):
                if stop.is_set():
                    break
            outcomes["stream:OK"] += 1
        except grpc.RpcError as err:
            outcomes[f"stream:{err.code().name}"] += 1
            time.sleep(0.01)


def _team_a_scores(address: str, key: str, stop: threading.Event, outcomes: Counter, _: str) -> None:
    score = grpc.insecure_channel(address).unary_unary(f"/{FUSION_SERVICE}/Score")
    # 1,701 tokens: under max_score_tokens (2,048), so each call is real work, 14 chunks of it
    payload = fusion_pb2.ScoreRequest(prompt="hi", continuation="the cat sat on the mat " * 100).SerializeToString()
    while not stop.is_set():
        try:
            score(payload, metadata=[("authorization", f"Bearer {key}")], timeout=120)
            outcomes["score:OK"] += 1
        except grpc.RpcError as err:
            outcomes[f"score:{err.code().name}"] += 1
            time.sleep(0.01)


def _team_a_big_bodies(http: str, key: str, stop: threading.Event, outcomes: Counter, _: str) -> None:
    """One 4 MB chat body (120,000 messages) at a time."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "fusion", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}] * 120_000}).encode()[: 4 * 1024 * 1024 - 1]
    body = body[: body.rindex(b"}") + 1] + b"]}"  # still 120k messages, under 4 MiB
    while not stop.is_set():
        request = urllib.request.Request(f"http://{http}/v1/chat/completions", data=body, headers={
            "authorization": f"Bearer {key}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                outcomes[f"big_body:{reply.status}"] += 1
        except urllib.error.HTTPError as err:
            outcomes[f"big_body:{err.code}"] += 1
        except OSError as err:
            outcomes[f"big_body:{type(err).__name__}"] += 1


TEAM_A = {"streams_32": (_team_a_streams, 32), "streams_200": (_team_a_streams, 200),
          "scores_48": (_team_a_scores, 48), "big_bodies": (_team_a_big_bodies, 1)}


def team_a_process(target: str, key: str, attack: str, duration: float, results) -> None:
    work, threads_n = TEAM_A[attack]
    results.put(run_clients(work, target, key, [attack] * threads_n, duration, 30))


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return 1000 * values[int(q * (len(values) - 1))] if values else float("nan")


def tenant_phase(address: str, http: str, keys: dict, attack: str | None, duration: float) -> dict:
    stop = threading.Event()
    team_b = TeamB(address, keys["team-b"], stop)
    results = multiprocessing.get_context("spawn").Queue()
    attacker = None
    if attack is not None:
        attacker = multiprocessing.get_context("spawn").Process(
            target=team_a_process, args=(http if attack == "big_bodies" else address, keys["team-a"], attack,
                                         duration, results), daemon=True)
        attacker.start()
        time.sleep(min(5.0, duration / 6))  # team A is at full load before team B starts
    team_b.start()
    time.sleep(duration)
    stop.set()
    team_b.join(300)
    outcomes = results.get(timeout=300) if attacker is not None else {}
    if attacker is not None:
        attacker.join(60)
    return {"attack": attack, "requests": len(team_b.ttft), "errors": team_b.errors,
            "ttft_p50_ms": percentile(team_b.ttft, 0.5), "ttft_p95_ms": percentile(team_b.ttft, 0.95),
            "itl_p50_ms": percentile(team_b.gaps, 0.5), "itl_p95_ms": percentile(team_b.gaps, 0.95),
            "team_a": outcomes}


def score_quota(address: str, metrics_port: int, key: str) -> dict:
    """20 concurrent Score calls on a key limited to 2 calls and 200 tokens a minute."""
    import urllib.request

    outcomes: Counter = Counter()
    score = grpc.insecure_channel(address).unary_unary(f"/{FUSION_SERVICE}/Score")
    payload = fusion_pb2.ScoreRequest(prompt="hi", continuation="the cat sat on the mat " * 6).SerializeToString()

    def one() -> None:
        try:
            score(payload, metadata=[("authorization", f"Bearer {key}")], timeout=120)
            outcomes["OK"] += 1
        except grpc.RpcError as err:
            outcomes[err.code().name] += 1

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    used = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('fusion_key_tokens_total{key_id="limited"}'))
    return {"outcomes": dict(outcomes), "tokens_charged": used, "tokens_per_minute": 200}


def hold_idle_connections(http: str, count: int, ready, release) -> None:
    """Open `count` connections that send nothing and hold them until `release` is set (a process of
    its own: one process may open only so many files)."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port = http.rsplit(":", 1)
    held, failed = [], 0
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, int(port)), timeout=5))
        except OSError:
            failed += 1
    ready.put((len(held), failed))
    release.wait(120)
    for sock in held:
        sock.close()


def edge_checks(http: str, metrics_port: int, idle: int, paths: int) -> dict:
    """/metrics' size before and after `paths` random paths (and after the first, which adds the one
    `unmatched` series); /health's time with `idle` idle connections open (held by other processes)."""
    import urllib.error
    import urllib.request

    def metrics_size() -> int:
        return len(urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read())

    def random_path(i: int) -> None:
        try:
            urllib.request.urlopen(f"http://{http}/random/{os.urandom(8).hex()}/{i}", timeout=10)
        except urllib.error.HTTPError:
            pass

    before = metrics_size()
    random_path(0)
    after_one = metrics_size()
    for i in range(1, paths):
        random_path(i)
    after = metrics_size()
    context = multiprocessing.get_context("spawn")
    ready, release = context.Queue(), context.Event()
    per_process = 8000  # under the usual open-files limits
    holders = [context.Process(target=hold_idle_connections, args=(http, min(per_process, idle - k), ready, release),
                               daemon=True) for k in range(0, idle, per_process)]
    for holder in holders:
        holder.start()
    held = failed = 0
    for _ in holders:
        got, lost = ready.get(timeout=300)
        held, failed = held + got, failed + lost
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://{http}/health", timeout=10) as reply:
            health = reply.status
    except OSError as err:
        health = f"{type(err).__name__}: {err}"
    health_s = time.perf_counter() - started
    release.set()
    for holder in holders:
        holder.join(60)
    return {"metrics_bytes_before": before, "metrics_bytes_after_one_path": after_one, "metrics_bytes_after": after,
            "random_paths": paths, "metrics_growth": (after - before) / before,
            "metrics_growth_after_the_first_path": (after - after_one) / after_one,
            "idle_connections": held, "connect_failures": failed, "health_status": health, "health_s": health_s}


def synthetic_config(root: Path, layers: int, keys_file: Path, limits: dict) -> dict:
    """The benchmark's config: two synthetic experts (built under `root`), mixture fusion, API keys
    from `keys_file`, the experts' secret from FUSION_BENCH_SECRET."""
    print("building two synthetic experts ...", file=sys.stderr, flush=True)
    models = {name: build_expert(root / name, layers) for name in ("a", "b")}
    return {
        "experts": [{"name": n, "model": str(p), "dtype": "bfloat16", "chat_template": False}
                    for n, p in models.items()],
        "fusion": {"rule": "mixture"},
        "sampling": {"max_tokens": 24},
        "limits": limits,
        "security": {"expert_secret_env": "FUSION_BENCH_SECRET", "api_keys_file": str(keys_file)},
    }


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a black-holed replica must hear the terminate
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tenants_suite(args) -> dict:
    env = {**os.environ, "FUSION_BENCH_SECRET": "bench-secret", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        keys_file = root / "keys.yaml"
        keys = {"team-a": create_key(keys_file, "team-a"), "team-b": create_key(keys_file, "team-b"),
                "limited": create_key(keys_file, "limited", limits={"max_concurrent_streams": 2,
                                                                    "tokens_per_minute": 200})}
        config = synthetic_config(root, args.layers, keys_file, {"max_tokens": 8192, "max_concurrent_sessions": 64,
                                                                 "max_batch_size": 16, "key_share": 0.5})
        expert_config = root / "experts.yaml"
        expert_config.write_text(yaml.safe_dump(config))
        try:
            for name in ("a", "b"):
                proc, port = start(["serve-expert", "--config", str(expert_config), "--expert", name, "--port", "0"],
                                   env)
                procs.append(proc)
                next(e for e in config["experts"] if e["name"] == name)["addresses"] = [f"127.0.0.1:{port}"]
            coordinator_config = root / "coordinator.yaml"
            coordinator_config.write_text(yaml.safe_dump(config))
            coordinator, port = start(["serve", "--config", str(coordinator_config), "--port", "0", "--host",
                                       "127.0.0.1", "--http-port", "0", "--metrics-port", str(args.metrics_port)], env)
            procs.append(coordinator)
            address = f"127.0.0.1:{port}"
            http = f"127.0.0.1:{coordinator.http_port}"
            results: dict = {"duration_s": args.duration, "layers": args.layers, "phases": []}
            for attack in [None, *TEAM_A]:
                print(f"team B alone{'' if attack is None else ' while team A runs ' + attack} ...",
                      file=sys.stderr, flush=True)
                results["phases"].append(tenant_phase(address, http, keys, attack, args.duration))
            print("Score under a key's limits ...", file=sys.stderr, flush=True)
            results["score_quota"] = score_quota(address, args.metrics_port, keys["limited"])
            print("the HTTP edge ...", file=sys.stderr, flush=True)
            results["edge"] = edge_checks(http, args.metrics_port, args.idle_connections, args.random_paths)
            if args.rss_tokens:
                print(f"rss: {args.rss_tokens} tokens ...", file=sys.stderr, flush=True)
                results["rss"] = rss_growth(address, keys["team-b"], coordinator.pid, args.rss_tokens, 8)
            results["sessions_left"] = sessions_left([int(e["addresses"][0].rsplit(":", 1)[1])
                                                      for e in config["experts"]])
            results["coordinator_alive"] = coordinator.poll() is None
        finally:
            stop_all(procs)
    quiet = results["phases"][0]
    print(f"team B (one stream at a time, {args.duration:.0f} s per phase):")
    print("| team A | B's requests | TTFT p50 / p95 ms | ITL p50 / p95 ms | TTFT p95 / quiet | ITL p95 / quiet | "
          "B's errors | team A got |")
    for phase_ in results["phases"]:
        phase_["ttft_p95_ratio"] = phase_["ttft_p95_ms"] / quiet["ttft_p95_ms"]
        phase_["itl_p95_ratio"] = phase_["itl_p95_ms"] / quiet["itl_p95_ms"]
        print(f"| {phase_['attack'] or 'nothing'} | {phase_['requests']} | {phase_['ttft_p50_ms']:.0f} / "
              f"{phase_['ttft_p95_ms']:.0f} | {phase_['itl_p50_ms']:.0f} / {phase_['itl_p95_ms']:.0f} | "
              f"{phase_['ttft_p95_ratio']:.2f} | {phase_['itl_p95_ratio']:.2f} | {len(phase_['errors'])} | "
              f"{phase_['team_a']} |")
    print(f"Score on a key of 2 calls and 200 tokens/min, 20 at once: {results['score_quota']}")
    print(f"edge: {results['edge']}")
    if "rss" in results:
        print(f"rss: {results['rss']['rss_before_mb']:.1f} -> {results['rss']['rss_after_mb']:.1f} MB over "
              f"{results['rss']['tokens']} tokens")
    print(f"sessions left: {results['sessions_left']}; coordinator alive: {results['coordinator_alive']}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["faults", "tenants"], default="faults",
                        help="faults: hostile requests and failing replicas; tenants: team A against team B.")
    parser.add_argument("--metrics-port", type=int, default=19090, help="tenants: the coordinator's /metrics port.")
    parser.add_argument("--idle-connections", type=int, default=20_000, help="tenants: idle HTTP connections held.")
    parser.add_argument("--random-paths", type=int, default=10_000, help="tenants: random HTTP paths requested.")
    parser.add_argument("--duration", type=float, default=60.0, help="Seconds of each phase.")
    parser.add_argument("--clients", type=int, default=8, help="Well-behaved streaming clients.")
    parser.add_argument("--layers", type=int, default=2, help="Layers of each synthetic expert.")
    parser.add_argument("--rss-tokens", type=int, default=100_000, help="Tokens of the RSS phase (0: skip).")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args()
    if args.suite == "tenants":
        results = tenants_suite(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return

    env = {**os.environ, "FUSION_BENCH_SECRET": "bench-secret", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        keys_file = root / "keys.yaml"
        keys = {"good": create_key(keys_file, "good"), "hostile": create_key(keys_file, "hostile")}
        config = synthetic_config(root, args.layers, keys_file,
                                  {"max_tokens": 8192, "max_concurrent_sessions": 32, "max_batch_size": 16})
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
            stop_all(procs)

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
