"""The text edge: incremental detokenisation, held-back partial characters and stop strings."""

from __future__ import annotations

from fusion.text import TextStream


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
        assert TextStream._partial_stop(text, stop) == _naive_partial_stop(text, stop), (text, stop)
