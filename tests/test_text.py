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
