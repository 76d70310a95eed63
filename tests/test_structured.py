"""`fusion/fuse/structured.py`: structured output as one grammar mask on the fused distribution. Greedy decoding
under a grammar picks, at every step, the most likely token of the fused distribution among the tokens
that keep the output inside the grammar (checked against a brute-force reference over the vocabulary);
every grammar kind gives output that parses; bad grammars are refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from fusion.config import SamplingParams, StructuredOutput, parse_config
from fusion.errors import InvalidArgumentError, ResourceExhaustedError
from fusion.frontdoor.service import FusionService
from tests.conftest import tiny_config_dict

PROMPT = "what is 12 + 35 ?"


def allowed_ids(tokenizer, text: str, choices: list[str], eos: set[int], width: int) -> set[int]:
    """Brute force: the ids whose text keeps `text` a prefix of some choice (EOS once it is one)."""
    allowed = {i for i in range(len(tokenizer)) if (piece := tokenizer.decode([i])) and i not in eos
               and any(c.startswith(text + piece) for c in choices)}
    if text in choices:
        allowed |= eos
    return {i for i in allowed if i < width}


def test_greedy_choice_is_the_masked_argmax_of_the_fused_distribution(tiny_service):
    choices = ["12", "47", "the answer", "fox jumps"]
    completion = tiny_service.complete(PROMPT, {"max_tokens": 16, "structured": {"choice": choices}})
    assert completion.text in choices and completion.finish_reason == "stop"
    engine = tiny_service.engine
    tokenizer = tiny_service.tokenizers[0]
    prompts = tiny_service.prompt_ids(PROMPT)
    rule, weights = tiny_service.resolve_spec(None)
    ids = completion.token_ids
    logits = engine.continuation_logits(prompts, ids)  # (E, n, V): predicting each generated id
    dist = engine.fused_distribution(logits, ids, rule, weights, prompts[0])  # (n, V)
    text = ""
    for k, token in enumerate(ids):
        allowed = allowed_ids(tokenizer, text, choices, set(engine.eos_token_ids), engine.vocab_size)
        assert token in allowed
        best = max(allowed, key=lambda i: float(dist[k, i]))
        assert token == best or torch.isclose(dist[k, token], dist[k, best], atol=1e-5)
        text += tokenizer.decode([token])
    assert text == completion.text


def test_every_kind_of_grammar_gives_output_that_parses(tiny_service):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["colour", "ok"], "additionalProperties": False}
    out = tiny_service.complete(PROMPT, {"max_tokens": 48, "structured": {"json_schema": schema}})
    jsonschema.validate(json.loads(out.text), schema)
    out = tiny_service.complete(PROMPT, {"max_tokens": 12, "structured": {"regex": "[0-9]{3}-(yes|no)"}})
    assert re.fullmatch(r"[0-9]{3}-(yes|no)", out.text), out.text
    out = tiny_service.complete(PROMPT, {"max_tokens": 12, "structured": {"grammar": 'start: "a" ("b" | "c") "d"'}})
    assert out.text in ("abd", "acd")
    sampled = tiny_service.complete(PROMPT, {"max_tokens": 12, "temperature": 1.0, "seed": 3,
                                             "structured": {"regex": "(left|right|up|down)"}})
    assert sampled.text in ("left", "right", "up", "down")


def test_json_object_output_is_an_object_when_it_completes(tiny_service):
    out = tiny_service.complete(PROMPT, {"max_tokens": 64, "structured": {"json_object": True}})
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("spec, match", [
    ({"regex": "[unclosed"}, "structured: .*unclosed"),
    ({"grammar": "start: undefined_rule"}, "structured: "),
    ({"json_schema": {"type": "no-such-type"}}, "structured: "),
])
def test_a_bad_grammar_is_refused_naming_the_field(tiny_service, spec, match):
    with pytest.raises(InvalidArgumentError, match=match):
        tiny_service.complete(PROMPT, {"max_tokens": 4, "structured": spec})


def test_a_grammar_past_its_bound_is_refused_before_compiling(tiny_dir):
    config = parse_config(tiny_config_dict(tiny_dir, limits={"max_grammar_bytes": 64}))
    service = FusionService.from_config(config)
    try:
        with pytest.raises(ResourceExhaustedError, match="max_grammar_bytes=64"):
            service.complete(PROMPT, {"structured": {"choice": ["x" * 80]}})
    finally:
        service.close()


def test_the_spec_takes_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    assert SamplingParams(structured={"json_object": True}).structured.json_object


def test_experts_of_different_tokenizers_refuse_a_grammar(tiny_dir):
    service = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, names=("a", "other"))))
    try:
        with pytest.raises(InvalidArgumentError, match="structured: .*tokenizers differ"):
            service.complete(PROMPT, {"structured": {"regex": "a+"}})
    finally:
        service.close()
