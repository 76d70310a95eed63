"""End-to-end gRPC: real servers on loopback (port 0), tiny experts, client → coordinator → expert servers.

The remote path must give exactly the tokens of the in-process service; a replica lost mid-stream
must not change the output; bad requests get the right status with a message naming the field and
leave the server serving; cancelled or finished streams leave no session on any expert.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
import urllib.request

import grpc
import pytest

from fusion.config import FusionSpec, parse_config
from fusion.errors import ExpertUnavailableError, InvalidArgumentError, ResourceExhaustedError
from fusion.experts.expert import LocalExpert
from fusion.frontdoor.service import FusionRequest
from fusion.services.client import FusionClient
from fusion.services.coordinator import create_coordinator_server
from fusion.services.expert_server import create_expert_server
from fusion.services.protos import expert_pb2, expert_pb2_grpc, fusion_pb2, fusion_pb2_grpc
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S, wait_until  # noqa: F401 (other modules import wait_until from here)

LIMITS = {"max_prompt_tokens": 256, "max_tokens": 400}
SOAK_SECONDS = float(os.environ.get("FUSION_GRPC_SOAK_S", "10"))  # the issue's soak runs 30 s


def addr(port: int) -> str:
    return f"127.0.0.1:{port}"


def remote_config(tiny_dir, addresses: dict[str, list[str]], **extra):
    data = tiny_config_dict(tiny_dir, **extra)
    for expert in data["experts"]:
        expert["addresses"] = addresses[expert["name"]]
    return parse_config(data)


def expert_sessions(port: int) -> int:
    with grpc.insecure_channel(addr(port)) as channel:
        return expert_pb2_grpc.ExpertStub(channel).Info(expert_pb2.InfoRequest(), timeout=HANG_S).active_sessions


@pytest.fixture(scope="module")
def experts(loop, tiny_config):
    """One expert server per expert of the tiny config: name -> (server, port)."""
    servers = {
        e.name: loop.run(create_expert_server(LocalExpert.load(e), tiny_config.limits, metrics_port=0,
                                              metrics_host="127.0.0.1"))
        for e in tiny_config.experts
    }
    yield servers
    for server, _ in servers.values():
        loop.run(server.stop(0))


def start_coordinator(loop, tiny_dir, addresses, **extra):
    config = remote_config(tiny_dir, addresses, **extra)
    return loop.run(create_coordinator_server(config, metrics_port=0, metrics_host="127.0.0.1"))


@pytest.fixture(scope="module")
def coordinator(loop, tiny_dir, experts):
    server, port = start_coordinator(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()}, limits=LIMITS)
    yield server, port
    loop.run(server.stop(0))


@pytest.fixture(scope="module")
def client(coordinator):
    with FusionClient(addr(coordinator[1]), timeout=HANG_S) as c:
        yield c


def no_sessions_left(experts) -> bool:
    return wait_until(lambda: all(expert_sessions(port) == 0 for _, port in experts.values()))


# -- same tokens as the local engine ---------------------------------------------------------------
CASES = {
    "greedy": ("hello world", {"max_tokens": 24, "ignore_eos": True}, None),
    "seeded": ("what is 12 + 35 ?", {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7,
                                     "logprobs": 3, "repetition_penalty": 1.1, "ignore_eos": True}, None),
    "mixture-weights": ("the quick brown fox", {"max_tokens": 16, "temperature": 0.7, "seed": 3},
                        FusionSpec(rule="mixture", weights={"a": 1.0, "b": 2.0})),
    "profile": ("def add", {"max_tokens": 16}, FusionSpec(profile="ab")),
    "arithmetic-params": ("0 1 2 3", {"max_tokens": 16, "ignore_eos": True},
                          FusionSpec(rule="logit_arithmetic", params={"alpha": 0.1, "lead": "a"},
                                     weights={"a": 1.5, "b": -0.5})),
    "chat": ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
             {"max_tokens": 16, "ignore_eos": True}, None),
    "structured-schema": ("what is 12 + 35 ?", {"max_tokens": 32, "structured": {"json_schema": {
        "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}}}, None),
    "structured-choice": ("hello", {"max_tokens": 8, "temperature": 0.8, "seed": 5,
                                    "structured": {"choice": ["fox", "dog", "lazy dog"]}}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_remote_generation_matches_local(case, client, tiny_service, experts):
    prompt, sampling, spec = CASES[case]
    local = tiny_service.complete(prompt, sampling, spec)
    events = list(client.generate(prompt, sampling, spec))
    assert [e.token.token_id for e in events] == local.token_ids
    assert "".join(e.text for e in events) == local.text
    assert [e.token.logprob for e in events] == pytest.approx(local.logprobs, abs=1e-5)
    for remote_token, local_token in zip((e.token for e in events), local.events):
        assert [a.expert for a in remote_token.attribution] == [a.expert for a in local_token.attribution]
        assert [a.weight for a in remote_token.attribution] == pytest.approx(
            [a.weight for a in local_token.attribution], abs=1e-6)
        assert [t for t, _ in remote_token.top_logprobs] == [t for t, _ in local_token.top_logprobs]
    assert events[-1].finish_reason == local.finish_reason
    assert events[-1].usage.completion_tokens == len(local.token_ids)
    assert all(e.usage is None for e in events[:-1])
    assert no_sessions_left(experts)


def test_remote_generation_continues_the_final_assistant_message_as_locally(client, tiny_service, experts):
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    local = list(tiny_service.submit(FusionRequest(opened, {"max_tokens": 8, "ignore_eos": True},
                                                   continue_final_message=True)))
    events = list(client.generate(opened, {"max_tokens": 8, "ignore_eos": True}, continue_final_message=True))
    assert [e.token.token_id for e in events] == [e.token.token_id for e in local]
    assert events[-1].usage.prompt_tokens == local[-1].usage.prompt_tokens
    # without the flag the opening is a finished turn and a new one begins: another prompt
    assert list(client.generate(opened, {"max_tokens": 1}))[-1].usage.prompt_tokens != local[-1].usage.prompt_tokens
    healed = {"max_tokens": 8, "ignore_eos": True, "token_healing": True}
    local = list(tiny_service.submit(FusionRequest(opened, healed, continue_final_message=True)))
    events = list(client.generate(opened, healed, continue_final_message=True))
    assert [e.token.token_id for e in events] == [e.token.token_id for e in local]
    assert "".join(e.text for e in events) == "".join(e.text for e in local)
    assert events[-1].usage.prompt_tokens == local[-1].usage.prompt_tokens == len(
        tiny_service.prompt_ids(opened, continue_final_message=True)[0]) - 1  # healed: the last token backed up


def test_remote_score_matches_local(client, tiny_service):
    remote = client.score("the quick brown", " fox jumps")
    local = tiny_service.score("the quick brown", " fox jumps")
    assert remote.token_ids == local.token_ids
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-5)


def test_describe(client):
    info = client.describe()
    assert [e.info.name for e in info.experts] == ["a", "b", "c"]
    assert all(e.addresses for e in info.experts)
    assert {"weighted_logits", "mixture", "logit_arithmetic"} <= {r.name for r in info.rules}
    assert {p.name for p in info.profiles} == {"only_a", "ab"}
    assert info.limits.max_prompt_tokens == LIMITS["max_prompt_tokens"]


# -- bad input -----------------------------------------------------------------------------------
def _spec(**fields) -> fusion_pb2.FusionSpec:
    params = fields.pop("params", None)
    spec = fusion_pb2.FusionSpec(**fields)
    if params is not None:
        spec.params.update(params)
    return spec


S = fusion_pb2.SamplingParams
NOT_FOUND, INVALID, EXHAUSTED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                                 grpc.StatusCode.RESOURCE_EXHAUSTED)
BAD_GENERATE = {
    "unknown expert in weights": (dict(prompt="hi", spec=_spec(weights={"zzz": 1.0})), NOT_FOUND, "weights"),
    "unknown profile": (dict(prompt="hi", spec=_spec(profile="nope")), NOT_FOUND, "profile"),
    "negative temperature": (dict(prompt="hi", sampling=S(temperature=-1)), INVALID, "temperature"),
    "top_p above 1": (dict(prompt="hi", sampling=S(top_p=1.5)), INVALID, "top_p"),
    "NaN min_p": (dict(prompt="hi", sampling=S(min_p=float("nan"))), INVALID, "min_p"),
    "negative seed": (dict(prompt="hi", sampling=S(seed=-1)), INVALID, "seed"),
    "too many logprobs": (dict(prompt="hi", sampling=S(logprobs=50)), INVALID, "logprobs"),
    "zero max_tokens": (dict(prompt="hi", sampling=S(max_tokens=0)), INVALID, "max_tokens"),
    "negative banned id": (dict(prompt="hi", sampling=S(banned_token_ids=[-3])), INVALID, "banned_token_ids"),
    "unknown rule": (dict(prompt="hi", spec=_spec(rule="nope")), INVALID, "rule"),
    "bad rule parameter": (dict(prompt="hi", spec=_spec(rule="logit_arithmetic", params={"alpha": 5})),
                           INVALID, "alpha"),
    "unknown rule parameter": (dict(prompt="hi", spec=_spec(rule="mixture", params={"tau": 1})), INVALID, "tau"),
    "all weights zero": (dict(prompt="hi", spec=_spec(weights={"a": 0.0})), INVALID, "weights"),
    "weights and profile": (dict(prompt="hi", spec=_spec(weights={"a": 1.0}, profile="ab")), INVALID, "profile"),
    "no prompt": (dict(), INVALID, "prompt"),
    "prompt and messages": (dict(prompt="hi", messages=[fusion_pb2.ChatMessage(role="user", content="x")]),
                            INVALID, "messages"),
    "message without role": (dict(messages=[fusion_pb2.ChatMessage(content="x")]), INVALID, "messages[0].role"),
    "prompt over the limit": (dict(prompt="the quick brown fox " * 100), EXHAUSTED, "max_prompt_tokens"),
    "max_tokens over the limit": (dict(prompt="hi", sampling=S(max_tokens=5000)), EXHAUSTED, "max_tokens"),
    "bad regex": (dict(prompt="hi", sampling=S(structured=fusion_pb2.StructuredOutput(regex="(unclosed"))),
                  INVALID, "structured"),
    "schema not JSON": (dict(prompt="hi", sampling=S(structured=fusion_pb2.StructuredOutput(json_schema="{x"))),
                        INVALID, "structured.json_schema"),
    "empty structured": (dict(prompt="hi", sampling=S(structured=fusion_pb2.StructuredOutput())), INVALID,
                         "structured"),
    "continue a user's message": (dict(messages=[fusion_pb2.ChatMessage(role="user", content="x")],
                                       continue_final_message=True), INVALID, "continue_final_message"),
}


def assert_serves(client) -> None:
    events = list(client.generate("still there?", {"max_tokens": 2, "ignore_eos": True}))
    assert len(events) == 2


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_bad_generate_requests(case, coordinator, client):
    fields, code, field_name = BAD_GENERATE[case]
    with grpc.insecure_channel(addr(coordinator[1])) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(fusion_pb2.GenerateRequest(**fields), timeout=HANG_S))
    assert caught.value.code() == code, caught.value.details()
    assert field_name in caught.value.details()
    assert_serves(client)


def test_bad_score_and_undecodable_requests(coordinator, client):
    with grpc.insecure_channel(addr(coordinator[1])) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(fusion_pb2.ScoreRequest(prompt="hi", continuation=""), timeout=HANG_S)
        assert caught.value.code() == INVALID and "continuation" in caught.value.details()
        garbage = channel.unary_stream("/fusion.v1.Fusion/Generate")  # raw bytes, no serializer
        with pytest.raises(grpc.RpcError) as caught:
            list(garbage(b"\xff\xff\xff\xff", timeout=HANG_S))
        assert caught.value.code() != grpc.StatusCode.OK
    assert_serves(client)


def test_client_maps_status_to_domain_errors(client):
    with pytest.raises(InvalidArgumentError, match="temperature"):
        list(client.generate("hi", {"temperature": -2}))
    with pytest.raises(InvalidArgumentError, match="sampling: unknown field"):
        client.generate("hi", {"temperture": 1})
    with pytest.raises(ResourceExhaustedError, match="max_tokens"):
        list(client.generate("hi", {"max_tokens": 5000}))


def test_bad_expert_requests(experts):
    _, port = experts["a"]
    bad = [
        ("Step", expert_pb2.StepRequest(), "sessions"),
        ("Step", expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(token_ids=[1])]), "session_id"),
        ("Step", expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id="s")]), "token_ids"),
        ("Step", expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id="s", token_ids=[1, 99999])]),
         "token_ids"),
        ("Step", expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id="s", token_ids=[1])],
                                        dtype="int8"), "dtype"),
        ("Score", expert_pb2.ExpertScoreRequest(session_id="s", token_ids=[1, 2], num_positions=5), "num_positions"),
    ]
    with grpc.insecure_channel(addr(port)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)
        for method, request, field_name in bad:
            with pytest.raises(grpc.RpcError) as caught:
                getattr(stub, method)(request, timeout=10)
            assert caught.value.code() == INVALID, (method, caught.value.details())
            assert field_name in caught.value.details()
        ok = stub.Step(expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id="s", token_ids=[1, 2])],
                                              dtype="bfloat16"), timeout=10)
        assert ok.logits.dtype == "bfloat16" and list(ok.logits.shape) == [1, 300]
        stub.Release(expert_pb2.ReleaseRequest(session_ids=["s"]), timeout=10)
    assert expert_sessions(port) == 0


def test_too_many_concurrent_sessions(loop, tiny_dir, experts):
    server, port = start_coordinator(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()},
                                     limits={"max_concurrent_sessions": 2})
    try:
        with FusionClient(addr(port), timeout=HANG_S) as client:
            long = {"max_tokens": 400, "ignore_eos": True}
            streams = [client.generate("hi", long) for _ in range(2)]
            for stream in streams:
                next(stream)  # both admitted
            with pytest.raises(ResourceExhaustedError, match="max_concurrent_sessions=2"):
                list(client.generate("hi", {"max_tokens": 2}))
            for stream in streams:
                stream.close()
            assert wait_until(lambda: server.servicer.service.active == 0)
            assert_serves(client)
    finally:
        loop.run(server.stop(0))
    assert no_sessions_left(experts)


# -- cancellation, deadlines, concurrency ----------------------------------------------------------
def test_cancelled_stream_frees_sessions_on_every_expert(coordinator, client, experts):
    stream = client.generate("cancel me", {"max_tokens": 400, "ignore_eos": True})
    for _ in range(3):
        next(stream)
    assert all(expert_sessions(port) >= 1 for _, port in experts.values())
    stream.close()  # cancels the RPC
    assert no_sessions_left(experts)
    assert wait_until(lambda: coordinator[0].servicer.service.active == 0)


def test_deadline_cancels_the_request(coordinator, client, experts):
    with pytest.raises(Exception) as caught:
        list(client.generate("slow", {"max_tokens": 400, "ignore_eos": True}, timeout=0.3))
    assert isinstance(caught.value.__cause__, grpc.RpcError)
    assert caught.value.__cause__.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert no_sessions_left(experts)
    assert wait_until(lambda: coordinator[0].servicer.service.active == 0)


def test_concurrent_clients(coordinator, experts, tiny_service):
    """16 clients stream for SOAK_SECONDS (some cancel early); greedy answers match the solo local run."""
    prompts = ["hello", "what is 2 + 2 ?", "def add", "the lazy dog", "fusion of small models"]
    greedy = {"max_tokens": 12, "ignore_eos": True}
    expected = {p: tiny_service.complete(p, greedy).token_ids for p in prompts}
    errors: list[str] = []
    counts = [0] * 16
    stop_at = time.monotonic() + SOAK_SECONDS

    def run(worker: int) -> None:
        rng = random.Random(worker)
        with FusionClient(addr(coordinator[1]), timeout=HANG_S) as client:
            while time.monotonic() < stop_at:
                prompt = rng.choice(prompts)
                try:
                    if rng.random() < 0.5:
                        got = [e.token.token_id for e in client.generate(prompt, greedy)]
                        if got != expected[prompt]:
                            errors.append(f"worker {worker}: {prompt!r} gave {got}, expected {expected[prompt]}")
                    else:
                        sampling = {"max_tokens": rng.randint(1, 30), "temperature": 0.8, "seed": rng.randint(0, 99)}
                        stream = client.generate(prompt, sampling)
                        for i, _ in enumerate(stream):
                            if i == 2 and rng.random() < 0.3:
                                stream.close()
                                break
                except Exception as err:  # collected: the assertion below reports them all
                    errors.append(f"worker {worker}: {type(err).__name__}: {err}")
                counts[worker] += 1

    threads = [threading.Thread(target=run, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_SECONDS + 120)
    assert not errors, errors[:5]
    assert all(c > 0 for c in counts)
    assert wait_until(lambda: coordinator[0].servicer.service.active == 0)
    assert no_sessions_left(experts)


# -- replicas and failover -----------------------------------------------------------------------
@pytest.fixture
def replicas(loop, tiny_config):
    """Two extra replicas of expert a."""
    servers = [loop.run(create_expert_server(LocalExpert.load(tiny_config.expert("a")), tiny_config.limits))
               for _ in range(2)]
    yield servers
    for server, _ in servers:
        loop.run(server.stop(0))


def test_replica_lost_mid_stream_keeps_the_output(loop, tiny_dir, experts, replicas, tiny_service):
    sampling = {"max_tokens": 150, "ignore_eos": True}
    expected = tiny_service.complete("failover", sampling).token_ids
    addresses = {"a": [addr(p) for _, p in replicas], "b": [addr(experts["b"][1])], "c": [addr(experts["c"][1])]}
    server, port = start_coordinator(loop, tiny_dir, addresses, limits=LIMITS)
    try:
        remote_a = server.servicer.service.experts[0]
        with FusionClient(addr(port), timeout=HANG_S) as client:
            stream = client.generate("failover", sampling)
            got = [next(stream).token.token_id]
            holder = [i for i, (_, p) in enumerate(replicas) if expert_sessions(p) == 1]
            assert len(holder) == 1
            loop.run(replicas[holder[0]][0].stop(0))  # the replica dies mid-generation
            got += [e.token.token_id for e in stream]
            assert got == expected
            assert remote_a.failovers >= 1
            # The survivor now serves new sessions too; with no replica left the expert is unavailable.
            assert_serves(client)
            loop.run(replicas[1 - holder[0]][0].stop(0))
            with pytest.raises(ExpertUnavailableError, match="'a'"):
                list(client.generate("hi", {"max_tokens": 3}))
            # Requests that do not consult the lost expert go on.
            events = list(client.generate("hi", {"max_tokens": 3, "ignore_eos": True},
                                          FusionSpec(weights={"b": 1.0, "c": 1.0})))
            assert len(events) == 3
    finally:
        loop.run(server.stop(0))


def test_hung_replica_fails_over_after_the_step_deadline(loop, tiny_dir, experts, replicas, tiny_service):
    sampling = {"max_tokens": 20, "ignore_eos": True}
    expected = tiny_service.complete("hang", sampling).token_ids
    hung, _ = replicas[0]
    release = threading.Event()
    real_step = hung.servicer._step

    def hang_then_step(batch):
        release.wait(10)
        return real_step(batch)

    hung.servicer._step = hang_then_step
    data_addresses = {"a": [addr(p) for _, p in replicas], "b": [addr(experts["b"][1])], "c": [addr(experts["c"][1])]}
    data = tiny_config_dict(tiny_dir, limits=LIMITS)
    for expert in data["experts"]:
        expert["addresses"] = data_addresses[expert["name"]]
        expert["step_timeout_s"] = expert["prefill_timeout_s"] = 1.0
    server, port = loop.run(create_coordinator_server(parse_config(data)))
    try:
        with FusionClient(addr(port), timeout=HANG_S) as client:
            started = time.monotonic()
            got = [e.token.token_id for e in client.generate("hang", sampling)]
            assert got == expected
            assert 1.0 <= time.monotonic() - started < 30
            assert server.servicer.service.experts[0].failovers >= 1
    finally:
        release.set()
        loop.run(server.stop(0))


# -- health, reflection, metrics, shutdown ---------------------------------------------------------
def test_stock_tools_see_services_and_health(coordinator, experts):
    """Only grpc, grpc_health and grpc_reflection here: what a tool that knows nothing of the project sees."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for port, service, methods in [
        (coordinator[1], "fusion.v1.Fusion", {"Generate", "Score", "Describe"}),
        (experts["a"][1], "fusion.v1.Expert", {"Step", "Score", "Release", "Info", "Extend"}),
    ]:
        with grpc.insecure_channel(addr(port)) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            assert {service, "grpc.health.v1.Health"} <= set(database.get_services())
            descriptor = DescriptorPool(database).FindServiceByName(service)
            assert {m.name for m in descriptor.methods} == methods
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=HANG_S).status
                assert status == health_pb2.HealthCheckResponse.SERVING


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HANG_S).read().decode()


