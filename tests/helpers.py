"""Helpers every test module shares."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(condition: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; its last value as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())
