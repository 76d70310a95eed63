"""How expert logits should reach the coordinator on Ray Serve: per-step cost of three transports to
the same expert replica, measured side by side in one run.

An expert of SmolLM2-135M's shape (hidden 576, vocabulary 49,152, bf16; random weights, `--layers`
of its 30) is deployed with `fusion.deploy.expert.ExpertReplica` on a local Ray cluster. Each transport
decodes its own sessions step by step (every step carries the whole history, as the protocol does):

    local     LocalExpert.step in this process (the forward alone; reference)
    grpc      RemoteExpert.step → the replica's own Expert gRPC server (what the coordinator uses)
    ingress   Expert/Step through Serve's gRPC proxy (`application` metadata) → the replica's `Step`
    handle    DeploymentHandle.Step.remote(request) → the replica's `Step` (pickled protos)

All three remote paths end in the same servicer (batching queue, worker thread, logits as raw
bytes) and decode the bytes to a float32 tensor, so they differ only in transport. Rounds are
interleaved; printed are the median step time of each, the overhead over `local`, and each
transport's time and overhead as a ratio to `grpc`.

    .venv/bin/python benchmarks/bench_transport.py [--layers 2] [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

APP = "transport-bench"


from synthetic import build_expert  # noqa: E402  (benchmarks/ is on sys.path when run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def decode_session(step, session: str, prompt: list[int], steps: int) -> list[float]:
    """Prefill, then `steps` decode steps appending the argmax; returns each decode step's seconds."""
    history = list(prompt)
    logits = step(session, history)
    times = []
    for _ in range(steps):
        history.append(int(logits[0].argmax()))
        start = time.perf_counter()
        logits = step(session, history)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per session")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one session per transport)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    opts = parser.parse_args()

    import grpc
    import ray
    from ray import serve

    from fusion.deploy.expert import ExpertReplica
    from fusion.deploy.registry import ReplicaRegistry
    from fusion.config import parse_config
    from fusion.experts.expert import LocalExpert, StepRequest
    from fusion.services.protos import expert_pb2, expert_pb2_grpc
    from fusion.services.remote_expert import RemoteExpert
    from fusion.services.serving import channel_options
    from fusion.services.wire import decode_tensor

    workdir = tempfile.TemporaryDirectory(prefix="bench-transport-")
    folder = build_expert(Path(workdir.name) / "smol", opts.layers)
    config = parse_config({"experts": [{"name": "smol", "model": str(folder), "dtype": "bfloat16"}]})
    ingress_port = free_port()

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"port": free_port()}, grpc_options={
            "port": ingress_port,
            "grpc_servicer_functions": ["fusion.services._generated.expert_pb2_grpc.add_ExpertServicer_to_server"],
        })
        replica = ExpertReplica.options(name="expert-smol", num_replicas=1, ray_actor_options={"num_cpus": 0})
        app = replica.bind(config.experts[0].model_dump(), config.limits.model_dump(), ReplicaRegistry.bind(10.0),
                           {"grace_s": 1.0})
        handle = serve.run(app, name=APP, route_prefix="/transport")  # routed apps only reach the proxies
        address = handle.grpc_address.remote().result()
        threads = ray.get(ray.remote(num_cpus=0)(torch_threads).remote())
        torch.set_num_threads(threads)  # the forward costs the same here as in the replica

        local = LocalExpert.load(config.experts[0], str(folder))
        remote = RemoteExpert(config.experts[0].model_copy(update={"addresses": [address]}))
        channel = grpc.insecure_channel(f"127.0.0.1:{ingress_port}", options=channel_options(64 << 20))
        ingress = expert_pb2_grpc.ExpertStub(channel)

        def message(session, history):
            return expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id=session, token_ids=history)])

        transports = {
            "local": lambda s, h: local.step([StepRequest(s, h)]),
            "grpc": lambda s, h: remote.step([StepRequest(s, h)]),
            "ingress": lambda s, h: decode_tensor(
                ingress.Step(message(s, h), metadata=(("application", APP),), timeout=60).logits, "ingress"),
            "handle": lambda s, h: decode_tensor(handle.Step.remote(message(s, h)).result().logits, "handle"),
        }
        ids = torch.randint(3, 1000, (opts.prompt_tokens,), generator=torch.Generator().manual_seed(0))
        prompt = [int(t) for t in ids]
        reference = transports["local"]("check-local", prompt)
        for name in ("grpc", "ingress", "handle"):  # same logits on every path (and warm-up)
            assert torch.equal(transports[name](f"check-{name}", prompt), reference), name
        times: dict[str, list[float]] = {name: [] for name in transports}
        for r in range(opts.rounds):
            for name, step in transports.items():
                times[name] += decode_session(step, f"{name}-{r}", prompt, opts.steps)
        wire = len(expert_pb2.StepResponse(logits=remote_logits_proto(address, prompt)).SerializeToString())

        median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        overhead = {name: median[name] - median["local"] for name in transports}
        print(f"expert: SmolLM2-135M shape, {opts.layers} layers, bf16, vocab 49152; {threads} torch thread(s); "
              f"{opts.rounds} rounds x {opts.steps} decode steps, prompt {opts.prompt_tokens} tokens; "
              f"{wire / 1024:.0f} KiB of logits per step")
        print(f"{'transport':<10}{'median ms/step':>16}{'overhead ms':>14}{'time / grpc':>14}{'overhead / grpc':>17}")
        for name in transports:
            ratio = median[name] / median["grpc"]
            over = overhead[name] / overhead["grpc"] if name != "local" and overhead["grpc"] > 0 else float("nan")
            print(f"{name:<10}{median[name]:>16.2f}{overhead[name]:>14.2f}{ratio:>14.2f}{over:>17.2f}")
        remote.close()
        channel.close()
    finally:
        serve.shutdown()
        ray.shutdown()
        workdir.cleanup()


def remote_logits_proto(address: str, prompt: list[int]):
    """One step's logits message as the replica sends it (for its size)."""
    import grpc

    from fusion.services.protos import expert_pb2, expert_pb2_grpc
    from fusion.services.serving import channel_options

    with grpc.insecure_channel(address, options=channel_options(64 << 20)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)
        step = expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id="size", token_ids=prompt)])
        return stub.Step(step, timeout=60).logits


if __name__ == "__main__":
    main()
