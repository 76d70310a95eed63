"""How a tokenizer spells text (`fusion.crosstok.spelling`): each id's bytes read from the tokenizer's decoder
(byte-level BPE and SentencePiece-style pieces), the byte-prefix index, and tokenizing a text cut
inside a character, each against a plain reference: GPT-2's published byte table, the tokenizer's own
decode, hand-written expected bytes, or a brute-force scan over every id."""

from __future__ import annotations

import uuid

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

import fusion.crosstok.spelling as spelling_module
from fusion.errors import ConfigError
from fusion.crosstok.spelling import Spelling, spelling_for, token_bytes_of

TEXTS = ["the quick brown fox", "12 plus 35 , héllo  wörld\n", "tabs\tand 中文 and 😀!", ""]


@pytest.fixture(scope="module")
def byte_level(tiny_dir):
    """The tiny experts' byte-level BPE tokenizer."""
    return AutoTokenizer.from_pretrained(tiny_dir / "tok")


def backend_with(tiny_dir, *, decoder=None, normalizer=None, drop_decoder=False) -> PreTrainedTokenizerFast:
    """The tiny byte-level tokenizer with its decoder or normalizer replaced."""
    tok = Tokenizer.from_file(str(tiny_dir / "tok" / "tokenizer.json"))
    if drop_decoder:
        tok.decoder = None
    if decoder is not None:
        tok.decoder = decoder
    if normalizer is not None:
        tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


SP_PIECES = ["▁", "▁the", "▁hello", "hello", "▁wor", "ld", "é", "中"]


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """A Gemma-style tokenizer: spaces normalised to "▁", a unigram model with all 256 "<0xHH>" byte pieces
    for byte fallback, and the decoder Replace("▁", " ") → ByteFallback → Fuse."""
    vocab = [("<unk>", 0.0), ("<eos>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [(piece, -1.0 - 0.1 * i) for i, piece in enumerate(SP_PIECES)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


# -- token bytes from the decoder ------------------------------------------------------------------
def test_byte_level_token_bytes_follow_gpt2s_byte_table(byte_level):
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = byte_level.convert_ids_to_tokens(list(range(len(byte_level))))
    special = {i for i, t in byte_level.added_tokens_decoder.items() if t.special}
    got = token_bytes_of(byte_level)
    assert len(got) == len(byte_level)
    for i, piece in enumerate(pieces):
        expected = b"" if i in special else bytes(to_byte[c] for c in piece)
        assert got[i] == expected, (i, piece)
        if i not in special and "\ufffd" not in byte_level.decode([i]):  # a whole text: the tokenizer's own decode
            assert got[i] == byte_level.decode([i]).encode("utf-8")


def test_byte_level_tokens_spell_their_text(byte_level):
    spelling = Spelling.from_tokenizer(byte_level, byte_level.all_special_ids)
    for text in TEXTS:
        ids = spelling.encode(text)
        assert ids == byte_level(text, add_special_tokens=False)["input_ids"]
        assert spelling.spell(ids) == text.encode("utf-8") == byte_level.decode(ids).encode("utf-8")


def test_sentencepiece_style_pieces_are_spaces_and_bytes():
    tok = sentencepiece_style()
    got = token_bytes_of(tok)
    by_piece = dict(zip(tok.convert_ids_to_tokens(list(range(len(tok)))), got))
    assert by_piece["<unk>"] == by_piece["<eos>"] == b""  # special tokens spell no text
    assert by_piece["<0x0A>"] == b"\n" and by_piece["<0xFF>"] == b"\xff" and by_piece["<0x41>"] == b"A"
    assert [by_piece[p] for p in SP_PIECES] == [b" ", b" the", b" hello", b"hello", b" wor", b"ld",
                                                "é".encode(), "中".encode()]
    spelling = Spelling.from_tokenizer(tok)  # the probe text (tabs, CJK, emoji) spells byte for byte
    for text in TEXTS:
        ids = spelling.encode(text)
        assert spelling.spell(ids) == text.encode("utf-8")
        assert tok.decode(ids) == text


@pytest.mark.parametrize("change,match", [
    (dict(decoder=decoders.WordPiece()), "decoder step 'WordPiece' is not supported"),
    (dict(decoder=decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])),
     "a ByteLevel decoder is expected on its own"),
    (dict(drop_decoder=True), "no decoder to read token bytes from"),
])
def test_a_decoder_it_cannot_read_is_refused(tiny_dir, change, match):
    with pytest.raises(ConfigError, match=match):
        token_bytes_of(backend_with(tiny_dir, **change))


