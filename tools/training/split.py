"""The held-out split every training stream shares: a key's hash decides, independent of any seed, so a
held-out problem or file stays held out across runs, recipes and machines."""

from __future__ import annotations

import hashlib


def hashed_out(key: str, percent: int) -> bool:
    """Whether `key` falls in the held-out `percent` of keys."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent
