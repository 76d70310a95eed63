"""The OpenAI-compatible HTTP API end to end: a coordinator serving gRPC and HTTP from one process on
loopback ports (tiny experts on their own Expert servers), the official `openai` package as the client.

The HTTP path must give the tokens of the in-process service and of gRPC for the same request; errors
come in OpenAI's shape with the right status and the field named; a client that goes away frees its
sessions on every expert.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Literal

import jsonschema
import pydantic
import pytest
import torch

openai = pytest.importorskip("openai", reason="the HTTP tests use the official client: pip install openai")

from fusion.config import SpecOverrides, parse_config  # noqa: E402
from fusion.experts.expert import LocalExpert  # noqa: E402
from fusion.frontdoor.service import FusionRequest  # noqa: E402
from fusion.services.client import FusionClient  # noqa: E402
from fusion.services.coordinator import create_coordinator_server  # noqa: E402
from fusion.services.expert_server import create_expert_server  # noqa: E402
from fusion.services.openai_responses import token_string  # noqa: E402
from fusion.services.api_keys import create_key  # noqa: E402
from tests.conftest import tiny_config_dict  # noqa: E402
from tests.helpers import HANG_S  # noqa: E402
from tests.test_grpc import addr, expert_sessions, experts, wait_until  # noqa: E402,F401 (experts: a fixture)

LIMITS = {"max_prompt_tokens": 1024, "max_tokens": 400, "max_request_bytes": 64 * 1024}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 12 + 35 ?"}]
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}  # a stream that runs until it is stopped


def start(loop, tiny_dir, addresses, **extra):
    """A coordinator over remote experts, serving gRPC and HTTP: (server, gRPC port, HTTP port)."""
    data = tiny_config_dict(tiny_dir, **extra)
    for expert in data["experts"]:
        expert["addresses"] = addresses[expert["name"]]
    server, port = loop.run(create_coordinator_server(parse_config(data), metrics_port=0, metrics_host="127.0.0.1",
                                                      http_address="127.0.0.1:0"))
    return server, port, server.http_port


@pytest.fixture(scope="module")
def coordinator(loop, tiny_dir, experts):
    server, port, http_port = start(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()}, limits=LIMITS)
    yield server, port, http_port
    loop.run(server.stop(0))


def client_for(http_port: int, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(api_key=api_key, base_url=f"http://127.0.0.1:{http_port}/v1", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def client(coordinator):
    with client_for(coordinator[2]) as c:
        yield c


def token_ids(choice) -> list[int]:
    return [t["token_id"] for t in choice.model_extra["fusion"]["tokens"]]


def no_sessions_left(server, experts) -> bool:
    return (wait_until(lambda: all(expert_sessions(port) == 0 for _, port in experts.values()))
            and wait_until(lambda: server.servicer.service.active == 0))


# -- the same answers as the service ------------------------------------------------------------------
def test_models_lists_the_fused_model_and_each_profile(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["fusion", "fusion:ab", "fusion:only_a"]
    assert models[1].model_extra["fusion"] == {"profile": "ab", "weights": {"a": 1.0, "b": 1.0}}


def test_chat_matches_the_service(client, tiny_service):
    local = tiny_service.complete(CHAT, {"max_tokens": 12})
    reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=12,
                                           extra_body={"fusion": {"attribution": True}})
    [choice] = reply.choices
    assert token_ids(choice) == local.token_ids
    assert choice.message.content == local.text and choice.message.role == "assistant"
    assert choice.finish_reason == local.finish_reason
    assert reply.object == "chat.completion" and reply.model == "fusion"
    assert reply.usage.completion_tokens == len(local.token_ids)
    assert reply.usage.prompt_tokens == len(tiny_service.prompt_ids(CHAT)[0])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_continues_the_final_assistant_message_as_the_service_does(client, tiny_service):
    """vLLM's continue_final_message: the answer carries on the assistant's opening, the same tokens the
    service gives for the same request; a last message that is not the assistant's is a 400 naming it."""
    opened = CHAT + [{"role": "assistant", "content": "Sure, here"}]
    local = list(tiny_service.submit(FusionRequest(opened, {"max_tokens": 8}, continue_final_message=True)))
    reply = client.chat.completions.create(model="fusion", messages=opened, max_tokens=8, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "fusion": {"attribution": True}})
    assert token_ids(reply.choices[0]) == [e.token.token_id for e in local]
    assert reply.usage.prompt_tokens == len(tiny_service.prompt_ids(opened, continue_final_message=True)[0])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=4,
                                       extra_body={"continue_final_message": True})
    assert refused.value.body["param"] == "continue_final_message" and "assistant" in refused.value.body["message"]