def test_a_tokenizer_that_changes_the_text_is_refused(tiny_dir):
    """A lower-casing normalizer: the tokens of "Hello" spell "hello", not the text."""
    tok = backend_with(tiny_dir, normalizer=normalizers.Lowercase())
    ids = tok("Hello", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "hello"  # the reference: what the tokens really spell
    with pytest.raises(ConfigError, match="do not spell text byte for byte"):
        Spelling.from_tokenizer(tok)


# -- the byte-prefix index --------------------------------------------------------------------------
# ids 0..255: each single byte; then longer tokens, a duplicate (b"ab" twice), runs of 0xff (the
# largest byte, where "the next prefix" has no successor), and two special ids that spell nothing.
HAND = [bytes([b]) for b in range(256)] + [b"ab", b"abc", b"ab", b"", b"\xff\xff", b"\xffa", b" a", b"ba",
                                           b"abcd", b"", "é".encode(), "😀".encode()]


def hand_spelling(encode=None) -> Spelling:
    return Spelling(list(HAND), encode or (lambda text: list(text.encode("utf-8"))), eos_ids=(259,))


def starting_with(prefix: bytes) -> set[int]:
    return {i for i, b in enumerate(HAND) if b and b.startswith(prefix)}


PREFIXES = [b"", b"a", b"ab", b"abc", b"abcde", b"b", b"\xff", b"\xff\xff", b"\xff\xff\xff", b" ", b"\xf0",
            "é".encode()[:1], b"zz", b"a\xff"]


def test_sorted_ids_are_the_spelled_ids_in_byte_order():
    spelling = hand_spelling()
    assert spelling.vocab_size == len(HAND)
    assert spelling.max_token_bytes == max(len(b) for b in HAND)
    expected = sorted((i for i, b in enumerate(HAND) if b), key=lambda i: (HAND[i], i))
    assert spelling.sorted_ids.tolist() == expected  # equal bytes keep id order


@pytest.mark.parametrize("prefix", PREFIXES)
def test_range_of_holds_exactly_the_ids_that_start_with_the_prefix(prefix):
    spelling = hand_spelling()
    lo, hi = spelling.range_of(prefix)
    assert set(spelling.sorted_ids[lo:hi].tolist()) == starting_with(prefix)
    assert hi - lo == len(starting_with(prefix))
    assert spelling.range_of(prefix) == (lo, hi)  # remembered: the same answer


@pytest.mark.parametrize("prefix", [b"", b"a", b"ab", b"\xff", b"zz"])
def test_byte_bounds_split_the_range_by_the_next_byte(prefix):
    spelling = hand_spelling()
    lo, hi = spelling.range_of(prefix)
    bounds = spelling.byte_bounds(prefix).tolist()
    assert len(bounds) == 257 and bounds[256] == hi
    for b in range(256):
        assert set(spelling.sorted_ids[bounds[b]:bounds[b + 1]].tolist()) == starting_with(prefix + bytes([b]))
    # before bounds[0]: the ids that spell the prefix itself
    assert spelling.sorted_ids[lo:bounds[0]].tolist() == [i for i, b in enumerate(HAND) if b and b == prefix]


def test_ids_of_is_every_id_with_exactly_those_bytes():
    spelling = hand_spelling()
    for text in [b"ab", b"a", b"abc", b"\xff\xff", b"zz", b""]:
        assert spelling.ids_of(text) == [i for i, b in enumerate(HAND) if b and b == text]
    assert spelling.ids_of(b"ab") == [256, 258]  # both ids of the duplicate, in id order


@pytest.mark.parametrize("text", [b"abcd", b"abc", b"a", b"\xff\xffa", b" ab", "😀".encode(), b"q"])
def test_prefix_tokens_are_the_tokens_that_begin_the_text(text):
    spelling = hand_spelling()
    proper = {(len(b), i) for i, b in enumerate(HAND) if b and len(b) < len(text) and text.startswith(b)}
    assert sorted(spelling.prefix_tokens(text)) == sorted(proper)
    whole = proper | {(len(text), i) for i, b in enumerate(HAND) if b == text}
    assert sorted(spelling.prefix_tokens(text, proper=False)) == sorted(whole)


def test_remembered_answers_stay_bounded_and_right(monkeypatch):
    """The answers kept for later are cleared when full; answers after a clear are still right."""
    monkeypatch.setattr(spelling_module, "_MAX_REMEMBERED_RANGES", 4)
    monkeypatch.setattr(spelling_module, "_MAX_REMEMBERED_BOUNDS", 2)
    spelling = hand_spelling()
    for prefix in PREFIXES * 2:
        lo, hi = spelling.range_of(prefix)
        assert set(spelling.sorted_ids[lo:hi].tolist()) == starting_with(prefix)
        assert len(spelling._ranges) <= 4
        bounds = spelling.byte_bounds(prefix)
        assert int(bounds[256]) == spelling.range_of(prefix)[1]
        assert len(spelling._bounds) <= 2


# -- tokenize and check ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,kept", [
    ("wö".encode(), "wö".encode()),
    ("wö".encode()[:-1], b"w"),  # cut inside "ö": its first byte waits for the rest
    ("a😀".encode()[:2], b"a"),
    ("a😀".encode()[:4], b"a"),
    ("a😀".encode(), "a😀".encode()),
    (b"", b""),
    (b"\x80abc", b""),  # no valid UTF-8 prefix at all
])
def test_tokenize_spells_the_longest_whole_utf8_prefix(text, kept):
    spelling = hand_spelling()
    ids, rest = spelling.tokenize(text)
    assert spelling.spell(ids) == kept and kept + rest == text
    assert ids == list(kept)  # the hand encoder's ids: one per byte


