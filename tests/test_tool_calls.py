"""Tool calls (fusion/fuse/tool_calls.py) on their own and through a real HTTP server with stock clients:
the prompt as each template shows tools, the lazy grammar of tool_choice "auto" (text until the trigger,
then a call to one of the tools), the answer read back whole and as stream deltas, an openai client's
round trip and LangChain's `bind_tools`. The experts are tiny random models whose tokenizer holds the
tags as tokens of their own and whose template takes tools, as Qwen's do; a logit bias on the trigger
token stands in for a model that decides to call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fusion.config import ExpertConfig, StructuredOutput, ToolCalls, parse_config
from fusion.frontdoor.text import encode_prompt
from fusion.fuse.structured import GrammarCompiler
from fusion.fuse.tool_calls import (HERMES, LLAMA3_JSON, CallStream, parse_calls, syntax_of, template_tools,
                                    tool_prompt)
from tests.helpers import HANG_S
from tests.tiny_models import make_model, make_tokenizer

openai = pytest.importorskip("openai")

WEATHER = {"name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
CLOCK = {"name": "time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                        "required": ["zone"], "additionalProperties": False}}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the weather in Oslo ?"}]


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
    """Two tiny experts over a tokenizer with the tags as tokens and a template that takes tools, and the
    plain tokenizer (tags spelled out, a template without tools)."""
    root = tmp_path_factory.mktemp("tools")
    tok = make_tokenizer(root / "tok", tools="hermes")
    make_model(root / "a", tok, seed=11, positions=2048)  # tools in a 300-token vocabulary: long prompts
    make_model(root / "b", tok, seed=12, positions=2048)
    make_tokenizer(root / "plain")
    llama = make_tokenizer(root / "llama-tok", tools="llama3")
    make_model(root / "llama", llama, seed=13, positions=2048)
    return root


def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def matcher(tok, **calls):
    spec = StructuredOutput(tool_calls=ToolCalls(functions=[WEATHER, CLOCK], **calls))
    eos = (tok.convert_tokens_to_ids("<|im_end|>"),)
    return GrammarCompiler(tok, len(tok), eos).matcher(spec)


def accepts(tok, text: str, **calls) -> tuple[bool, bool]:
    """Whether the grammar takes every token of `text`, and whether it is then complete."""
    m = matcher(tok, **calls)
    try:
        for token in tok(text, add_special_tokens=False)["input_ids"]:
            if m.advance(token):
                return True, True
    except Exception:  # the grammar refused a token (InvalidArgumentError naming it)
        return False, False
    return True, m.accepting


CALL = '<tool_call>\n{"name":"weather","arguments":{"city":"Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("tags", ["tok", "plain"])
def test_auto_lets_text_run_until_the_trigger_then_holds_the_call_to_the_tools(tool_dir, tags):
    tok = tokenizer(tool_dir / tags)
    assert GrammarCompiler(tok, len(tok), ()).token_tags == (tags == "tok")
    assert accepts(tok, "It is sunny, no call needed.") == (True, True)
    assert accepts(tok, "Let me look. " + CALL)[0]
    assert not accepts(tok, 'Let me look. <tool_call>\n{"name":"rain"')[0]  # not a tool
    assert not accepts(tok, '<tool_call>\n{"name":"weather","arguments":{"city":"Rome"}}')[0]  # not its schema
    # one call: the grammar ends at its closing tag (the row stops); parallel: text and calls go on
    assert accepts(tok, CALL, parallel=False) == (True, True)
    assert accepts(tok, CALL + " and " + CALL.replace("weather", "time").replace('"city":"Oslo"', '"zone":"UTC"'))[0]


@pytest.mark.parametrize("tags", ["tok", "plain"])
def test_required_and_named_calls_start_at_the_first_token(tool_dir, tags):
    tok = tokenizer(tool_dir / tags)
    assert not accepts(tok, "Sure. " + CALL, choice="required")[0]
    assert accepts(tok, CALL, choice="required")[0]
    assert accepts(tok, CALL, choice="weather") == (True, True)
    assert not accepts(tok, CALL.replace("weather", "time"), choice="weather")[0]


LLAMA_CALL = '{"name":"weather","parameters":{"city":"Oslo"}}'


def test_a_llama3_template_gets_its_own_syntax_a_call_only_as_the_answer(tool_dir):
    tok = tokenizer(tool_dir / "llama-tok")
    assert syntax_of(tok) is LLAMA3_JSON and syntax_of(tokenizer(tool_dir / "tok")) is HERMES
    assert syntax_of(tokenizer(tool_dir / "plain")) is HERMES  # no tools in its template: the project's prompt
    assert accepts(tok, "It is sunny.") == (True, True)
    assert accepts(tok, LLAMA_CALL) == (True, True)  # the call is the whole answer
    assert not accepts(tok, '{"name":"rain"')[0]
    assert not accepts(tok, '{"name":"weather","arguments":{}}')[0]  # Hermes' key, not Llama's
    assert not accepts(tok, "Sure.", choice="required")[0]
    assert parse_calls(LLAMA_CALL, LLAMA3_JSON).calls == [("weather", '{"city":"Oslo"}')]
    assert parse_calls("Use " + LLAMA_CALL, LLAMA3_JSON).calls == []  # text first: no call
    stream, pieces = CallStream(LLAMA3_JSON), []
    for char in LLAMA_CALL:
        pieces += stream.feed(char)
    assert [(p.kind, p.text) for p in pieces if p.kind == "call"] == [("call", "weather")]
    assert "".join(p.text for p in pieces if p.kind == "arguments") == '{"city":"Oslo"}'


def test_past_calls_reach_a_llama3_template_in_its_syntax(tool_dir):
    tok = tokenizer(tool_dir / "llama-tok")
    history = CHAT + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "snow"}]
    expected = [*CHAT, {"role": "assistant", "content": LLAMA_CALL}, {"role": "tool", "content": "snow"}]
    reference = tok.apply_chat_template(expected, tools=template_tools([WEATHER]), add_generation_prompt=True,
                                        tokenize=False)
    ids = encode_prompt(tok, ExpertConfig(name="a", model="unused"), history, [WEATHER], LLAMA3_JSON)
    assert ids == tok(reference, add_special_tokens=False)["input_ids"]
    assert '"parameters"' in tok.decode(ids) and "<tool_call>" not in tok.decode(ids)


def test_every_expert_is_asked_for_calls_in_the_syntax_the_answer_is_held_to(tool_dir):
    """Experts of one vocabulary whose templates differ: the grammar's syntax (the first tokenizer's)
    is the one each is shown, by its template where it asks for that syntax, else by the project's prompt."""
    expert = ExpertConfig(name="a", model="unused")
    for name in ("tok", "plain"):  # Hermes' template, and one without tools, in a Llama-syntax service
        text = tokenizer(tool_dir / name).decode(encode_prompt(tokenizer(tool_dir / name), expert, CHAT, [WEATHER],
                                                               LLAMA3_JSON))
        assert tool_prompt([WEATHER], LLAMA3_JSON) in text and "<tools>" not in text
    assert '"parameters":{...}' in tool_prompt([WEATHER], LLAMA3_JSON) and "<tool_call>" not in tool_prompt(
        [WEATHER], LLAMA3_JSON)