def test_completions_heal_the_prompt_as_the_service_does(client, tiny_service):
    """`token_healing` (an extra field): the same tokens and text as the service's healed request, the
    prompt counted without its backed-up last token."""
    prompt, asked = "what is 12 + 35 ? the answer is ", {"max_tokens": 6, "ignore_eos": True, "token_healing": True}
    local = list(tiny_service.submit(FusionRequest(prompt, asked, plain=True)))
    reply = client.completions.create(model="fusion", prompt=prompt, max_tokens=6, extra_body={
        "ignore_eos": True, "token_healing": True, "fusion": {"attribution": True}})
    assert token_ids(reply.choices[0]) == [e.token.token_id for e in local]
    assert reply.choices[0].text == "".join(e.text for e in local)
    assert reply.usage.prompt_tokens == local[-1].usage.prompt_tokens == len(tiny_service.prompt_ids(prompt, plain=True)[0]) - 1


def test_chat_streams_the_same_answer(client, tiny_service):
    local = tiny_service.complete(CHAT, {"max_tokens": 12})
    chunks = list(client.chat.completions.create(model="fusion", messages=CHAT, max_completion_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"fusion": {"attribution": True}}))
    *tokens, last = chunks
    assert tokens[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in tokens) == local.text
    assert [t for c in tokens for t in token_ids(c.choices[0])] == local.token_ids
    assert tokens[-1].choices[0].finish_reason == local.finish_reason
    assert all(c.usage is None for c in tokens) and all(c.object == "chat.completion.chunk" for c in chunks)
    assert last.choices == [] and last.usage.completion_tokens == len(local.token_ids)


def test_completions_continue_the_text_as_is(client, tiny_service):
    prompt = "the quick brown fox"
    local = tiny_service.complete(prompt, {"max_tokens": 10})  # through the chat template: another answer
    plain = list(tiny_service.submit(FusionRequest(prompt, {"max_tokens": 10}, plain=True)))
    reply = client.completions.create(model="fusion", prompt=prompt, max_tokens=10,
                                      extra_body={"fusion": {"attribution": True}})
    assert token_ids(reply.choices[0]) == [e.token.token_id for e in plain] != local.token_ids
    assert reply.choices[0].text == "".join(e.text for e in plain)
    assert reply.object == "text_completion"
    streamed = list(client.completions.create(model="fusion", prompt=prompt, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    assert streamed[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    # Several prompts: one choice each, in order.
    both = client.completions.create(model="fusion", prompt=[prompt, "hello world"], max_tokens=4,
                                     extra_body={"fusion": {"attribution": True}})
    assert [c.index for c in both.choices] == [0, 1]
    assert token_ids(both.choices[0]) == [e.token.token_id for e in plain[:4]]
    assert both.usage.prompt_tokens == sum(len(tiny_service.prompt_ids(p, plain=True)[0])
                                           for p in (prompt, "hello world"))


def test_n_choices_seeded_and_reproducible(client):
    def ask(n, seed):
        reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=16, temperature=1.0, n=n,
                                               seed=seed, extra_body={"fusion": {"attribution": True}})
        return [token_ids(c) for c in sorted(reply.choices, key=lambda c: c.index)]

    two = ask(2, 5)
    assert len(two) == 2 and two[0] != two[1]
    assert ask(2, 5) == two  # the same request again: the same choices
    assert ask(1, 5) == two[:1] and ask(1, 6) == two[1:]  # choice i is seeded with seed + i
    streamed = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=16, temperature=1.0, n=2,
                                              seed=5, stream=True, extra_body={"fusion": {"attribution": True}})
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    for chunk in streamed:
        for choice in chunk.choices:
            by_choice[choice.index] += token_ids(choice)
    assert [by_choice[0], by_choice[1]] == two


def test_seeded_sampling_is_reproducible_and_matches_the_service(client, tiny_service):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 16}
    local = tiny_service.complete(CHAT, {**sampling, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                                         "presence_penalty": 0.5, "frequency_penalty": 0.3})

    def ask(seed):
        reply = client.chat.completions.create(
            model="fusion", messages=CHAT, max_tokens=16, temperature=0.9, top_p=0.95, seed=seed, presence_penalty=0.5,
            frequency_penalty=0.3, extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                                               "fusion": {"attribution": True}})
        return token_ids(reply.choices[0])

    assert ask(7) == ask(7) == local.token_ids
    assert ask(8) != local.token_ids


