"""`services/openai_wire.py` and the modules it plans with (`openai_requests`, `openai_tools`), and
`services/openai_responses.py`, on their own: request bodies become plans (one service request per
choice) with the fields mapped as the service names them, and the answers' pieces take OpenAI's shapes.
Pure functions: no server here (tests/test_http.py runs them through a real one)."""

from __future__ import annotations

import json

import pytest

from fusion.frontdoor.service import PromptLogprobs
from fusion.services.openai_errors import ApiError
from fusion.services.openai_responses import vllm_prompt_logprobs
from fusion.fuse.tool_calls import call_text
from fusion.services.openai_tools import message_of
from fusion.services.openai_wire import plan_request

CHAT = [{"role": "user", "content": "hi"}]


def plan(kind="chat", **body):
    if kind == "chat":
        body.setdefault("messages", CHAT)
    return plan_request(kind, body, served="fusion", profiles={}, max_choices=8)


def test_response_format_and_structured_outputs_become_the_structured_field():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    p = plan(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert p.requests[0].sampling["structured"] == {"json_schema": schema}
    assert p.renames["structured"] == "response_format" and not p.tool_call
    assert plan(response_format={"type": "json_object"}).requests[0].sampling["structured"] == {"json_object": True}
    assert "structured" not in plan(response_format={"type": "text"}).requests[0].sampling
    p = plan("completions", prompt="a", structured_outputs={"json": json.dumps(schema)})
    assert p.requests[0].sampling["structured"] == {"json_schema": schema}
    assert plan(structured_outputs={"choice": ["a", "b"]}).requests[0].sampling["structured"] == {"choice": ["a", "b"]}
    with pytest.raises(ApiError, match="structured_outputs: give exactly one"):
        plan(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ApiError, match="response_format.json_schema: required"):
        plan(response_format={"type": "json_schema"})


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]


def test_tools_and_tool_choice_become_the_tool_calls_field():
    p = plan(tools=TOOLS)
    calls = p.requests[0].sampling["structured"]["tool_calls"]
    assert calls == {"functions": [t["function"] for t in TOOLS], "choice": "auto", "parallel": True}
    assert p.tool_call and p.requests[0].prompt == CHAT  # the tools reach each expert's template, not the text
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}, parallel_tool_calls=False)
    assert named.requests[0].sampling["structured"]["tool_calls"] | {"functions": None} == {
        "functions": None, "choice": "g", "parallel": False}
    assert plan(tools=TOOLS, tool_choice="required").requests[0].sampling["structured"]["tool_calls"]["choice"] == "required"
    none = plan(tools=TOOLS, tool_choice="none")
    assert "structured" not in none.requests[0].sampling and not none.tool_call
    with pytest.raises(ApiError, match="tool_choice: needs tools"):
        plan(tool_choice="required")
    with pytest.raises(ApiError, match="tools: function names must be distinct"):
        plan(tools=[TOOLS[0], TOOLS[0]])
    with pytest.raises(ApiError, match="tool_choice.function.name: 'h' is not one of the tools"):
        plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}})


def test_tool_history_becomes_the_calls_as_written_and_tool_turns():
    history = CHAT + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": '{"a": 1}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    messages = plan(messages=history).requests[0].prompt
    assert messages[1] == {"role": "assistant", "content": call_text("f", {"a": 1})}
    assert messages[2] == {"role": "tool", "content": "2"}
    with pytest.raises(ApiError, match=r"messages\[1\].tool_calls: function arguments must be a JSON object"):
        plan(messages=CHAT + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{nope"}}]}])
    with pytest.raises(ApiError, match=r"messages\[1\].tool_calls: function arguments must be a JSON object"):
        plan(messages=CHAT + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "true"}}]}])


def test_an_answer_holds_tool_calls_only_when_it_ended_with_them_whole():
    answer = "Let me see. " + call_text("f", {"a": 1})
    message, finish = message_of(answer, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me see."
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert message_of(answer, "length") == ({"role": "assistant", "content": answer}, "length")
    assert message_of(answer[:-3], "stop") == ({"role": "assistant", "content": answer[:-3]}, "stop")
    assert message_of("no call", "stop") == ({"role": "assistant", "content": "no call"}, "stop")


def test_echo_max_tokens_0_and_token_id_prompts():
    p = plan("completions", prompt=[5, 6, 7], max_tokens=0, echo=True, logprobs=1)
    assert p.prompts == [[5, 6, 7]] and p.echo and not p.generate and "max_tokens" not in p.requests[0].sampling
    assert p.requests[0].prompt == [5, 6, 7] and p.requests[0].plain
    p = plan("completions", prompt=[[1, 2], [3]], max_tokens=2, extra_field=1)
    assert p.prompts == [[1, 2], [3]] and p.generate
    with pytest.raises(ApiError, match="max_tokens: 0 only with echo"):
        plan("completions", prompt="a", max_tokens=0)


def test_vllm_prompt_logprobs_carry_the_token_and_its_rank():
    scored = PromptLogprobs(token_ids=[1, 5, 9], logprobs=[None, -0.5, -3.0],
                            alternatives=[None, ([5, 2], [-0.5, -1.5]), ([4, 7], [-0.1, -2.0])], ranks=[None, 1, 6])
    out = vllm_prompt_logprobs(scored, lambda i: f"t{i}")
    assert out[0] is None
    assert out[1] == {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "t5"},
                      "2": {"logprob": -1.5, "rank": 2, "decoded_token": "t2"}}
    assert out[2]["9"] == {"logprob": -3.0, "rank": 6, "decoded_token": "t9"} and set(out[2]) == {"9", "4", "7"}


def test_continue_final_message_is_vllms_pair_of_fields():
    opened = CHAT + [{"role": "assistant", "content": "def f():"}]
    assert plan(messages=opened, continue_final_message=True).requests[0].continue_final_message
    assert plan(messages=opened, continue_final_message=True,
                add_generation_prompt=False).requests[0].continue_final_message
    assert not plan().requests[0].continue_final_message
    assert not plan(add_generation_prompt=True).requests[0].continue_final_message
    with pytest.raises(ApiError, match="cannot be true with continue_final_message") as both:
        plan(messages=opened, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ApiError, match="false only with continue_final_message") as alone:
        plan(add_generation_prompt=False)
    assert both.value.param == alone.value.param == "add_generation_prompt" and both.value.status == 400
