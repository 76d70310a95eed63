"""Token healing (fusion.frontdoor.healing): the prompt backed up over its last token, the first token
held to begin with that token's text, the output shown after it; against the fused distribution of the
backed-up prompt computed teacher forced."""

from __future__ import annotations

import pytest
import torch

from fusion.errors import InvalidArgumentError
from fusion.frontdoor.healing import heal, ids_starting_with
from fusion.frontdoor.service import FusionRequest
from fusion.frontdoor.text import TextSample, TextStream

TABLE = [b"", b"a", b" ", b" a", b"\n", b"\n  ", b"\xe2\x82", b"\xac", b"ab"]  # id 0: a special token


def test_heal_backs_up_over_the_last_token_and_allows_the_ids_that_begin_with_it():
    prompts, healing = heal([[0, 1, 2], [0, 8, 1, 2]], TABLE)
    assert prompts == [[0, 1], [0, 8, 1]]
    assert healing.token_id == 2 and healing.text == " " and healing.allowed == (2, 3)
    assert heal([[0, 1, 4]], TABLE)[1].allowed == (4, 5)
    mask = healing.first_token_mask(12, torch.device("cpu"))  # a vocabulary padded past the table
    assert mask.nonzero()[:, 0].tolist() == [2, 3]
    assert ids_starting_with(TABLE, b"a") == (1, 8)


@pytest.mark.parametrize("prompts", [
    [[0, 1, 0]],  # a special token last
    [[0, 1, 6]],  # a piece of a character
    [[2]],  # nothing would be left
    [[0, 1, 2], [0, 1, 4]],  # the experts' prompts end in different tokens
])
def test_heal_leaves_a_prompt_it_cannot_back_up(prompts):
    assert heal(prompts, TABLE) == (prompts, None)


def test_a_healed_stream_shows_what_follows_the_prompt_and_stops_in_the_healed_text(tiny_service):
    tok = tiny_service.tokenizers[0]
    prompt = tok("the answer is", add_special_tokens=False)["input_ids"]
    ids = tok(" 47 .", add_special_tokens=False)["input_ids"]
    stream = TextStream.after(tok, [], prompt, healed=" ")
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "47 ."
    stopped = TextStream.after(tok, [" 4"], prompt, healed=" ")
    assert stopped.push(ids[0]) == "" and stopped.stopped  # the stop begins in the healed space


def test_a_healed_request_is_greedy_over_the_backed_up_prompt(tiny_service):
    """The first token is the fused argmax among the ids that begin with the backed-up token's text, the
    rest the plain argmax, teacher forced on the prompt without its last token; the text is what follows
    the caller's prompt, and the prompt counts one token fewer."""
    service, engine = tiny_service, tiny_service.engine
    tok = service.tokenizers[0]
    prompt = "what is 12 + 35 ? the answer is "
    whole = service.prompt_ids(prompt, plain=True)
    assert tok.decode(whole[0][-1:]) == " "  # the prompt ends in a token of its own, the space
    events = list(service.submit(FusionRequest(prompt, {"max_tokens": 6, "ignore_eos": True, "token_healing": True},
                                               plain=True)))
    got = [e.token.token_id for e in events]
    assert service.token_bytes(got[0]).startswith(b" ")
    assert events[-1].usage.prompt_tokens == len(whole[0]) - 1

    backed = [ids[:-1] for ids in whole]
    rule, weights = service.resolve_spec(None)
    logits = engine.continuation_logits(backed, got)  # (E, n, V)
    log_probs = engine.fused_distribution(logits, got, rule, weights, backed[0])  # (n, V)
    allowed = torch.tensor([service.token_bytes(i).startswith(b" ") for i in range(log_probs.shape[-1])])
    first = log_probs[0].masked_fill(~allowed, float("-inf"))
    assert got[0] == int(first.argmax())
    assert not allowed[int(log_probs[0].argmax())]  # unhealed, the backed-up prompt would go on otherwise
    assert got[1:] == log_probs[1:].argmax(-1).tolist()
    text = "".join(e.text for e in events)
    assert prompt + text == tok.decode(backed[0] + got, skip_special_tokens=True)

    plain = list(service.submit(FusionRequest(prompt, {"max_tokens": 1}, plain=True)))
    assert plain[-1].usage.prompt_tokens == len(whole[0])  # without healing the prompt is sent whole


def test_healing_applies_where_the_callers_text_ends_the_prompt(tiny_service):
    """A chat turn's answer begins after the template's own text: nothing of the caller's to heal. A
    continued final message is healed, as a plain prompt is."""
    asked = {"max_tokens": 1, "token_healing": True}
    turn = list(tiny_service.submit(FusionRequest("the answer is ", asked)))
    assert turn[-1].usage.prompt_tokens == len(tiny_service.prompt_ids("the answer is ")[0])
    opened = [{"role": "user", "content": "what is 12 + 35 ?"}, {"role": "assistant", "content": "the answer is "}]
    continued = list(tiny_service.submit(FusionRequest(opened, asked, continue_final_message=True)))
    whole = tiny_service.prompt_ids(opened, continue_final_message=True)[0]
    assert continued[-1].usage.prompt_tokens == len(whole) - 1
    assert tiny_service.token_bytes(continued[0].token.token_id).startswith(b" ")


def test_healing_with_a_grammar_is_refused_naming_the_field(tiny_service):
    with pytest.raises(InvalidArgumentError, match="token_healing"):
        tiny_service.submit(FusionRequest("the answer is ", {"token_healing": True, "structured": {"regex": "[0-9]+"}},
                                          plain=True))


def test_a_continued_sample_is_scored_after_the_healed_prompt(tiny_service):
    """A continued sample (router training's function chats) is the text after the prompt a healed request
    sends: the last token backed up, and written again at the start of the scored ids."""
    tok = tiny_service.tokenizers[0]
    opened = [{"role": "user", "content": "what is 12 + 35 ?"}, {"role": "assistant", "content": "the answer is "}]
    prompts, ids = tiny_service.sample_ids(TextSample("47 .", opened, end_turn=True, continued=True))
    whole = tiny_service.prompt_ids(opened, continue_final_message=True)
    assert prompts == [p[:-1] for p in whole]
    assert tok.decode(ids[:-1]) == " 47 ." and tok.decode(ids[:1]).startswith(" ")
