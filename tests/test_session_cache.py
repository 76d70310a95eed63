"""Per-session KV bookkeeping: LRU order, eviction under the budget, prefix reuse."""

from __future__ import annotations

from fusion.experts.session_cache import SessionCache, common_prefix_length


def test_session_cache_lru():
    cache = SessionCache(max_tokens=10)
    for name, n in (("a", 4), ("b", 4), ("c", 4)):
        cache.get(name).token_ids = list(range(n))
    cache.get("a")  # a becomes most recent
    assert cache.evict(keep=["c"]) == ["b"]
    assert cache.sessions() == ["c", "a"]  # least recently used first
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    entry = cache.get("a")
    assert cache.reusable_length(entry, [0, 1, 2, 3]) == 3  # the last id is always recomputed
    assert cache.release("a") and not cache.release("a")
