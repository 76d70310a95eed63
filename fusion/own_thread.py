"""A worker thread of its own, for work that must always run on the same thread.

Some state lives with one thread rather than with the process: the OpenMP team that runs a thread's CPU
tensor work (the compute thread, fusion.compute). `OwnThread.run` calls a function there, directly when
already on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class _Ident:
    """The worker's thread id, held apart from its `OwnThread`: the running thread keeps its initializer's
    arguments alive, and must not keep the `OwnThread` so (one let go of ends its thread, and with it what
    the thread holds)."""

    value: int | None = None


def _start(ident: _Ident, initializer: Callable[[], None] | None) -> None:
    ident.value = threading.get_ident()
    if initializer is not None:
        initializer()


class OwnThread:
    """One named worker thread, started on first use and ended when the object is let go of. Work here
    must never wait for other work queued here (it would wait forever)."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        """`initializer` runs first on the thread, once."""
        self.name = name
        self._initializer = initializer
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._ident = _Ident()

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Its executor (for `loop.run_in_executor`)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name, initializer=_start,
                                                    initargs=(self._ident, self._initializer))
        return self._executor

    def is_current(self) -> bool:
        return self._ident.value is not None and threading.get_ident() == self._ident.value

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on this thread; exceptions propagate."""
        if self.is_current():
            return fn(*args, **kwargs)
        return self.executor.submit(fn, *args, **kwargs).result()