def test_tool_calls_spec_refuses_unknown_choices_and_repeated_names():
    with pytest.raises(ValueError, match="choice: 'rain'"):
        ToolCalls(functions=[WEATHER], choice="rain")
    with pytest.raises(ValueError, match="names must be distinct"):
        ToolCalls(functions=[WEATHER, WEATHER])


def test_the_prompt_shows_tools_as_the_expert_template_does_or_by_the_project_prompt(tool_dir):
    history = CHAT + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "snow"}]
    expert = ExpertConfig(name="a", model="unused")
    tok = tokenizer(tool_dir / "tok")
    reference = tok.apply_chat_template(history, tools=template_tools([WEATHER]), add_generation_prompt=True,
                                        tokenize=False)
    assert encode_prompt(tok, expert, history, [WEATHER]) == tok(reference, add_special_tokens=False)["input_ids"]
    plain = tokenizer(tool_dir / "plain")
    text = plain.decode(encode_prompt(plain, expert, history, [WEATHER]))
    assert text.startswith("<|im_start|>system\nbe brief\n\n" + tool_prompt([WEATHER]))
    assert "<|im_start|>user\n<tool_response>\nsnow\n</tool_response>" in text
    assert "<|im_start|>tool" not in text


def test_a_stream_read_in_pieces_gives_the_answer_read_whole():
    answer = ('Checking <tool_ca' + 'll> is not a tag. ' + CALL + '\n'
              + '<tool_call>\n{"name":"time","arguments":{"zone":"U\\"}{TC"}}\n</tool_call>')
    whole = parse_calls(answer)
    assert whole.calls == [("weather", '{"city":"Oslo"}'), ("time", '{"zone":"U\\"}{TC"}')]
    assert whole.content == "Checking <tool_call> is not a tag."
    stream, pieces = CallStream(), []
    for char in answer:
        pieces += stream.feed(char)
    pieces += stream.finish()
    text = "".join(p.text for p in pieces if p.kind == "text")
    assert text.strip() == whole.content
    names = [(p.index, p.text) for p in pieces if p.kind == "call"]
    assert names == [(0, "weather"), (1, "time")]
    arguments = ["".join(p.text for p in pieces if p.kind == "arguments" and p.index == i) for i in (0, 1)]
    assert arguments == [args for _, args in whole.calls]
    two_calls = CALL + "\n" + CALL  # the newline between parallel calls is part of them, however it arrives
    stream, pieces = CallStream(), []
    for char in two_calls:
        pieces += stream.feed(char)
    pieces += stream.finish()
    assert [p.kind for p in pieces if p.kind != "arguments"] == ["call", "call"]
    cut = parse_calls("Sure. " + CALL[:30])  # max_tokens ended it inside a call: no call, the text as written
    assert cut.calls == [] and cut.content == "Sure. " + CALL[:30] and not cut.complete


