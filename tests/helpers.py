"""Helpers every test module shares."""

from __future__ import annotations

import time
from typing import Callable


# How long a wait may take before it counts as a hang. A bound, never the assertion: on a loaded
# 2-core host a condition that takes 50 ms idle can take seconds, and a test passes as soon as its
# condition holds, so a generous bound costs nothing when all is well.
HANG_S = 180.0


def wait_until(predicate: Callable[[], object], timeout_s: float = HANG_S, interval_s: float = 0.02,
               message: str | None = None) -> bool:
    """Poll `predicate` every `interval_s` seconds until it returns a true value; True once it does.
    Past `timeout_s` seconds (a hang bound: the predicate is asked once more at the end), False, or,
    given `message` (what was awaited), an AssertionError that says it. Tests wait on the condition
    itself rather than sleep for a guessed time: as fast as the condition allows, and no flake on a
    slow or loaded box."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    if predicate():
        return True
    if message is not None:
        raise AssertionError(f"{message} (waited {timeout_s:g} s)")
    return False