def test_logprobs_with_top_alternatives(client, tiny_service):
    local = tiny_service.complete(CHAT, {"max_tokens": 8, "logprobs": 3})
    reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(local.events)
    for entry, event in zip(content, local.events):
        assert entry.token == token_string(tiny_service.token_bytes(event.token_id))
        assert entry.bytes == list(tiny_service.token_bytes(event.token_id))
        assert entry.logprob == pytest.approx(event.logprob, abs=1e-5)
        assert [t.token for t in entry.top_logprobs] == [token_string(tiny_service.token_bytes(t))
                                                         for t, _ in event.top_logprobs]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in event.top_logprobs], abs=1e-5)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    # Without top_logprobs: each token's own logprob only.
    plain = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=8, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)
    assert reply.choices[0].logprobs is not None and client.chat.completions.create(
        model="fusion", messages=CHAT, max_tokens=2).choices[0].logprobs is None
    # Completions: tokens, their logprobs, top alternatives and offsets.
    completion = client.completions.create(model="fusion", prompt="hello world", max_tokens=6, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert logprobs.text_offset[0] == len("hello world") and all(len(top) <= 2 for top in logprobs.top_logprobs)
    streamed = list(client.completions.create(model="fusion", prompt="hello world", max_tokens=6, logprobs=2,
                                              stream=True))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == logprobs.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == logprobs.text_offset


def test_stop_strings(client, tiny_service):
    full = tiny_service.complete(CHAT, {"max_tokens": 24, "ignore_eos": True}).text
    stop = next(c for c in full[2:] if c.isascii() and c.isalnum())  # the tiny models' text is mostly noise
    assert full.find(stop) > 0
    reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=24, stop=stop,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == full[: full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=24, stop=[stop, "zzzz"],
                                              stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.find(stop)]


def test_fusion_extension_rules_and_profiles(client, tiny_service):
    def attributions(fusion, **kwargs):
        reply = client.chat.completions.create(model=kwargs.pop("model", "fusion"), messages=CHAT, max_tokens=6,
                                               extra_body={"fusion": {**fusion, "attribution": True}}, **kwargs)
        tokens = reply.choices[0].model_extra["fusion"]["tokens"]
        return [t["token_id"] for t in tokens], [t["attribution"] for t in tokens]

    ids, weighted = attributions({})
    single_ids, single = attributions({"rule": "single", "params": {"expert": "b"}})
    assert {a["expert"]: a["weight"] for a in weighted[0]} == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})
    assert all(a["weight"] == (1.0 if a["expert"] == "b" else 0.0) for a in single[0])
    single_spec = SpecOverrides(rule="single", params={"expert": "b"})
    assert single_ids == tiny_service.complete(CHAT, {"max_tokens": 6}, single_spec).token_ids
    mixture_ids, _ = attributions({"rule": "mixture", "weights": {"a": 1.0, "b": 2.0}})
    assert mixture_ids == tiny_service.complete(CHAT, {"max_tokens": 6},
                                                SpecOverrides(rule="mixture", weights={"a": 1.0, "b": 2.0})).token_ids
    # `model` names a profile, as the extension's `profile` does.
    by_model, profile_weights = attributions({}, model="fusion:only_a")
    assert by_model == attributions({"profile": "only_a"})[0] == attributions({}, model="only_a")[0]
    assert by_model == tiny_service.complete(CHAT, {"max_tokens": 6}, SpecOverrides(profile="only_a")).token_ids
    assert {a["expert"]: a["weight"] for a in profile_weights[0]} == {"a": 1.0, "b": 0.0, "c": 0.0}