# -- through a real HTTP server, stock clients -----------------------------------------------------------
@pytest.fixture(scope="module")
def server(loop, tool_dir):
    from fusion.services.coordinator import create_coordinator_server

    config = parse_config({"experts": [{"name": n, "model": str(tool_dir / n), "dtype": "float32", "weight": w}
                                       for n, w in (("a", 0.6), ("b", 0.4))]})
    server, _ = loop.run(create_coordinator_server(config, metrics_port=0, metrics_host="127.0.0.1",
                                                   http_address="127.0.0.1:0"))
    yield server
    loop.run(server.stop(0))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}/v1", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def trigger(tool_dir):
    return tokenizer(tool_dir / "tok").convert_tokens_to_ids("<tool_call>")


TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]


def ask(client, trigger, bias, messages=CHAT, **extra):
    """A chat request under tool_choice auto, the trigger's logit pushed by `bias` (a model that decides)."""
    return client.chat.completions.create(model="fusion", messages=messages, tools=TOOLS, parallel_tool_calls=False,
                                          logit_bias={str(trigger): bias}, **{"max_tokens": 96, **extra})


def valid_call(name: str, arguments: str) -> dict:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, schema)
    return parsed


def test_auto_answers_a_call_or_text_as_the_fused_distribution_decides(client, trigger):
    called = ask(client, trigger, 100).choices[0]
    assert called.finish_reason == "tool_calls"
    [call] = called.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    valid_call(call.function.name, call.function.arguments)
    text = ask(client, trigger, -100).choices[0]
    assert text.message.tool_calls is None and text.finish_reason in ("stop", "length")
    assert "<tool_call>" not in text.message.content


