"""How a tokenizer spells text: the bytes of every token id, and an index for byte-prefix queries.

Cross-tokenizer fusion (`fusion.crosstok.step`) works on text as bytes. For each expert it needs, once per
tokenizer: each id's bytes (b"" for special tokens, which spell no text), the ids whose bytes start
with a given byte string (a contiguous range of the ids sorted by their bytes, so one cumulative sum
over a probability row answers "how much mass starts with x" in O(log V)), and the ids whose bytes
are a given string (so the proper prefixes of x that are tokens are found with len(x) lookups).

Token bytes are read from the tokenizer's declared decoder: byte-level BPE (GPT-2's byte-to-unicode
table: SmolLM2, Llama 3, Qwen) or SentencePiece-style pieces (Gemma: "▁" is a space, "<0xHH>" a byte).
Any other decoder is refused, and the result is checked: the tokens of a probe text must spell it
byte for byte.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from fusion.errors import ConfigError

_MAX_REMEMBERED_RANGES = 1 << 16
_MAX_REMEMBERED_BOUNDS = 1 << 10  # 257 ids each
_PROBE = "Hello world!  x = 12345.\n\tdef f(a, b):\n        return a+b  # é ü 中文 😀 \n\n"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte ↔ printable-character table, inverted: character → byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_table()


def _decoder_steps(tokenizer) -> list[dict]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        raise ConfigError(f"tokenizer {type(tokenizer).__name__}: no decoder to read token bytes from")
    spec = json.loads(decoder.__getstate__())
    return spec["decoders"] if spec.get("type") == "Sequence" else [spec]


def token_bytes_of(tokenizer) -> list[bytes]:
    """Every id's bytes (b"" for special tokens), from the tokenizer's decoder. ConfigError if the
    decoder is not one this module can read."""
    steps = _decoder_steps(tokenizer)
    kinds = [s.get("type") for s in steps]
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, token in added.items() if getattr(token, "special", False)}
    out: list[bytes] = []
    if "ByteLevel" in kinds:
        if len(kinds) != 1:
            raise ConfigError(f"tokenizer decoder {kinds}: a ByteLevel decoder is expected on its own")
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                out.append(b"")
            elif i in added:
                out.append(added[i].content.encode("utf-8"))
            else:
                try:
                    out.append(bytes(_BYTE_LEVEL[c] for c in piece))
                except KeyError:  # a piece outside the byte alphabet: spelled as its own text
                    out.append(piece.encode("utf-8"))
        return out
    replaces: list[tuple[str, str]] = []
    for step in steps:
        kind = step.get("type")
        if kind == "Replace" and "String" in step.get("pattern", {}):
            replaces.append((step["pattern"]["String"], step["content"]))
        elif kind not in ("ByteFallback", "Fuse"):
            raise ConfigError(f"tokenizer decoder step {kind!r} is not supported for cross-tokenizer fusion "
                              "(byte-level BPE and SentencePiece-style pieces are)")
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(b"")
            continue
        if i in added:
            out.append(added[i].content.encode("utf-8"))
            continue
        match = _BYTE_PIECE.match(piece)
        if match and "ByteFallback" in kinds:
            out.append(bytes([int(match.group(1), 16)]))
            continue
        for old, new in replaces:
            piece = piece.replace(old, new)
        out.append(piece.encode("utf-8"))
    return out


def _next_prefix(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with `prefix` (None: none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


@dataclass
class Spelling:
    """One tokenizer's token bytes and byte-prefix index. Build with `from_tokenizer` (or directly from
    a list of token bytes and an encode function); shared by every request, read-only after building."""

    token_bytes: list[bytes]  # id -> bytes (b"": spells no text)
    encode: Callable[[str], list[int]]  # text -> ids, no special tokens
    eos_ids: tuple[int, ...] = ()
    fingerprint: str = ""
    sorted_ids: torch.Tensor = field(init=False)  # (N,) long: ids with text, sorted by their bytes
    _keys: list[bytes] = field(init=False, repr=False)
    _by_bytes: dict[bytes, list[int]] = field(init=False, repr=False)
    _ranges: dict[bytes, tuple[int, int]] = field(init=False, repr=False)  # `range_of`'s answers so far
    _bounds: dict[bytes, torch.Tensor] = field(init=False, repr=False)  # `byte_bounds`'s answers so far

    def __post_init__(self) -> None:
        spelled = [i for i, b in enumerate(self.token_bytes) if b]
        spelled.sort(key=self.token_bytes.__getitem__)
        self.sorted_ids = torch.tensor(spelled, dtype=torch.long)
        self._keys = [self.token_bytes[i] for i in spelled]
        self._by_bytes = {}
        for i in spelled:
            self._by_bytes.setdefault(self.token_bytes[i], []).append(i)
        self.max_token_bytes = max((len(k) for k in self._keys), default=0)
        self._ranges = {}
        self._bounds = {}

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_ids: Sequence[int] = (), fingerprint: str = "") -> Spelling:
        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        spelling = cls(token_bytes_of(tokenizer), encode, tuple(eos_ids), fingerprint)
        spelling.check(_PROBE)
        return spelling

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def check(self, text: str) -> None:
        """ConfigError unless the tokens of `text` spell it byte for byte."""
        ids = self.encode(text)
        if self.spell(ids) != text.encode("utf-8"):
            raise ConfigError("the tokenizer's tokens do not spell text byte for byte (a normalizer changes it?); "
                              "cross-tokenizer fusion needs tokens that do")

    def spell(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    def ids_of(self, text: bytes) -> list[int]:
        """The ids whose bytes are exactly `text`."""
        return self._by_bytes.get(text, [])

    def range_of(self, prefix: bytes) -> tuple[int, int]:
        """[lo, hi) in `sorted_ids` of the ids whose bytes start with `prefix`. Remembered: a step asks
        for every single byte and, step after step, for the same pending text plus each candidate."""
        found = self._ranges.get(prefix)
        if found is None:
            if len(self._ranges) >= _MAX_REMEMBERED_RANGES:
                self._ranges.clear()
            lo = bisect.bisect_left(self._keys, prefix)
            upper = _next_prefix(prefix)
            hi = len(self._keys) if upper is None else bisect.bisect_left(self._keys, upper, lo)
            found = self._ranges[prefix] = (lo, hi)
        return found

    def byte_bounds(self, prefix: bytes) -> torch.Tensor:
        """(257,) long: the ids whose bytes start with `prefix` + byte b are sorted ids [bounds[b],
        bounds[b + 1]) (the ids spelling `prefix` itself come before bounds[0]). Remembered, like
        `range_of`: a step asks for every single byte after the same few prefixes."""
        found = self._bounds.get(prefix)
        if found is None:
            if len(self._bounds) >= _MAX_REMEMBERED_BOUNDS:
                self._bounds.clear()
            lo, hi = self.range_of(prefix)
            starts = [bisect.bisect_left(self._keys, prefix + bytes([b]), lo, hi) for b in range(256)]
            found = self._bounds[prefix] = torch.tensor(starts + [hi], dtype=torch.long)
        return found

    def prefix_tokens(self, text: bytes, *, proper: bool = True) -> list[tuple[int, int]]:
        """(length, id) of the tokens whose bytes are a nonempty prefix of `text` (proper: shorter)."""
        end = len(text) if proper else len(text) + 1
        out = []
        for n in range(1, min(end, self.max_token_bytes + 1)):
            for i in self._by_bytes.get(text[:n], ()):
                out.append((n, i))
        return out

    def tokenize(self, text: bytes) -> tuple[list[int], bytes]:
        """(ids, rest): the tokens of the longest prefix of `text` that is valid UTF-8, and the bytes
        after it (an unfinished character). The ids spell that prefix exactly (else ValueError)."""
        cut = len(text)
        while cut > 0:
            try:
                decoded = text[:cut].decode("utf-8")
                break
            except UnicodeDecodeError:
                cut -= 1
        else:
            decoded = ""
        ids = self.encode(decoded) if decoded else []
        if self.spell(ids) != text[:cut]:
            raise ValueError(f"the tokenizer does not spell {decoded[-40:]!r} byte for byte")
        return ids, text[cut:]


_SPELLINGS: dict[str, Spelling] = {}
_SPELLINGS_LOCK = threading.Lock()


def spelling_for(tokenizer, fingerprint: str, eos_ids: Sequence[int] = ()) -> Spelling:
    """The tokenizer's `Spelling`, built once per process per tokenizer fingerprint (Gemma's 262,144 ids
    take ~2 s) and shared by every expert and service with that tokenizer."""
    key = f"{fingerprint}:{sorted(eos_ids)}"
    with _SPELLINGS_LOCK:
        spelling = _SPELLINGS.get(key)
        if spelling is None:
            spelling = _SPELLINGS[key] = Spelling.from_tokenizer(tokenizer, eos_ids, fingerprint)
        return spelling
