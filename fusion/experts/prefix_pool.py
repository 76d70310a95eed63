"""Keys and values of ended sessions, kept for new sessions whose histories begin the same way.

Requests to a chat service open alike: the system prompt, a few-shot preamble, a conversation's earlier
turns sent again with the next one. A session's cache (`fusion.experts.session_cache`) serves only that session
and goes when the session is released; this pool keeps a copy of a released session's columns, under a
token budget of its own (least recently used out first), and a new session whose history shares at least
`MIN_SHARED` leading ids with a kept one starts from a copy of those columns, so that only the rest of its
prompt is computed (automatic prefix caching, as vLLM and SGLang do it). A kept prefix serves only its own
namespace: experts over one shared base keep a member's columns for that member alone (its adapter's keys
and values are its own).

Copies, not shared buffers: a session appends to its columns in place, and a released session's columns
may be a row of a batch buffer (`fusion.forward.kv_cache.Cohort`) that would otherwise stay alive with them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusion.experts.session_cache import common_prefix_length

# Leading ids a new session must share with a kept prefix to start from it: below this, copying the
# columns saves too little to be worth the pool's scan.
MIN_SHARED = 16


@dataclass
class KeptPrefix:
    namespace: str
    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, H, n, D), own copies


class PrefixPool:
    """Kept prefixes by namespace, bounded by `max_tokens` ids in all (module docstring)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._kept: OrderedDict[int, KeptPrefix] = OrderedDict()  # least recently used first
        self._next_key = 0
        self.adopted_tokens = 0  # ids new sessions took from the pool instead of computing them

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def kept_tokens(self) -> int:
        return sum(len(k.token_ids) for k in self._kept.values())

    def clear(self) -> None:
        """Drop every kept prefix (a benchmark timing prompts read in full)."""
        self._kept.clear()

    def keep(self, namespace: str, token_ids: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
             ) -> bool:
        """Keep a copy of a released session's columns: `layers` per layer (keys, values), (1, H, n, D) with n =
        len(token_ids). A history that a kept one already begins with is only marked used; one that extends
        a kept one replaces it. False when it is too short to serve or longer than the whole budget."""
        token_ids = list(token_ids)
        if not MIN_SHARED <= len(token_ids) <= self.max_tokens:
            return False
        for key, kept in list(self._kept.items()):
            if kept.namespace != namespace:
                continue
            shared = common_prefix_length(kept.token_ids, token_ids)
            if shared == len(token_ids):  # already held, whole
                self._kept.move_to_end(key)
                return True
            if shared == len(kept.token_ids):  # this one extends it
                del self._kept[key]
        copies = [(keys.detach().clone(), values.detach().clone()) for keys, values in layers]
        self._kept[self._next_key] = KeptPrefix(namespace, token_ids, copies)
        self._next_key += 1
        total = self.kept_tokens
        while total > self.max_tokens:
            _, dropped = self._kept.popitem(last=False)
            total -= len(dropped.token_ids)
        return True

    def adopt(self, namespace: str, token_ids: Sequence[int]
              ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The longest kept run of `token_ids`' leading ids in `namespace`, at most all but the last id (whose
        logits the step needs): (its length n, per layer (keys, values) views of its first n columns, for the
        caller to copy), or None when none shares `MIN_SHARED` ids."""
        best, best_key = 0, None
        limit = len(token_ids) - 1
        for key, kept in self._kept.items():
            if kept.namespace != namespace:
                continue
            shared = min(common_prefix_length(kept.token_ids, token_ids), limit)
            if shared > best:
                best, best_key = shared, key
        if best < MIN_SHARED:
            return None
        self._kept.move_to_end(best_key)
        self.adopted_tokens += best
        kept = self._kept[best_key]
        return best, [(keys[..., :best, :], values[..., :best, :]) for keys, values in kept.layers]
