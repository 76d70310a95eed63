"""The HTTP API's edge (`services/http_edge.py` and the body handling of `services/http_api.py`):
bounded connections, header and body timeouts, hostile bodies and bounded metric labels, against a
real coordinator on loopback ports (in-process tiny experts) with raw sockets and the `openai` client."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from fusion.config import parse_config
from fusion.services.coordinator import create_coordinator_server
from fusion.services.protos import fusion_pb2, fusion_pb2_grpc
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S, wait_until

ORIGIN = "https://app.example"
EDGE = {"max_prompt_tokens": 256, "max_tokens": 64, "max_http_connections": 32, "http_header_timeout_s": 0.5,
        "http_body_timeout_s": 0.5}


@pytest.fixture(scope="module")
def server(loop, tiny_dir):
    config = parse_config(tiny_config_dict(tiny_dir, limits=EDGE, security={"allowed_origins": [ORIGIN]}))
    running, _ = loop.run(create_coordinator_server(config, metrics_port=0, metrics_host="127.0.0.1",
                                                    http_address="127.0.0.1:0"))
    yield running
    loop.run(running.stop(0))


def get(port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_past_the_cap_make_room_for_health(server):
    """Four times the cap of connections that send nothing: the longest idle are closed, /health answers."""
    port = server.http_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4 * EDGE["max_http_connections"])]
    try:
        # answered, not queued behind the idle ones (the eviction counts below say why; the
        # timeout is a hang bound, not the assertion)
        status, body = get(port, "/health", timeout=HANG_S)
        assert status == 200 and json.loads(body)["status"] == "ok"
        book = server.http.connections
        assert book.evicted >= 3 * EDGE["max_http_connections"] - 1
        assert book.open <= EDGE["max_http_connections"]
        assert closed_by_server(idle[0], 2.0)  # the oldest went first
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert closed_by_server(sock, 3.0)
    assert server.http.connections.timed_out >= 1


def test_a_body_that_never_arrives_is_408(server):
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\"")
        sock.settimeout(5)
        reply = b""
        while b"http_body_timeout_s" not in reply:  # the head and the body may come in two packets
            more = sock.recv(4096)
            if not more:
                break
            reply += more
    assert reply.startswith(b"HTTP/1.1 408") and b"http_body_timeout_s" in reply


def test_unknown_paths_add_no_metric_series(server):
    def metrics() -> bytes:
        return get(server.metrics_port, "/metrics")[1]

    for i in range(50):
        assert get(server.http_port, f"/no/such/path/{i}")[0] == 404
    before = metrics()
    for i in range(50, 300):
        get(server.http_port, f"/no/such/path/{i}")
    after = metrics()
    assert b"/no/such/path" not in after
    assert b'path="unmatched"' in after
    assert abs(len(after) - len(before)) <= 0.01 * len(before)


@pytest.mark.parametrize("body, field", [
    (b'{"model": "fusion", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    (b'{"model": "fusion", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', "stop[0]"),
    (b'{"model": "fusion", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    (b'{"model": "fusion", "messages": [{"role": "user", "content": "hi"}], "fusion": {"weights": {"a": 1e300}}}',
     "fusion.weights"),
    (b'{"model": "fusion", "messages": [{"role": "user", "content": "hi"}], "fusion": {"weights": {"a": 1e-300}}}',
     "fusion.weights"),
    (b'{"model": "fusion", "messages": [' + b",".join([b'{"role": "user", "content": "x"}'] * 5000) + b"]}",
     "messages"),
    (b'{"model": "fusion", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "description": "\\ud800"}}}}',
     "response_format"),
    (b'{"model": "fusion", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", '
     b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "' + b"1" * 5000
     + b'"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}', "messages[1].tool_calls"),
], ids=["lone-surrogate", "surrogate-stop", "deep-json", "huge-weight", "tiny-weight", "too-many-messages",
        "surrogate-schema", "tool-arguments-past-the-digit-limit"])
def test_hostile_bodies_are_400_naming_the_field(server, body, field):
    status, answer = post(server.http_port, "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == field or (field is None and answer["error"]["param"] is None), answer
    status, _ = get(server.http_port, "/health")
    assert status == 200


def test_weights_outside_float32_are_invalid_argument_over_grpc(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        for weight in (1e300, 1e-300, -1e39):
            spec = fusion_pb2.FusionSpec(rule="logit_arithmetic", weights={"a": 1.0, "b": weight})
            spec.params.update({"lead": "a"})
            request = fusion_pb2.GenerateRequest(prompt="hi", spec=spec)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=HANG_S))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "float32" in caught.value.details()


def test_streams_go_on_while_connections_flood(server):
    """A stream over the official client finishes while idle connections come and go past the cap."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="fusion", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=30, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    idle = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(100)]
    try:
        rest = list(stream)
    finally:
        for sock in idle:
            sock.close()
    assert first.choices[0].delta.role == "assistant" and rest[-1].choices[0].finish_reason == "length"
    assert wait_until(lambda: server.servicer.service.active == 0)


