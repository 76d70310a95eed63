"""One thread for the process's CPU tensor work.

PyTorch's CPU kernels run on an OpenMP team owned by the calling thread. Once a second thread has
its own team, the process manages more OpenMP threads than cores and libgomp stops letting idle
workers spin: every parallel region then wakes its workers through the kernel. Measured on 2 cores,
a SmolLM2-135M decode forward takes 41 ms on a fresh thread but 52 ms on a thread started after the
main thread had run one. So the engine's steps and scoring (its in-process experts' forwards, fusion,
sampling) all run here. (An expert server steps on its own single worker thread: in its own process
that is the only one.)

Work here must never wait for other work queued here: remote experts are stepped from a pool, and
an expert server in the same process (tests) has its own worker.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def _start() -> None:
    global _thread_ident
    _thread_ident = threading.get_ident()


def compute_executor() -> ThreadPoolExecutor:
    """The executor of the compute thread (for `loop.run_in_executor`)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusion-compute", initializer=_start)
    return _executor


def on_compute_thread() -> bool:
    return threading.get_ident() == _thread_ident


def run_on_compute_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the compute thread (directly when already on it); exceptions propagate."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return compute_executor().submit(fn, *args, **kwargs).result()
