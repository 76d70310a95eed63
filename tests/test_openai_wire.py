"""`services/openai_wire.py` and the modules it plans with (`openai_requests`, `openai_tools`), and
`services/openai_responses.py`, on their own: request bodies become plans (one service request per
choice) with the fields mapped as the service names them, and the answers' pieces take OpenAI's shapes.
Pure functions: no server here (tests/test_http.py runs them through a real one)."""

from __future__ import annotations

import json

import pytest

from fusion.service import PromptLogprobs
from services.openai_errors import ApiError
from services.openai_responses import vllm_prompt_logprobs
from services.openai_tools import tool_call_of
from services.openai_wire import plan_request

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


def test_tools_become_a_schema_of_one_call_and_a_system_message():
    p = plan(tools=TOOLS, tool_choice="required")
    schema = p.requests[0].sampling["structured"]["json_schema"]
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["f", "g"]
    assert schema["anyOf"][0]["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    assert p.tool_call and p.requests[0].prompt[0]["role"] == "system" and '"name":"f"' in p.requests[0].prompt[0]["content"]
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})
    assert named.requests[0].sampling["structured"]["json_schema"]["properties"]["name"] == {"const": "g"}
    none = plan(tools=TOOLS, tool_choice="none")
    assert "structured" not in none.requests[0].sampling and not none.tool_call
    with pytest.raises(ApiError, match="tool_choice: 'auto'"):
        plan(tools=TOOLS)
    with pytest.raises(ApiError, match="tool_choice: needs tools"):
        plan(tool_choice="required")
    with pytest.raises(ApiError, match="tools: function names must be distinct"):
        plan(tools=[TOOLS[0], TOOLS[0]], tool_choice="required")


def test_tool_history_becomes_text_the_templates_know():
    history = CHAT + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": '{"a": 1}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    messages = plan(messages=history).requests[0].prompt
    assert messages[1] == {"role": "assistant", "content": json.dumps({"name": "f", "arguments": {"a": 1}})}
    assert messages[2] == {"role": "user", "content": "Result of tool call c1: 2"}
    with pytest.raises(ApiError, match=r"messages\[1\].tool_calls: function arguments must be JSON"):
        plan(messages=CHAT + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{nope"}}]}])


def test_a_tool_call_is_read_back_only_when_whole():
    call = tool_call_of('{"name": "f", "arguments": {"a": 1}}', "call_1")
    assert call == {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert tool_call_of('{"name": "f", "argu', "call_1") is None
    assert tool_call_of("[1, 2]", "call_1") is None


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
