"""Admission bounds: every request field has an explicit, configurable bound, checked once before any
work; a request at the bound is admitted, one past it is refused with an error naming the field and
the bound. Per-request step state (bias row, stop ids) is built at admission."""

from __future__ import annotations

import pytest
import torch

from fusion.config import parse_config
from fusion.errors import InvalidArgumentError, ResourceExhaustedError
from fusion.frontdoor.service import FusionRequest, FusionService
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S

LIMITS = {
    "max_prompt_bytes": 64, "max_messages": 3, "max_stop_strings": 2, "max_stop_chars": 5,
    "max_stop_token_ids": 2, "max_logit_bias": 2, "max_banned_token_ids": 2, "max_tokens": 40,
    "max_score_tokens": 4, "max_prompt_tokens": 400,
}


@pytest.fixture(scope="module")
def bounded(tiny_dir):
    service = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, limits=LIMITS, sampling={"max_tokens": 8})))
    yield service
    service.close()


def messages(n):
    return [{"role": "user", "content": "hi"}] * n


# (request at the bound, the same field past it, error type, what the message must name)
BOUNDS = [
    (FusionRequest("x" * 64), FusionRequest("x" * 65), ResourceExhaustedError, "prompt: 65 bytes exceed max_prompt_bytes=64"),
    (FusionRequest("é" * 32), FusionRequest("é" * 33), ResourceExhaustedError, "max_prompt_bytes=64"),  # UTF-8 bytes
    (FusionRequest(messages(3)), FusionRequest(messages(4)), ResourceExhaustedError, "messages: 4 messages exceed max_messages=3"),
    (FusionRequest("hi", {"stop": ["a", "b"]}), FusionRequest("hi", {"stop": ["a", "b", "c"]}),
     ResourceExhaustedError, "stop: 3 strings exceed max_stop_strings=2"),
    (FusionRequest("hi", {"stop": ["abcde"]}), FusionRequest("hi", {"stop": ["abcdef"]}),
     ResourceExhaustedError, "stop[0]: 6 characters exceed max_stop_chars=5"),
    (FusionRequest("hi", {"stop_token_ids": [1, 2]}), FusionRequest("hi", {"stop_token_ids": [1, 2, 3]}),
     ResourceExhaustedError, "stop_token_ids: 3 entries exceed max_stop_token_ids=2"),
    (FusionRequest("hi", {"logit_bias": {1: 1.0, 2: 1.0}}), FusionRequest("hi", {"logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}}),
     ResourceExhaustedError, "logit_bias: 3 entries exceed max_logit_bias=2"),
    (FusionRequest("hi", {"banned_token_ids": [1, 2]}), FusionRequest("hi", {"banned_token_ids": [1, 2, 3]}),
     ResourceExhaustedError, "banned_token_ids: 3 entries exceed max_banned_token_ids=2"),
    (FusionRequest("hi", {"max_tokens": 40}), FusionRequest("hi", {"max_tokens": 41}),
     ResourceExhaustedError, "max_tokens: 41 exceeds the limit 40"),
    (FusionRequest("hi", request_id="r" * 128), FusionRequest("hi", request_id="r" * 129),
     InvalidArgumentError, "request_id: 129 characters exceed max_request_id_chars=128"),
]


@pytest.mark.parametrize("at,past,error,match", BOUNDS, ids=[b[3].split(":")[0] for b in BOUNDS])
def test_each_bound_admits_at_and_refuses_past(bounded, at, past, error, match):
    bounded.admit(at)
    with pytest.raises(error) as refused:
        bounded.admit(past)
    assert match in str(refused.value)


@pytest.mark.parametrize("field", ["stop_token_ids", "banned_token_ids", "logit_bias"])
def test_ids_outside_the_vocabulary_are_refused(bounded, field):
    """Out-of-range ids were silently ignored; now they name the field and the range."""
    vocab = bounded.engine.vocab_size
    value = {vocab: 1.0} if field == "logit_bias" else [vocab]
    with pytest.raises(InvalidArgumentError, match=rf"{field}: token ids out of range \[0, {vocab}\): \[{vocab}\]"):
        bounded.admit(FusionRequest("hi", {field: value}))


def test_request_outgrowing_an_expert_context_is_refused(tiny_dir):
    """prompt + max_tokens past any consulted expert's max_positions never reaches the batch (it would
    fail the forward of every stream sharing it)."""
    service = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, limits={"max_tokens": 600})))
    positions = service.engine.experts[0].info.max_positions
    prompt_len = len(service.prompt_ids("hi")[0])
    service.admit(FusionRequest("hi", {"max_tokens": positions - prompt_len}))
    with pytest.raises(InvalidArgumentError, match=rf"max_tokens: the prompt \({prompt_len} tokens\) \+ max_tokens "
                                                  rf"\({positions - prompt_len + 1}\) exceed expert 'a''s context of "
                                                  rf"{positions} positions"):
        service.admit(FusionRequest("hi", {"max_tokens": positions - prompt_len + 1}))
    service.close()