class Colour(pydantic.BaseModel):
    name: Literal["red", "green", "blue"]
    bright: bool


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}},
                                                "required": ["city"], "additionalProperties": False}}}

def test_response_format_json_schema_parses_into_the_model(client, tiny_service):
    """`parse` sends response_format json_schema (strict) and reads the answer back as the pydantic model;
    the answer is the service's own under the same grammar."""
    completion = client.chat.completions.parse(model="fusion", messages=CHAT, max_tokens=40, response_format=Colour,
                                               extra_body={"fusion": {"attribution": True}})
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Colour)
    local = tiny_service.complete(CHAT, {"max_tokens": 40, "structured": {
        "json_schema": openai.lib._pydantic.to_strict_json_schema(Colour)}})
    assert token_ids(completion.choices[0]) == local.token_ids
    reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=40,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_structured_outputs_extension(client):
    reply = client.completions.create(model="fusion", prompt="the quick brown", max_tokens=8,
                                      extra_body={"structured_outputs": {"choice": ["fox", "dog"]}})
    assert reply.choices[0].text in ("fox", "dog")
    reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=8,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}", reply.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_comes_back_as_tool_calls(client, stream):
    # one tool: the tags and the tool prompt are spelled out in the tiny 300-token vocabulary, long for its
    # 512 positions (tests/test_tool_calls.py calls among several tools with models of more positions)
    kwargs = dict(model="fusion", messages=CHAT, max_tokens=100, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False)
    if stream:  # a call's first delta carries its id and name, the next ones its arguments
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        parts = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
        assert {p.index for p in parts} == {0} and all(p.id is None for p in parts[1:])
        call_id, name = parts[0].id, parts[0].function.name
        arguments = "".join(p.function.arguments for p in parts)
        finish = chunks[-1].choices[0].finish_reason
    else:
        message = client.chat.completions.create(**kwargs).choices[0]
        [call], finish = message.message.tool_calls, message.finish_reason
        assert message.message.content is None and call.type == "function"
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish == "tool_calls" and call_id.startswith("call_") and name == "weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def reference_prompt_logprobs(service, ids: list[int]) -> torch.Tensor:
    """The fused log-distribution after each prefix of `ids` (teacher forced), computed apart: (n-1, V)."""
    engine = service.engine
    rule, weights = service.resolve_spec(None)
    prompts = [ids[:1]] * len(engine.experts)
    logits = engine.continuation_logits(prompts, ids[1:])
    return engine.fused_distribution(logits, ids[1:], rule, weights, ids[:1])


def test_echo_with_logprobs_scores_the_prompt_the_lm_eval_way(client, tiny_service):
    """lm-evaluation-harness's local-completions: token-id prompts, echo, logprobs 1, max_tokens 0 or 1."""
    ids = tiny_service.prompt_ids("the quick brown fox jumps", plain=True)[0]
    dist = reference_prompt_logprobs(tiny_service, ids)
    for max_tokens in (0, 1):
        reply = client.completions.create(model="fusion", prompt=ids, max_tokens=max_tokens, logprobs=1, echo=True,
                                          temperature=0)
        lp = reply.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = dist.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
        best = [tiny_service.token_text(i) for i in dist.argmax(-1).tolist()]
        assert [next(iter(t)) for t in lp.top_logprobs[1:len(ids)]] == [token_string(tiny_service.token_bytes(
            int(i))) for i in dist.argmax(-1).tolist()] and len(best) == len(ids) - 1
        assert len(lp.tokens) == len(ids) + max_tokens and lp.text_offset[0] == 0
        assert reply.choices[0].text.startswith(tiny_service.tokenizers[0].decode(ids))
    assert reply.usage.prompt_tokens == len(ids)