def metric(text: str, series: str) -> float | None:
    """The value of one series (`name` or `name{labels}`) in a Prometheus text exposition."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_metrics_endpoints(coordinator, client, experts):
    list(client.generate("metrics", {"max_tokens": 4, "ignore_eos": True}))
    with pytest.raises(Exception):
        list(client.generate("metrics", {}, FusionSpec(profile="nope")))
    text = scrape(coordinator[0].metrics_port)
    for series in ("fusion_time_to_first_token_seconds_count", "fusion_inter_token_latency_seconds_count",
                   "fusion_fuse_sample_seconds_count", "fusion_decode_step_seconds_count",
                   "fusion_generated_tokens_total", 'fusion_expert_step_seconds_count{expert="a"}',
                   'fusion_requests_total{code="OK",method="Generate"}',
                   'fusion_requests_total{code="NOT_FOUND",method="Generate"}',
                   'fusion_queue_wait_seconds_count{key_id="-"}'):
        assert metric(text, series) >= 1, series
    assert metric(text, "fusion_active_sessions") is not None
    expert_text = scrape(experts["a"][0].metrics_port)
    assert metric(expert_text, 'fusion_expert_step_seconds_count{expert="a"}') >= 1
    assert metric(expert_text, "fusion_expert_batch_sessions_count") >= 1
    assert metric(expert_text, "fusion_expert_response_bytes_total") > 0
    assert metric(expert_text, 'fusion_expert_prefix_tokens_total{outcome="computed"}') > 0
    assert metric(expert_text, 'fusion_expert_prefix_tokens_total{outcome="reused"}') > 0  # decode reuses
    assert metric(expert_text, "fusion_expert_cached_tokens") is not None
    assert metric(expert_text, "fusion_expert_kept_prefix_tokens") is not None
    assert metric(expert_text, "fusion_expert_adopted_prefix_tokens_total") is not None
    assert metric(expert_text, 'fusion_expert_decode_batches_total{batch="in_place"}') is not None
    assert wait_until(lambda: metric(scrape(experts["a"][0].metrics_port), "fusion_active_sessions") == 0)


def test_graceful_shutdown_finishes_in_flight_streams(loop, tiny_dir, experts):
    server, port = start_coordinator(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()}, limits=LIMITS)
    with FusionClient(addr(port), timeout=HANG_S) as client:
        sampling = {"max_tokens": 60, "ignore_eos": True}
        stream = client.generate("finish me", sampling)
        first = next(stream)
        stopped = asyncio.run_coroutine_threadsafe(server.stop(grace=20), loop.loop)
        rest = list(stream)
        assert len([first] + rest) == 60 and rest[-1].finish_reason == "length"
        stopped.result(30)
        with pytest.raises(Exception):
            list(client.generate("too late", {"max_tokens": 2}, timeout=5))
    assert no_sessions_left(experts)


def test_a_client_of_several_coordinators_rides_out_one_going_down(tiny_dir):
    """Two coordinators of one config behind one client address ("a,b"): while both serve, requests
    land on both; once one stops, a stream it was serving ends UNAVAILABLE (a clear error, nothing
    hangs) and every new request is answered by the other, greedy tokens unchanged."""
    from fusion.errors import FusionError
    from fusion.services.background import BackgroundLoop

    config = parse_config(tiny_config_dict(tiny_dir))
    sampling = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    with BackgroundLoop() as loop:
        servers = [loop.run(create_coordinator_server(config)) for _ in range(2)]
        address = ",".join(f"127.0.0.1:{port}" for _, port in servers)
        with FusionClient(address, timeout=HANG_S) as client:
            expected = [e.token.token_id for e in client.generate("def add", {"max_tokens": 12})]
            served = [sum(1 for _ in client.generate("hello", {"max_tokens": 2})) for _ in range(6)]
            assert served == [2] * 6
            streams = [client.generate("hello world , fusion", sampling) for _ in range(4)]
            firsts = [next(s) for s in streams]  # every stream started, on one coordinator or the other
            assert all(f.token is not None for f in firsts)
            loop.run(servers[0][0].stop(0))
            outcomes = []
            for stream in streams:
                try:
                    outcomes.append(1 + sum(1 for _ in stream))
                except FusionError as err:
                    outcomes.append(err)
            # how many streams the stopped coordinator had left unfinished depends on the host's speed:
            # each stream is either whole or cut by a clear error
            cut = [o for o in outcomes if not isinstance(o, int)]
            assert all(isinstance(o, ExpertUnavailableError) for o in cut), cut
            assert [o for o in outcomes if isinstance(o, int)] == [400] * (4 - len(cut))
            for _ in range(4):  # new requests: all answered by the coordinator still up
                assert [e.token.token_id for e in client.generate("def add", {"max_tokens": 12})] == expected
        loop.run(servers[1][0].stop(0))
