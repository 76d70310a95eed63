"""Token healing: a prompt that ends in the caller's text is backed up over its last token, and the first
generated token must begin with that token's text.

A tokenizer writes text as the longest pieces it knows, so where a prompt stops matters: SmolLM2's writes a
newline and the next line's indentation as one token, and a word with its leading space, so a prompt ending
in a newline (a function's docstring) or a space ("The answer is ") leaves the model to go on from a token
boundary it rarely saw in training, after which it often writes the wrong thing (closes a code block at
once, or repeats the space). Backing up over the last token and asking for any token that starts with its
text lets the model choose the boundary it would have chosen (guidance's and transformers' `token_healing`).
The text the caller sent is not sent back: the stream shows what follows it.

Healing backs up one token, only where the caller's text ends the prompt (a plain prompt, or a chat whose
last message is continued), and never over a special token or a piece of a character.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Healing:
    """The prompt's backed-up last token: its text, and the ids whose bytes begin with it."""

    token_id: int
    text: str
    allowed: tuple[int, ...]

    def first_token_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """(V,) bool: the ids the first generated token may be."""
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[torch.tensor(self.allowed, dtype=torch.long, device=device)] = True
        return mask


def ids_starting_with(table: Sequence[bytes], prefix: bytes) -> tuple[int, ...]:
    """The ids whose bytes (`table`: id -> bytes, b"" for special tokens) begin with `prefix`."""
    return tuple(i for i, spelled in enumerate(table) if spelled.startswith(prefix))


def heal(prompt_ids: list[list[int]], table: Sequence[bytes],
         starting_with: Callable[[bytes], tuple[int, ...]] | None = None) -> tuple[list[list[int]], Healing | None]:
    """Each expert's prompt backed up over its last token, and that token's healing; the prompts unchanged
    and None where there is nothing to heal: a prompt of one token, a last token that is special, whose
    bytes are not whole characters, or that differs between the experts (one vocabulary, different text).
    `starting_with(prefix)`: the ids that begin with `prefix` (default `ids_starting_with` over `table`; the
    service caches it)."""
    last = {ids[-1] for ids in prompt_ids if ids}
    if len(last) != 1 or any(len(ids) < 2 for ids in prompt_ids):
        return prompt_ids, None
    token_id = last.pop()
    spelled = table[token_id] if 0 <= token_id < len(table) else b""
    try:
        text = spelled.decode("utf-8")
    except UnicodeDecodeError:
        return prompt_ids, None
    if not text:
        return prompt_ids, None
    allowed = starting_with(spelled) if starting_with is not None else ids_starting_with(table, spelled)
    return [ids[:-1] for ids in prompt_ids], Healing(token_id, text, allowed)