def test_large_bodies_wait_for_their_keys_parse_budget(loop, tiny_dir):
    """Bodies over 64 KiB are parsed within http_parse_bytes_per_s: a third 100 KB body right after two
    waits past http_body_timeout_s and gets 429 with a Retry-After; a small body goes straight through."""
    limits = EDGE | {"max_request_bytes": 200_000, "http_parse_bytes_per_s": 50_000}
    config = parse_config(tiny_config_dict(tiny_dir, limits=limits))
    running, _ = loop.run(create_coordinator_server(config, http_address="127.0.0.1:0"))
    try:
        large = json.dumps({"model": "fusion", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
        statuses = [post(running.http_port, "/v1/chat/completions", large)[0] for _ in range(2)]
        assert statuses == [400, 400]  # parsed, then refused by max_prompt_tokens
        request = urllib.request.Request(f"http://127.0.0.1:{running.http_port}/v1/chat/completions", data=large,
                                         headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=HANG_S)
        assert caught.value.code == 429 and 1 <= int(caught.value.headers["Retry-After"]) <= 5
        assert "http_parse_bytes_per_s" in json.loads(caught.value.read())["error"]["message"]
        small = json.dumps({"model": "fusion", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert post(running.http_port, "/v1/chat/completions", small.encode())[0] == 200
    finally:
        loop.run(running.stop(0))


# -- what OpenAI's clients and browsers expect at the edge -----------------------------------------------
def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)


def test_models_retrieve(server):
    client = client_of(server)
    assert client.models.retrieve("fusion").id == "fusion"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.body["param"] == "model"


def test_every_response_carries_a_request_id(server):
    client = client_of(server)
    reply = client.chat.completions.create(model="fusion", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply._request_id and reply._request_id.startswith("req-")
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/models",
                                     headers={"x-request-id": "trace-42"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.headers["x-request-id"] == "trace-42"
    assert get(server.http_port, "/no/such/path")[0] == 404  # errors too
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health", timeout=10) as answer:
        assert answer.headers["x-request-id"]


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", True), ("stream", "yes"), ("n", "2"), ("temperature", 3.0),
    ("top_p", 1.5), ("presence_penalty", -3), ("seed", 1.5),
])
def test_values_of_the_wrong_type_or_past_openais_bounds_are_400(server, field, value):
    body = {"model": "fusion", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    status, answer = post(server.http_port, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == field, answer


def test_logit_bias_keys_are_token_ids_as_strings(server):
    body = {"model": "fusion", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logit_bias": {"5": -100}}
    assert post(server.http_port, "/v1/chat/completions", json.dumps(body).encode())[0] == 200


def test_completion_text_offsets_start_after_the_prompt(server):
    client = client_of(server)
    prompt = "the quick brown fox"
    seen = []
    for stream in (False, True):
        reply = client.completions.create(model="fusion", prompt=prompt, max_tokens=8, logprobs=1, stream=stream,
                                          extra_body={"ignore_eos": True}, temperature=0.0)
        choices = [c.choices[0] for c in reply] if stream else reply.choices
        offsets = [o for c in choices for o in c.logprobs.text_offset]
        text = "".join(c.text for c in choices)
        assert offsets[0] == len(prompt) and offsets == sorted(offsets) and offsets[-1] <= len(prompt) + len(text)
        seen.append(offsets)
    assert seen[0] == seen[1]  # streamed or not, the same offsets


def test_cors_for_the_allowed_origins_only(server):
    def preflight(origin: str):
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/chat/completions", method="OPTIONS",
                                         headers={"origin": origin, "access-control-request-method": "POST",
                                                  "access-control-request-headers": "authorization,content-type"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.headers
        except urllib.error.HTTPError as err:
            return err.code, err.headers

    status, headers = preflight(ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    status, headers = preflight("https://elsewhere.example")
    assert headers.get("access-control-allow-origin") is None
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/models", headers={"origin": ORIGIN})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in answer.headers["access-control-expose-headers"]


def test_tokens_holding_part_of_a_character_keep_their_own_bytes(server):
    """Byte-level BPE has a token for each byte: alone, a byte of a multi-byte character is no text.
    Its logprob entries show its own bytes (`bytes:\\xNN`), distinct from every other such token, never
    U+FFFD; whole characters stay text, and offsets count decoded characters."""
    from fusion.services.openai_responses import completion_logprobs, token_string, utf8_decoder
    from fusion.engine.types import TokenEvent

    service = server.servicer.service
    partial = [i for i in range(service.engine.vocab_size)
               if len(service.token_bytes(i)) == 1 and service.token_bytes(i)[0] >= 0x80][:3]
    assert len(partial) == 3 and all(service.token_text(i) == "\ufffd" for i in partial)
    strings = [token_string(service.token_bytes(i)) for i in partial]
    assert len(set(strings)) == 3 and all(s.startswith("bytes:\\x") for s in strings)
    events = [TokenEvent("r", k, i, -1.0, [(j, -2.0) for j in partial], []) for k, i in enumerate(partial)]
    logprobs, end = completion_logprobs(events, service.token_bytes, 10, utf8_decoder())
    assert logprobs["tokens"] == strings and all(len(top) == 3 for top in logprobs["top_logprobs"])
    # é is c3 a9: two tokens, one character, offset moving once it is whole
    e_acute = [next(i for i in range(service.engine.vocab_size) if service.token_bytes(i) == bytes([b]))
               for b in "é".encode()]
    two = [TokenEvent("r", k, i, -1.0, [], []) for k, i in enumerate(e_acute)]
    logprobs, end = completion_logprobs(two, service.token_bytes, 0, utf8_decoder())
    assert logprobs["text_offset"] == [0, 0] and end == 1
    client = client_of(server)
    reply = client.chat.completions.create(model="fusion", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, logprobs=True, top_logprobs=5)
    for entry in reply.choices[0].logprobs.content:
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
        assert "\ufffd" not in entry.token