def test_prompt_logprobs_and_a_text_prompt_echoed_while_streaming(client, tiny_service):
    prompt = "hello world , fusion"
    ids = tiny_service.prompt_ids(prompt, plain=True)[0]
    dist = reference_prompt_logprobs(tiny_service, ids)
    reply = client.completions.create(model="fusion", prompt=prompt, max_tokens=0, echo=False,
                                      extra_body={"prompt_logprobs": 2})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for k, entry in enumerate(entries[1:]):
        token = str(ids[k + 1])
        assert entry[token]["logprob"] == pytest.approx(float(dist[k, ids[k + 1]]), abs=1e-4)
        assert entry[token]["rank"] == int((dist[k] > dist[k, ids[k + 1]]).sum()) + 1
        assert any(v["rank"] == 1 for v in entry.values())
    chunks = list(client.completions.create(model="fusion", prompt=prompt, max_tokens=4, echo=True, stream=True,
                                            logprobs=0))
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks).startswith(prompt)
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    with pytest.raises(openai.BadRequestError, match="max_tokens: 0 only with echo"):
        client.completions.create(model="fusion", prompt=prompt, max_tokens=0)


def test_same_tokens_as_grpc(coordinator, client):
    sampling = {"max_tokens": 16, "temperature": 0.8, "seed": 3, "stop": ["zz"]}
    spec = SpecOverrides(rule="mixture", weights={"a": 1.0, "c": 1.0})
    with FusionClient(addr(coordinator[1]), timeout=HANG_S) as grpc_client:
        expected = [e.token.token_id for e in grpc_client.generate(CHAT, sampling, spec)]
    reply = client.chat.completions.create(
        model="fusion", messages=CHAT, max_tokens=16, temperature=0.8, seed=3, stop=["zz"],
        extra_body={"fusion": {"rule": "mixture", "weights": {"a": 1.0, "c": 1.0}, "attribution": True}})
    assert token_ids(reply.choices[0]) == expected


