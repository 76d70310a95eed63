"""What OpenTelemetry traces cost a stream: a coordinator and three remote expert servers (the tests'
tiny random experts, so the step itself is cheap and the hooks' share is as large as it gets), greedy
streams through gRPC with traces off and on (to an OTLP receiver on loopback), alternating rounds.
Off, each hook is one test of a module attribute; the figure printed is that test's time a token
beside the token's own time.

    python benchmarks/tracing_overhead.py [--rounds 5] [--tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' tiny experts (tests/tiny_models.py)

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from fusion.config import parse_config
from fusion.experts.expert import LocalExpert
from fusion.services import tracing
from fusion.services.coordinator import create_coordinator_server
from fusion.services.expert_server import create_expert_server
from fusion.services.protos import fusion_pb2, fusion_pb2_grpc
from fusion.services.background import BackgroundLoop
from tests.conftest import tiny_config_dict
from tests.tiny_models import make_model, make_tokenizer

# hooks passed a token with tracing off: the Generate branch, and per expert and step the call's
HOOKS_A_TOKEN = 1 + 3


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp())
    tok = make_tokenizer(root / "tok")
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        make_model(root / name, tok, seed=seed)
    config = parse_config(tiny_config_dict(root))
    sink = Sink()
    receiver = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, receiver)
    receiver_port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    with BackgroundLoop() as loop:
        experts = {e.name: loop.run(create_expert_server(LocalExpert.load(e), config.limits)) for e in config.experts}
        data = tiny_config_dict(root)
        for expert in data["experts"]:
            expert["addresses"] = [f"127.0.0.1:{experts[expert['name']][1]}"]
        coordinator, port = loop.run(create_coordinator_server(parse_config(data)))
        request = fusion_pb2.GenerateRequest(prompt="hello world", sampling=fusion_pb2.SamplingParams(
            max_tokens=args.tokens, ignore_eos=True, temperature=0.0))
        seconds = {"off": [], "on": []}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = fusion_pb2_grpc.FusionStub(channel)
            list(stub.Generate(request, timeout=120))  # warm
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    if mode == "on":
                        tracing.configure(f"http://127.0.0.1:{receiver_port}", service_name="bench")
                    started = time.perf_counter()
                    tokens = len(list(stub.Generate(request, timeout=120)))
                    seconds[mode].append((time.perf_counter() - started) / tokens)
                    if mode == "on":
                        tracing.shutdown()  # flushes: the export is not in the next round's time
        loop.run(coordinator.stop(0))
        for server, _ in experts.values():
            loop.run(server.stop(0))
    receiver.stop(0)
    hook_s = timeit.timeit(tracing.active, number=1_000_000) / 1_000_000
    token_off, token_on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    figures = {
        "rounds": args.rounds, "tokens": args.tokens,
        "ms_a_token_off": token_off * 1e3, "ms_a_token_on": token_on * 1e3, "on_over_off": token_on / token_off,
        "off_hook_ns": hook_s * 1e9, "off_hooks_share_of_a_token": HOOKS_A_TOKEN * hook_s / token_off,
        "spans_exported": sink.spans,
    }
    print(f"a token: {figures['ms_a_token_off']:.2f} ms off, {figures['ms_a_token_on']:.2f} ms on "
          f"({figures['on_over_off']:.3f}x); off, a hook costs {figures['off_hook_ns']:.0f} ns: "
          f"{figures['off_hooks_share_of_a_token']:.1e} of a token; {sink.spans} spans exported")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
