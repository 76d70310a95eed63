"""The text edge: incremental detokenisation, held-back partial characters and stop strings."""

from __future__ import annotations

import pytest

from fusion.frontdoor.text import StopMatcher, TextStream


class CharTokenizer:
    """Ids are code points; enough to test the stream's text logic on its own."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_stream_stop_strings_and_holdback():
    stream = TextStream(CharTokenizer(), stop=["END"])
    out = "".join(stream.push(ord(c)) for c in "hello E")
    assert out == "hello "  # "E" is held back: it may start "END"
    out += stream.push(ord("N"))
    assert not stream.stopped
    out += stream.push(ord("D"))
    assert stream.stopped and out == "hello "
    stream = TextStream(CharTokenizer(), stop=["END"])
    out = "".join(stream.push(ord(c)) for c in "hello EN") + stream.flush()
    assert out == "hello EN" and not stream.stopped


def _naive_partial_stop(text: str, stop: str) -> int:
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def test_partial_stop_matches_the_naive_scan():
    """The held-back tail equals the plain longest-suffix-that-prefixes-the-stop computation."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 12)))
        stop = "".join(rng.choice("ab\n") for _ in range(rng.randint(1, 6)))
        assert StopMatcher.partial(text, stop) == _naive_partial_stop(text, stop), (text, stop)


TEXTS = ["Hello, world! 47 + 38 = 85.", "Grüße aus Köln — naïve café, 東京 and 😀🚀 emoji.",
         "def f(x):\n    return {'a': [1, 2]}  # ünïcödé\n\n\tdone", "  leading spaces and trailing  "]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_is_the_whole_decode_on_a_real_tokenizer(smollm2_dir, text):
    """Token by token, the deltas join to what decoding the whole output gives (SmolLM2's byte-level BPE:
    leading spaces, characters split over several byte tokens, emoji), never showing a partial one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) + stream.flush() == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decode_does_constant_work_per_token():
    """Each push decodes a few ids, not the whole output (the old stream was quadratic)."""
    class Counting(CharTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return super().decode(ids)

    stream = TextStream(Counting())
    for c in "x" * 2000:
        stream.push(ord(c))
    assert Counting.decoded < 10 * 2000


def test_a_continued_final_message_stays_open_in_the_chat_template(smollm2_dir):
    """continue_final_message on SmolLM2's template: the user's turn as a plain chat prompt, then the
    assistant's opening with no end of turn after it, as transformers' own continue_final_message renders it."""
    from transformers import AutoTokenizer

    from fusion.config import ExpertConfig
    from fusion.frontdoor.text import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    expert = ExpertConfig(name="s", model=str(smollm2_dir))
    question = [{"role": "user", "content": "Complete the function."}]
    opened = question + [{"role": "assistant", "content": "```python\ndef add(a, b):\n"}]
    asked = encode_prompt(tok, expert, question)
    continued = encode_prompt(tok, expert, opened, continue_final_message=True)
    assert continued[:len(asked)] == asked  # the same turns, then the opening in place of the answer
    assert tok.decode(continued[len(asked):]) == "```python\ndef add(a, b):\n"  # as written, to the newline
    assert tok.convert_tokens_to_ids("<|im_end|>") not in continued[len(asked):]
    expected = tok.apply_chat_template(opened, continue_final_message=True, tokenize=False)
    assert continued == tok(expected, add_special_tokens=False)["input_ids"]