# -- errors ------------------------------------------------------------------------------------------
BAD = {
    "temperature": (dict(temperature=-1), 400, "temperature"),
    "top_logprobs": (dict(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    "top_logprobs without logprobs": (dict(top_logprobs=2), 400, "top_logprobs"),
    "max_completion_tokens": (dict(max_completion_tokens=0), 400, "max_completion_tokens"),
    "max_tokens over the limit": (dict(max_tokens=5000), 400, "max_tokens"),
    "logit_bias": (dict(logit_bias={"5": 500}), 400, "logit_bias"),
    "stop": (dict(stop=[""]), 400, "stop[0]"),
    "n": (dict(n=0), 400, "n"),
    "named tool not given": (dict(tools=[{"type": "function", "function": {"name": "f"}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}}), 400,
                             "tool_choice.function.name"),
    "bad schema": (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format"),
    "two constraints": (dict(response_format={"type": "json_object"},
                             extra_body={"structured_outputs": {"regex": "a+"}}), 400, "structured_outputs"),
    "bad regex": (dict(extra_body={"structured_outputs": {"regex": "(a"}}), 400, "structured_outputs"),
    "message role": (dict(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    "image part": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                   400, "messages[0].content[0]"),
    "no messages": (dict(messages=[]), 400, "messages"),
    "unknown rule": (dict(extra_body={"fusion": {"rule": "nope"}}), 400, "fusion.rule"),
    "rule parameter": (dict(extra_body={"fusion": {"rule": "mixture", "params": {"tau": 1}}}), 400, "fusion.params"),
    "extension key": (dict(extra_body={"fusion": {"rules": "mixture"}}), 400, "fusion.rules"),
    "all weights zero": (dict(extra_body={"fusion": {"weights": {"a": 0.0}}}), 400, "fusion.weights"),
    "unknown model": (dict(model="gpt-4o"), 404, "model"),
    "unknown profile": (dict(extra_body={"fusion": {"profile": "nope"}}), 404, "fusion.profile"),
    "unknown expert": (dict(extra_body={"fusion": {"weights": {"zzz": 1.0}}}), 404, "fusion.weights"),
    "prompt over the limit": (dict(messages=[{"role": "user", "content": "the quick brown fox " * 200}]),
                              400, "messages"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_name_the_field(case, stream, client):
    fields, status, param = BAD[case]
    request = {"model": "fusion", "messages": CHAT, "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        reply = client.chat.completions.create(stream=stream, **request)
        list(reply) if stream else None
    error = caught.value
    assert error.status_code == status, error.body
    assert error.body["param"] == param and param.split("[")[0].split(".")[-1] in error.body["message"]
    assert error.body["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2).choices[0].message is not None


def test_unknown_fields_are_ignored_and_bad_bodies_refused(coordinator, client):
    reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2, user="team-a",
                                           extra_body={"no_such_field": 1, "store": True})
    assert reply.usage.completion_tokens == 2
    url = f"http://127.0.0.1:{coordinator[2]}"
    for body, status, message in [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"messages": CHAT, "pad": "x" * 70_000}).encode(), 413, "max_request_bytes=65536"),
    ]:
        got_status, got = post(url + "/v1/chat/completions", body)
        assert got_status == status and message in got["error"]["message"], got
    assert post(url + "/v1/nothing", b"{}")[0] == 404
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        assert reply.status == 200 and json.load(reply) == {"status": "ok"}


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_busy_service_is_429(loop, tiny_dir, experts):
    server, _, http_port = start(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()},
                                 limits={"max_concurrent_sessions": 2})
    try:
        with client_for(http_port) as client:
            held = client.chat.completions.create(model="fusion", messages=CHAT, stream=True, **LONG)
            next(iter(held))
            with pytest.raises(openai.BadRequestError, match="max_concurrent_sessions=2") as caught:
                client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2, n=3)
            assert caught.value.body["param"] == "n"
            for stream in (False, True):  # one slot left: n=2 takes it and finds none for its second choice
                with pytest.raises(openai.RateLimitError, match="max_concurrent_sessions=2") as caught:
                    list(client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2, n=2,
                                                        stream=stream))
                assert caught.value.body["code"] == "server_busy"
            held.close()
            assert wait_until(lambda: server.servicer.service.active == 0)
            assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2, n=2).usage
    finally:
        loop.run(server.stop(0))
    assert no_sessions_left(server, experts)


def test_lost_expert_is_503(loop, tiny_dir, tiny_config, experts):
    lone, lone_port = loop.run(create_expert_server(LocalExpert.load(tiny_config.expert("a")), tiny_config.limits))
    addresses = {"a": [addr(lone_port)], "b": [addr(experts["b"][1])], "c": [addr(experts["c"][1])]}
    server, _, http_port = start(loop, tiny_dir, addresses)
    try:
        with client_for(http_port) as client:
            assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2).usage
            loop.run(lone.stop(0))
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as caught:
                    list(client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=3, stream=stream))
                assert caught.value.status_code == 503 and "'a'" in caught.value.message
                assert caught.value.body["type"] == "service_unavailable_error"
            # Requests that do not consult the lost expert go on.
            reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=3,
                                                   extra_body={"fusion": {"weights": {"b": 1.0, "c": 1.0}}})
            assert reply.usage.completion_tokens == 3
    finally:
        loop.run(lone.stop(0))
        loop.run(server.stop(0))


