"""A Python client for the Fusion service.

`FusionClient(address).generate(prompt, sampling, spec)` yields the same `TextEvent`s as the local
`FusionService.submit` (with `TokenEvent`s and per-expert `ExpertAttribution`s), so code reading a
local stream reads a remote one unchanged; the last event also carries `usage`. Closing the iterator
early cancels the stream, which frees the request's sessions on every expert. Failed calls raise the
domain errors of `fusion.errors` (the gRPC error is their `__cause__`).
"""

from __future__ import annotations

import json

from typing import Any, Iterator, Sequence

import grpc

from fusion.config import FusionSpec, SamplingParams, SecurityConfig, SpecOverrides
from fusion.engine.types import ExpertAttribution, TokenEvent
from fusion.errors import FusionError
from fusion.frontdoor.service import ScoreResult, TextEvent, Usage
from fusion.frontdoor.text import Message
from fusion.services.protos import FUSION_SERVICE, fusion_pb2, fusion_pb2_grpc
from fusion.services.tls import api_key_metadata, open_channel
from fusion.services.serving import channel_options
from fusion.services.status import error_from_rpc
from fusion.services.wire import generate_request, spec_to_proto


GenerateEvent = TextEvent  # the same events as a local FusionService stream; `usage` on the last one


def event_from_response(response: fusion_pb2.GenerateResponse) -> GenerateEvent:
    token = TokenEvent(
        request_id=response.request_id,
        index=response.index,
        token_id=response.token_id,
        logprob=response.logprob,
        top_logprobs=[(t.token_id, t.logprob) for t in response.top_logprobs],
        attribution=[
            ExpertAttribution(a.expert, a.weight, a.prob if a.HasField("prob") else None) for a in response.attribution
        ],
        finish_reason=response.finish_reason or None,
    )
    usage = Usage(response.usage.prompt_tokens, response.usage.completion_tokens) if response.HasField("usage") else None
    return GenerateEvent(token, response.text, response.finish_reason or None, usage)


def several_coordinators(attempts: int = 4) -> list[tuple[str, Any]]:
    """Channel options for a target of several coordinators: round robin over the reachable ones, and
    calls refused UNAVAILABLE (a coordinator down or draining) tried again on another, up to
    `attempts` times, before any answer has come (gRPC never retries a stream that has answered)."""
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": [{"service": FUSION_SERVICE}],
            "retryPolicy": {"maxAttempts": attempts, "initialBackoff": "0.1s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    }
    return [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]


class FusionClient:
    def __init__(self, address: str, *, timeout: float | None = None, max_message_bytes: int = 64 * 1024 * 1024,
                 api_key: str | None = None, security: SecurityConfig | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        """`api_key` is sent with every call; `security` (a config's section) or `credentials` make
        the channel TLS (plaintext without either). `address` may list several coordinators,
        "10.0.0.1:50051,10.0.0.2:50051" (IPv4): calls go round robin over those that answer, and a call
        refused UNAVAILABLE before its first answer is sent again to another (`several_coordinators`),
        so a coordinator that dies costs the streams it was serving, each ending UNAVAILABLE, and no
        new request."""
        self.address = address
        self.timeout = timeout  # default deadline of each call, in seconds
        target, options = address, channel_options(max_message_bytes)
        if "," in address:
            target, options = f"ipv4:{address}", options + several_coordinators()
        self.channel = open_channel(target, security, options, metadata=api_key_metadata(api_key),
                                    credentials=credentials)
        self.stub = fusion_pb2_grpc.FusionStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> FusionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompt: str | Sequence[Message],
        sampling: dict[str, Any] | SamplingParams | None = None,
        spec: FusionSpec | SpecOverrides | None = None,
        *,
        timeout: float | None = None,
        request_id: str = "",
        continue_final_message: bool = False,
    ) -> Iterator[GenerateEvent]:
        """Stream the fused answer. `sampling` overrides the server's defaults field by field; `spec`
        None uses the server's default fusion spec; `continue_final_message`: the answer carries on the
        last message, the assistant's."""
        request = generate_request(prompt, sampling, spec, request_id, continue_final_message)  # bad arguments raise here
        return self._stream(request, timeout or self.timeout)

    def _stream(self, request: fusion_pb2.GenerateRequest, timeout: float | None) -> Iterator[GenerateEvent]:
        call = self.stub.Generate(request, timeout=timeout)  # starts on the first next()
        try:
            for response in call:
                yield event_from_response(response)
        except grpc.RpcError as err:
            raise self._error(err) from err
        finally:
            call.cancel()  # a no-op after the last message; frees the sessions when closed early

    def score(self, prompt: str, continuation: str, spec: FusionSpec | SpecOverrides | None = None, *,
              timeout: float | None = None) -> ScoreResult:
        request = fusion_pb2.ScoreRequest(prompt=prompt, continuation=continuation)
        if spec is not None:
            request.spec.CopyFrom(spec_to_proto(spec))
        try:
            response = self.stub.Score(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise self._error(err) from err
        return ScoreResult(list(response.token_ids), list(response.logprobs), pieces=list(response.pieces),
                           remote_bits_per_byte=response.bits_per_byte if response.HasField("bits_per_byte") else None)

    def describe(self, *, timeout: float | None = None) -> fusion_pb2.DescribeResponse:
        try:
            return self.stub.Describe(fusion_pb2.DescribeRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise self._error(err) from err

    def _error(self, err: grpc.RpcError) -> FusionError:
        unreachable = err.code() == grpc.StatusCode.UNAVAILABLE and "expert" not in (err.details() or "")
        return error_from_rpc(err, f"server {self.address}" if unreachable else None)


def stream_remote(
    server: str, prompt: str | Sequence[Message], overrides: dict[str, Any], spec: FusionSpec | SpecOverrides | None,
    *, security: SecurityConfig | None = None, api_key: str | None = None,
) -> Iterator[GenerateEvent]:
    """What `fusion generate --server HOST:PORT` streams (TLS as `security` says; the API key from
    `api_key` or $FUSION_API_KEY)."""
    import os

    with FusionClient(server, security=security, api_key=api_key or os.environ.get("FUSION_API_KEY")) as client:
        yield from client.generate(prompt, overrides, spec)