def test_an_encoder_that_loses_text_is_refused():
    """An encoder that drops the letter "x": tokenize raises ValueError, and check a ConfigError."""
    spelling = hand_spelling(lambda text: list(text.replace("x", "").encode("utf-8")))
    assert spelling.tokenize(b"abc") == ([97, 98, 99], b"")
    with pytest.raises(ValueError, match="does not spell 'axb' byte for byte"):
        spelling.tokenize(b"axb")
    spelling.check("abc")
    with pytest.raises(ConfigError, match="do not spell text byte for byte"):
        spelling.check("box")


# -- one spelling per tokenizer --------------------------------------------------------------------
def test_spelling_for_builds_once_per_fingerprint_and_eos_ids(byte_level):
    fingerprint = f"test-{uuid.uuid4()}"
    first = spelling_for(byte_level, fingerprint, [2, 0])
    assert spelling_for(byte_level, fingerprint, [0, 2]) is first  # the same ids in another order
    other = spelling_for(byte_level, fingerprint, [2])
    assert other is not first and other.eos_ids == (2,)
    assert first.fingerprint == fingerprint and first.eos_ids == (2, 0)
    assert first.token_bytes == token_bytes_of(byte_level)


# -- a real vocabulary against a brute-force scan --------------------------------------------------
def test_spelling_index_matches_brute_force(tiny_dir):
    """The second tiny vocabulary, every answer of the index against a scan over every id."""
    tok = AutoTokenizer.from_pretrained(tiny_dir / "tok2")
    spelling = Spelling.from_tokenizer(tok, tok.all_special_ids)
    text = "12 plus 35 , héllo  wörld\n"
    assert spelling.spell(spelling.encode(text)) == text.encode()
    for prefix in (b"", b" ", b" q", b"12", b"\xc3", b"zz\xff", b"co", b" d"):
        lo, hi = spelling.range_of(prefix)
        found = sorted(spelling.sorted_ids[lo:hi].tolist())
        assert found == sorted(i for i, b in enumerate(spelling.token_bytes) if b and b.startswith(prefix))
    for target in (b" quick", b"completely", b" different words"):
        assert sorted(spelling.prefix_tokens(target)) == sorted(
            (len(b), i) for i, b in enumerate(spelling.token_bytes)
            if b and len(b) < len(target) and target.startswith(b))
    for prefix in (b"", b" q", b"zz", "é".encode()[:1]):  # every byte after a prefix: range_of's ranges
        bounds = spelling.byte_bounds(prefix).tolist()
        assert [(bounds[b], bounds[b + 1]) for b in range(256)] == [spelling.range_of(prefix + bytes([b]))
                                                                    for b in range(256)]
    ids, rest = spelling.tokenize("wörld".encode()[:2])  # "w" and the first byte of "ö"
    assert spelling.spell(ids) == b"w" and rest == "ö".encode()[:1]