def test_disconnect_frees_sessions_on_every_expert(coordinator, client, experts):
    server = coordinator[0]
    for create in (client.chat.completions.create, client.completions.create):
        prompt = {"messages": CHAT} if create == client.chat.completions.create else {"prompt": "hello"}
        stream = create(model="fusion", stream=True, n=2, **prompt, **LONG)
        chunks = iter(stream)
        for _ in range(4):
            next(chunks)
        assert all(expert_sessions(port) >= 2 for _, port in experts.values())
        stream.close()  # drops the connection mid-stream
        assert no_sessions_left(server, experts)
    # A non-streaming request whose client gives up is cancelled as well.
    with client_for(coordinator[2]) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="fusion", messages=CHAT, timeout=0.5, **LONG)
    assert no_sessions_left(server, experts)


def test_metrics_count_http_requests(coordinator, client):
    client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{coordinator[0].metrics_port}/metrics", timeout=HANG_S).read().decode()
    for series in ('fusion_http_requests_total{path="/v1/chat/completions",status="200"}',
                   'fusion_http_requests_total{path="/v1/chat/completions",status="404"}',
                   "fusion_time_to_first_token_seconds_count", "fusion_generated_tokens_total"):
        match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
        assert match and float(match.group(1)) >= 1, series


# -- API keys: the same keys and limits as gRPC --------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(loop, tiny_dir, experts, tmp_path_factory):
    path = tmp_path_factory.mktemp("http-keys") / "keys.yaml"
    keys = {"open": create_key(path, "open"), "one": create_key(path, "one", limits={"max_concurrent_streams": 1}),
            "small": create_key(path, "small", limits={"tokens_per_minute": 60})}
    server, port, http_port = start(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()},
                                    limits=LIMITS, security={"api_keys_file": str(path)})
    yield server, port, http_port, keys
    loop.run(server.stop(0))


def test_missing_or_wrong_key_is_401(keyed):
    _, _, http_port, keys = keyed
    for key in ("", "fsk_open_wrong", keys["open"] + "x"):
        with client_for(http_port, key or "none") as client, pytest.raises(openai.AuthenticationError) as caught:
            client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2)
        assert caught.value.status_code == 401 and caught.value.body["type"] == "authentication_error"
    with client_for(http_port, "none") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with client_for(http_port, keys["open"]) as client:
        assert [m.id for m in client.models.list().data][0] == "fusion"
        assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2).usage
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as reply:
        assert reply.status == 200  # probes need no key


def test_key_limits_are_shared_with_grpc_and_are_429(keyed):
    server, port, http_port, keys = keyed
    with FusionClient(addr(port), timeout=HANG_S, api_key=keys["one"]) as grpc_client, \
            client_for(http_port, keys["one"]) as client:
        held = grpc_client.generate(CHAT, {"max_tokens": 400, "ignore_eos": True})
        next(held)  # the key's one stream, held over gRPC
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2)
        assert caught.value.body["code"] == "max_concurrent_streams"
        held.close()
        assert wait_until(lambda: server.servicer.service.active == 0)
        assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2).usage
        # A stream the client drops frees the key's slot as well as the sessions.
        stream = client.chat.completions.create(model="fusion", messages=CHAT, stream=True, **LONG)
        next(iter(stream))
        stream.close()
        assert wait_until(lambda: server.servicer.service.active == 0)
        assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2).usage
    with client_for(http_port, keys["small"]) as client:
        # The prompt (43 tokens) and max_tokens are reserved up front: 400 never fits 60 a minute (400),
        # 10 fits once, and then the window is used up until its tokens leave it (429 with Retry-After).
        with pytest.raises(openai.BadRequestError, match="tokens_per_minute"):
            client.chat.completions.create(model="fusion", messages=CHAT, stream=True, **LONG)
        assert client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=10,
                                              extra_body={"ignore_eos": True}).usage.completion_tokens == 10
        with pytest.raises(openai.RateLimitError, match="tokens_per_minute") as caught:
            client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=2)
        assert 1 <= int(caught.value.response.headers["retry-after"]) <= 61
    assert wait_until(lambda: server.servicer.service.active == 0)