def test_score_bounds(bounded):
    with pytest.raises(ResourceExhaustedError, match="continuation: .* tokens exceed max_score_tokens=4"):
        bounded.score("hello", "the cat sat on the mat today")
    with pytest.raises(ResourceExhaustedError, match="prompt: 65 bytes exceed max_prompt_bytes=64"):
        bounded.score("x" * 65, "the")
    assert len(bounded.score("hello", "the").logprobs) >= 1


def test_chunked_score_equals_one_chunk(tiny_service, monkeypatch):
    """Scoring in chunks (each its own compute job, the cache carrying the prefix) gives the same
    log-probabilities as one pass."""
    from fusion.engine import core as engine_module
    text = "the quick brown fox jumps over the lazy dog and the cat"
    whole = tiny_service.score("hello", text)
    monkeypatch.setattr(engine_module, "SCORE_CHUNK", 3)
    chunked = tiny_service.score("hello", text)
    assert chunked.token_ids == whole.token_ids and len(whole.token_ids) > 6
    torch.testing.assert_close(torch.tensor(chunked.logprobs), torch.tensor(whole.logprobs), atol=1e-4, rtol=1e-4)
    assert all(e.active_sessions == 0 for e in tiny_service.experts)


def test_step_state_is_built_once_at_admission(tiny_service):
    vocab = tiny_service.engine.vocab_size
    admitted = tiny_service.admit(FusionRequest("hi", {"logit_bias": {5: 2.0}, "banned_token_ids": [7],
                                                       "stop_token_ids": [9], "ignore_eos": True}))
    expected = torch.zeros(vocab)
    expected[5], expected[7] = 2.0, float("-inf")
    assert torch.equal(admitted.token_bias, expected)
    assert admitted.stop_ids == frozenset({9})
    plain = tiny_service.admit(FusionRequest("hi"))
    assert plain.token_bias is None and plain.stop_ids == tiny_service.engine.eos_token_ids


def test_client_messages_are_capped_apart_from_expert_logits(tiny_dir):
    """A client may send the coordinator at most max_request_bytes (requests are small), whatever
    max_message_bytes allows between the coordinator and its experts; the server serves on."""
    import grpc

    from fusion.services.background import BackgroundLoop
    from fusion.services.client import FusionClient
    from fusion.services.coordinator import create_coordinator_server
    from fusion.services.protos import fusion_pb2, fusion_pb2_grpc

    config = parse_config(tiny_config_dict(tiny_dir, limits={"max_request_bytes": 64 * 1024},
                                           sampling={"max_tokens": 3}))
    with BackgroundLoop() as loop:
        server, port = loop.run(create_coordinator_server(config))
        with grpc.insecure_channel(f"127.0.0.1:{port}",
                                   options=[("grpc.max_send_message_length", 8 * 1024 * 1024)]) as channel:
            stub = fusion_pb2_grpc.FusionStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(fusion_pb2.GenerateRequest(prompt="x" * (1024 * 1024)), timeout=HANG_S))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with FusionClient(f"127.0.0.1:{port}", timeout=HANG_S) as client:
            assert len(list(client.generate("hello"))) == 3
        loop.run(server.stop(0))
