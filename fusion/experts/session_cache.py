"""Per-session KV caches with prefix reuse and least-recently-used eviction under a token budget.

A step carries the session's whole token history (the stateless protocol of the expert contract);
the cache keeps, per session, the ids whose keys/values it holds. `reusable_length` says how many leading ids
can be reused, so only the uncached suffix is computed. Losing an entry (eviction, restart) costs a
re-prefill, never a wrong answer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass
class CacheEntry:
    token_ids: list[int] = field(default_factory=list)  # ids whose K/V the cache holds
    kv: Any = None  # a transformers Cache object (or None before the first step)
    used_at: float = 0.0  # the cache's clock when the session was last used

    @property
    def length(self) -> int:
        return len(self.token_ids)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SessionCache:
    """LRU map from session id to its cached prefix; `max_tokens` bounds the sum of cached lengths."""

    def __init__(self, max_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._clock = clock
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self.hits = 0  # tokens served from cache
        self.misses = 0  # tokens computed
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    @property
    def cached_tokens(self) -> int:
        return sum(e.length for e in self._entries.values())

    def sessions(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first (without marking any as used)."""
        return list(self._entries.values())

    def get(self, session_id: str) -> CacheEntry:
        """The session's entry (created empty if absent), marked most recently used."""
        entry = self._entries.get(session_id)
        if entry is None:
            entry = self._entries[session_id] = CacheEntry()
        self._entries.move_to_end(session_id)
        entry.used_at = self._clock()
        return entry

    def peek(self, session_id: str) -> CacheEntry | None:
        """The session's entry if it has one, not marked used."""
        return self._entries.get(session_id)

    def idle(self, for_s: float) -> list[str]:
        """Sessions not used for at least `for_s` seconds, least recently used first."""
        now = self._clock()
        return [session_id for session_id, entry in self._entries.items() if now - entry.used_at >= for_s]

    def reusable_length(self, entry: CacheEntry, token_ids: Sequence[int]) -> int:
        """How many leading ids of `token_ids` the entry can serve; at least one id is always recomputed
        because the step needs the logits after the last id."""
        shared = common_prefix_length(entry.token_ids, token_ids)
        return min(shared, len(token_ids) - 1)

    def record(self, hits: int, misses: int) -> None:
        self.hits += hits
        self.misses += misses

    def release(self, session_id: str) -> bool:
        return self._entries.pop(session_id, None) is not None

    def evict(self, keep: Sequence[str] = ()) -> list[str]:
        """Drop least recently used sessions until within budget; sessions in `keep` stay."""
        evicted = []
        protected = set(keep)
        total = self.cached_tokens
        for session_id in list(self._entries):
            if total <= self.max_tokens:
                break
            if session_id in protected:
                continue
            total -= self._entries.pop(session_id).length
            evicted.append(session_id)
        self.evictions += len(evicted)
        return evicted