def test_a_streamed_call_comes_as_openai_deltas_name_first_then_arguments(client, trigger):
    whole = ask(client, trigger, 100).choices[0].message.tool_calls[0]
    chunks = list(ask(client, trigger, 100, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    parts = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert parts[0].id.startswith("call_") and parts[0].function.name == whole.function.name
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in parts[1:])
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert arguments == whole.function.arguments  # the same greedy answer, streamed
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(d.content for d in deltas)  # the call alone: nothing of its tags shows as text


def test_an_openai_client_round_trip_call_result_answer(client, trigger):
    first = ask(client, trigger, 100).choices[0].message
    call = first.tool_calls[0]
    result = {"weather": "snow", "time": "12:00"}[call.function.name]
    history = CHAT + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = ask(client, trigger, -100, messages=history)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    shown = ask(client, trigger, -100, max_tokens=1).usage.prompt_tokens
    assert final.usage.prompt_tokens > shown  # the call and its result reached the experts


def test_a_named_tool_after_a_call_and_its_result_and_none_for_text(client, trigger):
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "time", "arguments": json.dumps({"zone": "UTC"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = ask(client, trigger, 0, messages=history, tool_choice={"type": "function", "function": {"name": "weather"}})
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "weather" and reply.choices[0].finish_reason == "tool_calls"
    valid_call(call.function.name, call.function.arguments)
    plain = ask(client, trigger, 0, messages=history, tool_choice="none", max_tokens=4)
    assert plain.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def llama_client(loop, tool_dir):
    from fusion.services.coordinator import create_coordinator_server

    config = parse_config({"experts": [{"name": "llama", "model": str(tool_dir / "llama"), "dtype": "float32"}]})
    server, _ = loop.run(create_coordinator_server(config, metrics_port=0, metrics_host="127.0.0.1",
                                                   http_address="127.0.0.1:0"))
    with openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{server.http_port}/v1", max_retries=0,
                       timeout=HANG_S) as c:
        yield c
    loop.run(server.stop(0))


def test_a_llama3_expert_calls_in_its_json_whole_and_streamed(llama_client, tool_dir):
    brace = tokenizer(tool_dir / "llama-tok").convert_tokens_to_ids("{")
    called = ask(llama_client, brace, 100).choices[0]  # the answer opens with "{": a call
    assert called.finish_reason == "tool_calls" and called.message.content is None
    [call] = called.message.tool_calls
    valid_call(call.function.name, call.function.arguments)
    chunks = list(ask(llama_client, brace, 100, stream=True))
    parts = [d.tool_calls[0] for c in chunks for d in [c.choices[0].delta] if d.tool_calls]
    assert parts[0].function.name == call.function.name
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = ask(llama_client, brace, -100).choices[0]
    assert text.message.tool_calls is None and text.finish_reason in ("stop", "length")


def test_langchain_bind_tools_and_invoke(server, trigger):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    model = langchain_openai.ChatOpenAI(model="fusion", api_key="unused", max_retries=0, timeout=120,
                                        base_url=f"http://127.0.0.1:{server.http_port}/v1", max_tokens=96)
    deciding = model.bind_tools(TOOLS, parallel_tool_calls=False)
    reply = deciding.invoke([HumanMessage("what is the weather in Oslo ?")], logit_bias={str(trigger): 100})
    [call] = reply.tool_calls
    assert valid_call(call["name"], json.dumps(call["args"])) == call["args"]
    answer = deciding.invoke([HumanMessage("what is the weather in Oslo ?"), reply,
                              ToolMessage("snow", tool_call_id=call["id"])], logit_bias={str(trigger): -100})
    assert not answer.tool_calls and isinstance(answer.content, str) and answer.content
