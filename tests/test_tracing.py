"""OpenTelemetry traces (services/tracing.py) into a real OTLP/gRPC receiver on loopback: a request
through a coordinator and three remote expert servers is one trace, child of the caller's context,
with its stages and each expert call, and the experts' own spans parented across the gRPC hop;
batched calls link to the requests they serve; off, nothing is recorded."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from fusion.experts.expert import LocalExpert
from fusion.services import tracing
from fusion.services.coordinator import create_coordinator_server
from fusion.services.expert_server import create_expert_server
from fusion.services.protos import fusion_pb2, fusion_pb2_grpc
from tests.helpers import HANG_S, wait_until
from tests.test_grpc import addr, remote_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector: keeps every span exported to it."""

    def __init__(self) -> None:
        self.spans = []

    def Export(self, request, context):
        self.spans += [span for resource in request.resource_spans for scope in resource.scope_spans
                       for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    collector = Receiver()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    assert tracing.configure(f"http://127.0.0.1:{port}", service_name="fusion-test")  # http: plain text
    try:
        yield collector
    finally:
        tracing.shutdown()
        server.stop(0)


def attributes(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return [value(item) for item in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


def test_a_request_is_one_trace_across_the_grpc_hop_to_its_experts(loop, tiny_config, tiny_dir, receiver):
    experts = {e.name: loop.run(create_expert_server(LocalExpert.load(e), tiny_config.limits))
               for e in tiny_config.experts}
    coordinator, port = loop.run(create_coordinator_server(
        remote_config(tiny_dir, {name: [addr(p)] for name, (_, p) in experts.items()})))
    try:
        with grpc.insecure_channel(addr(port)) as channel:
            request = fusion_pb2.GenerateRequest(prompt="hello world", sampling=fusion_pb2.SamplingParams(
                max_tokens=6, ignore_eos=True, temperature=0.0))
            events = list(fusion_pb2_grpc.FusionStub(channel).Generate(
                request, metadata=[("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01")], timeout=HANG_S))
        assert len(events) == 6

        def mine():
            return [s for s in receiver.spans if s.trace_id.hex() == TRACE_ID]

        def arrived():  # the root, and the calls' spans (each ends as its call's answer arrives)
            names = [s.name for s in tracing.flush() and mine()]
            return "generate" in names and names.count("expert.step") == names.count("Expert/Step") == 3 * 6

        wait_until(arrived, interval_s=0.2, message="the request's spans at the receiver")
    finally:
        loop.run(coordinator.stop(0))
        for server, _ in experts.values():
            loop.run(server.stop(0))

    spans = mine()
    [root] = [s for s in spans if s.name == "generate"]
    assert root.parent_span_id.hex() == CALLER_SPAN  # the caller's context, carried in its metadata
    assert root.kind == root.SPAN_KIND_SERVER
    facts = attributes(root)
    assert facts["gen_ai.usage.output_tokens"] == 6 and facts["gen_ai.response.finish_reasons"] == ["length"]
    assert facts["gen_ai.request.max_tokens"] == 6 and facts["gen_ai.usage.input_tokens"] > 0
    assert [e.name for e in root.events] == ["stream end"]

    stages = {s.name: s for s in spans if s.name in ("admission", "queue", "prefill", "decode")}
    assert set(stages) == {"admission", "queue", "prefill", "decode"}
    assert all(s.parent_span_id == root.span_id for s in stages.values())
    order = [stages[n] for n in ("admission", "queue", "prefill", "decode")]
    assert order[0].start_time_unix_nano == root.start_time_unix_nano
    for before, after in zip(order, order[1:]):  # back to back, in this order
        assert before.end_time_unix_nano == after.start_time_unix_nano
    assert order[-1].end_time_unix_nano == root.end_time_unix_nano

    calls = [s for s in spans if s.name == "expert.step"]
    assert {attributes(c)["fusion.expert"] for c in calls} == {"a", "b", "c"}
    assert all(c.parent_span_id == root.span_id and c.kind == c.SPAN_KIND_CLIENT for c in calls)
    # each expert's own span is the child of the call that carried its context over gRPC
    served = [s for s in spans if s.name == "Expert/Step"]
    assert served and all(s.kind == s.SPAN_KIND_SERVER for s in served)
    call_ids = {c.span_id for c in calls}
    assert all(s.parent_span_id in call_ids for s in served)
    assert {attributes(s)["fusion.expert"] for s in served} == {"a", "b", "c"}
    # six tokens: a prefill call and five decode calls on each expert, each answered there
    assert len(calls) == len(served) == 3 * 6


def test_an_http_request_is_one_trace_per_choice_child_of_its_traceparent_header(loop, tiny_config, tiny_dir,
                                                                                 receiver):
    experts = {e.name: loop.run(create_expert_server(LocalExpert.load(e), tiny_config.limits))
               for e in tiny_config.experts}
    coordinator, _ = loop.run(create_coordinator_server(
        remote_config(tiny_dir, {name: [addr(p)] for name, (_, p) in experts.items()}), http_address="127.0.0.1:0"))
    try:
        body = {"model": "fusion", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "n": 2,
                "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{coordinator.http_port}/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"})
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            assert len(json.load(response)["choices"]) == 2

        def mine():
            return [s for s in receiver.spans if s.trace_id.hex() == TRACE_ID]

        wait_until(lambda: [s.name for s in tracing.flush() and mine()].count("chat") == 2, interval_s=0.2,
                   message="the choices' spans at the receiver")
    finally:
        loop.run(coordinator.stop(0))
        for server, _ in experts.values():
            loop.run(server.stop(0))
    roots = [s for s in mine() if s.name == "chat"]
    for root in roots:  # one per choice, each the caller's child, with its stages and tokens
        facts = attributes(root)
        assert root.parent_span_id.hex() == CALLER_SPAN and root.kind == root.SPAN_KIND_SERVER
        assert facts["http.route"] == "/v1/chat/completions" and facts["gen_ai.operation.name"] == "chat"
        assert facts["gen_ai.usage.output_tokens"] == 4 and facts["gen_ai.response.finish_reasons"] == ["length"]
        stages = [s.name for s in mine() if s.parent_span_id == root.span_id]
        assert {"admission", "queue", "prefill", "decode"} <= set(stages)
    # the experts' calls: each the child of the one request it served, or linked to both when batched
    calls = [s for s in mine() if s.name == "expert.step"]
    root_ids = {r.span_id for r in roots}
    assert calls and all(c.parent_span_id in root_ids or {link.span_id for link in c.links} == root_ids
                         for c in calls)


def test_a_batched_call_links_the_requests_it_serves_and_a_single_one_is_their_child(receiver):
    traces = {}
    for request_id in ("r1", "r2"):
        traces[request_id] = tracing.start_request("Generate", [], tracing._now())
        tracing.admitted(traces[request_id], request_id, prompt_tokens=3)
    batched, metadata = tracing.start_expert_call("a", "Step", ["r1", "r2"], "127.0.0.1:1")
    assert [k for k, _ in metadata] == ["traceparent"]
    assert not batched.parent and [link.context for link in batched.links] == [
        traces[r].span.get_span_context() for r in ("r1", "r2")]
    single, _ = tracing.start_expert_call("a", "Step", ["r2"], "127.0.0.1:1")
    assert single.parent.span_id == traces["r2"].span.get_span_context().span_id and not single.links
    # a call for requests no trace follows starts none of its own
    assert tracing.start_expert_call("a", "Step", ["not-traced"], "127.0.0.1:1") == (None, [])
    for request_id, trace in traces.items():
        tracing.end_request(trace, request_id, "stop")


def test_off_by_default_nothing_is_recorded_and_configure_needs_an_endpoint(monkeypatch):
    for variable in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert not tracing.active()
    assert not tracing.configure(None)  # no endpoint given nor named by OTEL_*: stays off
    assert not tracing.active()
    assert tracing.start_request("Generate", [], 0) is None
    assert tracing.start_expert_call("a", "Step", ["r1"], "x") == (None, [])
    assert tracing.start_expert_server_span("Step", [], "a", 1) is None
    tracing.joined_batch("r1", "", 0.0)
    assert not tracing._State.requests


def test_variables_alone_never_stop_a_server_and_can_switch_tracing_off(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.configure(None) and not tracing.active()
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.configure(None) and not tracing.active()
