"""Unit tests of the services' pieces without servers: the logits wire format, request conversions,
the status-code table and the generated-code build."""

from __future__ import annotations

import grpc
import pytest
import torch

from fusion.config import FusionSpec, SamplingParams, SpecOverrides
from fusion.errors import (
    ConfigError,
    ExpertOutputError,
    ExpertUnavailableError,
    FusionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ServiceBusyError,
    SessionReleasedError,
)
from fusion.services import protos
from fusion.services.protos import expert_pb2, fusion_pb2
from fusion.services.status import error_from_status, http_status_for, status_for
from fusion.services.wire import (
    decode_tensor,
    encode_tensor,
    generate_request,
    prompt_from_request,
    sampling_overrides,
    sampling_to_proto,
    spec_overrides_from_proto,
    spec_to_proto,
    wire_dtype,
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_logits_round_trip_is_exact_for_values_of_the_wire_dtype(dtype):
    source = torch.randn(3, 257).to(getattr(torch, dtype)).float()  # (B, V) values a model of `dtype` makes
    message = encode_tensor(source, dtype)
    assert message.dtype == dtype and list(message.shape) == [3, 257]
    assert len(message.data) == 3 * 257 * source.to(getattr(torch, dtype)).element_size()
    back = decode_tensor(message, "test")
    assert back.dtype == torch.float32
    assert torch.equal(back, source)


def test_decode_refuses_bytes_that_do_not_fit():
    message = encode_tensor(torch.zeros(2, 5), "float32")
    message.shape[:] = [2, 6]
    with pytest.raises(ExpertOutputError, match="expert 'x'.*do not fit"):
        decode_tensor(message, "expert 'x'")
    with pytest.raises(ExpertOutputError, match="unknown logits dtype"):
        decode_tensor(expert_pb2.Tensor(data=b"", dtype="int4", shape=[0]), "expert 'x'")
    assert decode_tensor(encode_tensor(torch.zeros(0, 5), "bfloat16"), "x").shape == (0, 5)


def test_wire_dtype_defaults_to_the_models_own():
    assert wire_dtype("", "bfloat16") == "bfloat16"
    assert wire_dtype("", "float8_e4m3fn") == "float32"
    assert wire_dtype("float16", "float32") == "float16"
    with pytest.raises(InvalidArgumentError, match="dtype"):
        wire_dtype("int8", "float32")


def test_sampling_overrides_hold_only_what_was_set():
    message = fusion_pb2.SamplingParams(temperature=0.0, seed=0, stop=["\n"], logit_bias={5: -1.0})
    assert sampling_overrides(message) == {"temperature": 0.0, "seed": 0, "stop": ["\n"], "logit_bias": {5: -1.0}}
    assert sampling_overrides(fusion_pb2.SamplingParams()) == {}
    full = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x"], logit_bias={1: 2.0})
    assert SamplingParams(**sampling_overrides(sampling_to_proto(full))) == full


def test_sampling_to_proto_names_unknown_or_mistyped_fields():
    with pytest.raises(InvalidArgumentError, match="temperture"):
        sampling_to_proto({"temperture": 1.0})
    with pytest.raises(InvalidArgumentError, match="sampling"):
        sampling_to_proto({"top_k": "many"})


def test_spec_overrides_round_trip():
    spec = FusionSpec(rule="logit_arithmetic", params={"alpha": 0.1, "lead": 0}, weights={"a": 1.5, "b": -0.5})
    assert spec_overrides_from_proto(spec_to_proto(spec)) == SpecOverrides.of(spec)  # Struct's doubles: ints
    assert spec_overrides_from_proto(fusion_pb2.FusionSpec()) == SpecOverrides()  # nothing set: all defaults
    partial = SpecOverrides(params={"hard": True}, profile="general")
    assert spec_overrides_from_proto(spec_to_proto(partial)) == partial  # unset fields stay unset on the wire


def test_prompt_or_messages():
    assert prompt_from_request(generate_request("hi")) == "hi"
    chat = [{"role": "user", "content": "hi"}]
    assert prompt_from_request(generate_request(chat)) == chat
    both = generate_request("hi")
    both.messages.add(role="user", content="hi")
    with pytest.raises(InvalidArgumentError, match="prompt, messages"):
        prompt_from_request(both)


@pytest.mark.parametrize("error,code", [
    (NotFoundError("x"), grpc.StatusCode.NOT_FOUND),
    (InvalidArgumentError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError("x"), grpc.StatusCode.INTERNAL),  # not a domain error: a bug, not the client's fault
    (ResourceExhaustedError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ExpertUnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
    (ExpertOutputError("x"), grpc.StatusCode.INTERNAL),
    (SessionReleasedError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_codes(error, code):
    assert status_for(error)[0] == code


@pytest.mark.parametrize("error,status", [
    (NotFoundError("x"), 404),
    (InvalidArgumentError("x"), 400),
    (ResourceExhaustedError("x"), 400),  # a request past a size limit: retrying it cannot help
    (ServiceBusyError("x"), 429),  # no free slot: it may succeed later
    (ExpertUnavailableError("x"), 503),
    (ExpertOutputError("x"), 500),
    (RuntimeError("secret path"), 500),
])
def test_http_statuses(error, status):
    code, message = http_status_for(error)
    assert code == status
    assert "secret path" not in message


def test_status_back_to_domain_errors():
    assert isinstance(error_from_status(grpc.StatusCode.NOT_FOUND, "m"), NotFoundError)
    assert isinstance(error_from_status(grpc.StatusCode.UNAVAILABLE, "m"), ExpertUnavailableError)
    assert isinstance(error_from_status(grpc.StatusCode.FAILED_PRECONDITION, "m"), SessionReleasedError)
    other = error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")
    assert type(other) is FusionError and str(other) == "DEADLINE_EXCEEDED: too slow"


def test_generated_code_is_current():
    stamp = protos._source_hash()
    assert protos._STAMP.read_text() == stamp
    protos.ensure_generated()  # a no-op when current
    assert {"Generate", "Score", "Describe"} <= set(
        fusion_pb2.DESCRIPTOR.services_by_name["Fusion"].methods_by_name)


def test_keepalive_pings_are_ones_the_servers_accept():
    from fusion.services.serving import keepalive_channel_options, keepalive_server_options

    channel, server = dict(keepalive_channel_options()), dict(keepalive_server_options())
    assert channel["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"] == 1
    # A server answers pings more frequent than its minimum with GOAWAY (too_many_pings).
    assert channel["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert channel["grpc.keepalive_time_ms"] + channel["grpc.keepalive_timeout_ms"] <= 30_000  # seconds, not minutes