def test_tls_with_the_grpc_servers_certificate(loop, tiny_dir, tmp_path):
    """With a `tls` section the HTTP API serves HTTPS with the coordinator's certificate."""
    import ssl

    from tests.test_security import make_ca, make_leaf

    ca = make_ca(tmp_path / "ca", "fusion test CA")
    cert, key = make_leaf(tmp_path / "server", ca, "localhost", server=True)
    config = parse_config(tiny_config_dict(tiny_dir, security={"tls": {"cert_file": cert, "key_file": key,
                                                                       "ca_file": ca[2]}}))
    server, _ = loop.run(create_coordinator_server(config, http_address="127.0.0.1:0"))  # in-process experts
    http_port = server.http_port
    try:
        context = ssl.create_default_context(cafile=ca[2])
        body = json.dumps({"messages": CHAT, "max_tokens": 3}).encode()
        request = urllib.request.Request(f"https://localhost:{http_port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=HANG_S, context=context) as reply:
            assert json.load(reply)["usage"]["completion_tokens"] == 3
        with pytest.raises(OSError):  # plaintext is not served (URLError, or the connection closed)
            urllib.request.urlopen(f"http://localhost:{http_port}/health", timeout=10)
    finally:
        loop.run(server.stop(0))


# -- where it runs ---------------------------------------------------------------------------------------
def test_fusion_serve_http_port(tiny_dir, tmp_path, tiny_service):
    """`fusion serve --http-port`: one process, both APIs, the same answer (a process of its own: other
    threads, so greedy answers are compared up to near ties)."""
    import yaml

    from tests.reference import assert_greedy_equivalent
    from tests.test_grpc_cli import Served

    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_dir)))
    served = Served("serve", "--config", str(config), "--port", "0", "--host", "127.0.0.1", "--http-port", "0")
    try:
        http_port = int(re.search(r"HTTP API on \S+:(\d+)", "".join(served.log)).group(1))
        with FusionClient(f"127.0.0.1:{served.port}", timeout=HANG_S) as grpc_client:
            over_grpc = [e.token.token_id for e in grpc_client.generate(CHAT, {"max_tokens": 8})]
        with client_for(http_port) as client:
            reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=8,
                                                   extra_body={"fusion": {"attribution": True}})
        assert token_ids(reply.choices[0]) == over_grpc
        expected = tiny_service.complete(CHAT, {"max_tokens": 8}).token_ids
        assert_greedy_equivalent(tiny_service, CHAT, over_grpc, expected)
        assert served.terminate() == 0
    finally:
        served.kill()


def test_ray_serve_deployment_serves_http(tiny_dir, tiny_service):
    pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'logit-fusion[ray]'")
    import ray
    from ray import serve

    from fusion.deploy.app import build_app, coordinator_http_address
    from tests.reference import assert_greedy_equivalent
    from tests.test_deploy import REPLICA_START_S, descendants, wait_until_gone

    args = {"config": tiny_config_dict(tiny_dir), "port": 0, "http_port": 0, "grace_s": 2.0,
            "expert": {"num_cpus": 0}, "coordinator": {"num_cpus": 0}}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(args), name="http", route_prefix=None)
        address = coordinator_http_address("http")
        with openai.OpenAI(api_key="none", base_url=f"http://{address}/v1", max_retries=0,
                           timeout=REPLICA_START_S) as client:  # a hang bound
            reply = client.chat.completions.create(model="fusion", messages=CHAT, max_tokens=8,
                                                   extra_body={"fusion": {"attribution": True}})
        health = serve.get_deployment_handle("coordinator", "http").check_health.remote()
        assert health.result(timeout_s=REPLICA_START_S) is None  # probes /health too
    finally:
        started = descendants(os.getpid())
        serve.shutdown()
        ray.shutdown()
    wait_until_gone(started)
    expected = tiny_service.complete(CHAT, {"max_tokens": 8}).token_ids
    assert_greedy_equivalent(tiny_service, CHAT, token_ids(reply.choices[0]), expected)  # replicas: 1 thread each
