"""The pieces of OpenAI's answers built from the service's tokens: logprobs in chat's and in completions'
shapes (an echoed prompt's too, and vLLM's `prompt_logprobs`), each token's attribution (the `fusion`
extension) and usage. Pure functions over token events and a token's bytes, so the HTTP API's
whole responses and stream chunks (`fusion.services.http_streams`) show a token the same way.
"""

from __future__ import annotations

import codecs
import math
from typing import Any, Callable

from fusion.engine.types import TokenEvent

MIN_LOGPROB = -9999.0  # what a -inf logprob is sent as (JSON has no infinity; vLLM sends the same)


def utf8_decoder() -> codecs.IncrementalDecoder:
    """What counts a completion's characters token by token (`text_offset`): a token that ends inside a
    character completes nothing until the next one does."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def token_string(raw: bytes) -> str:
    """A token as OpenAI shows it: its text, or `bytes:\\xNN...` when its bytes are not whole UTF-8
    characters (part of a character: each such token stays distinct, none is U+FFFD)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprob(token: TokenEvent, bytes_of: Callable[[int], bytes]) -> dict[str, Any]:
    """One entry of a chat choice's `logprobs.content`: `bytes` are the token's own bytes."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = bytes_of(token_id)
        return {"token": token_string(raw), "logprob": _finite(logprob), "bytes": list(raw)}

    return {**entry(token.token_id, token.logprob), "top_logprobs": [entry(t, lp) for t, lp in token.top_logprobs]}


def completion_logprobs(tokens: list[TokenEvent], bytes_of: Callable[[int], bytes], offset: int,
                        decoder: codecs.IncrementalDecoder) -> tuple[dict[str, Any], int]:
    """A completion choice's `logprobs` for `tokens`, whose text starts at character `offset`, and the
    offset after them. `decoder` (UTF-8, kept across a choice's calls) counts the characters each token
    completes, so `text_offset` indexes the text as it decodes."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(decoder.decode(bytes_of(t.token_id)))
    return {
        "tokens": [token_string(bytes_of(t.token_id)) for t in tokens],
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": [{token_string(bytes_of(i)): _finite(lp) for i, lp in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
    }, offset


def attribution(token: TokenEvent) -> dict[str, Any]:
    """One token of the `fusion.tokens` extension: its id and each expert's weight and probability."""
    return {"token_id": token.token_id,
            "attribution": [{"expert": a.expert, "weight": a.weight, "prob": a.prob} for a in token.attribution]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def echo_logprobs(scored, bytes_of: Callable[[int], bytes], top: int, decoder: codecs.IncrementalDecoder
                  ) -> tuple[dict[str, Any], int]:
    """An echoed prompt's part of a completion's `logprobs` (`scored`: fusion.frontdoor.service.PromptLogprobs; the
    first token has no logprob: null, as OpenAI sends it), and the character offset after it."""
    tokens, offsets, top_logprobs, offset = [], [], [], 0
    for token_id, alternatives in zip(scored.token_ids, scored.alternatives):
        tokens.append(token_string(bytes_of(token_id)))
        offsets.append(offset)
        offset += len(decoder.decode(bytes_of(token_id)))
        top_logprobs.append(None if alternatives is None else
                            {token_string(bytes_of(i)): _finite(lp) for i, lp in zip(*alternatives)})
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp) for lp in scored.logprobs],
            "top_logprobs": top_logprobs if top else [None] * len(tokens), "text_offset": offsets}, offset


def vllm_prompt_logprobs(scored, text_of: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {id: {logprob, rank, decoded_token}} for the token and
    its alternatives (rank 1 = likeliest), the first token null."""
    out: list[dict[str, Any] | None] = []
    for token_id, logprob, alternatives, rank in zip(scored.token_ids, scored.logprobs, scored.alternatives,
                                                     scored.ranks):
        if logprob is None:
            out.append(None)
            continue
        ids, values = alternatives if alternatives is not None else ([], [])
        entry = {str(token_id): {"logprob": _finite(logprob), "rank": rank, "decoded_token": text_of(token_id)}}
        for r, (i, lp) in enumerate(zip(ids, values)):
            entry.setdefault(str(i), {"logprob": _finite(lp), "rank": r + 1, "decoded_token": text_of(i)})
        out.append(entry)
    return out
