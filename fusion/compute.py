"""One thread for the process's CPU tensor work.

PyTorch's CPU kernels run on an OpenMP team owned by the calling thread. Once a second thread has
its own team, the process manages more OpenMP threads than cores and libgomp stops letting idle
workers spin: every parallel region then wakes its workers through the kernel, and a decode forward
of many short parallel regions slows by a quarter or more (measured on 2 cores with SmolLM2-135M).
So the engine's steps and scoring (its in-process experts' forwards, fusion,
sampling) run here and experts are loaded here; tensor work on any other thread (admission's bias rows
and routers, a fingerprint, an expert server's worker in a test) runs on that thread alone
(`single_team`). An expert server in its own process (`fusion serve-expert`, a Ray replica) makes this
thread its worker.

Work here must never wait for other work queued here: remote experts are stepped from a pool, and
an expert server in the same process (tests) has its own worker.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

import torch

from fusion.own_thread import OwnThread

T = TypeVar("T")

_compute = OwnThread("fusion-compute")


def compute_executor() -> ThreadPoolExecutor:
    """The executor of the compute thread (for `loop.run_in_executor`)."""
    return _compute.executor


def on_compute_thread() -> bool:
    return _compute.is_current()


def run_on_compute_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the compute thread (directly when already on it); exceptions propagate."""
    return _compute.run(fn, *args, **kwargs)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the enclosed CPU tensor work on the calling thread alone: work off the compute thread, so
    that it starts no second OpenMP team (`single_team`). Switching costs ~0.2 us. (The engine's own
    fusion and sampling use the compute thread's team: with one team in the process its idle workers
    spin, and measured step by step in alternation, two threads were as fast at one row and 1.5x as
    fast at 8-16 rows.)"""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def single_team(device: torch.device | str = "cpu") -> Iterator[None]:
    """Keep the process at one OpenMP team: CPU tensor work enclosed here runs with the compute thread's
    team when called on it, and on the calling thread alone (`one_thread`) anywhere else (see the
    module docstring). No-op for other devices, whose host threads only launch kernels."""
    if torch.device(device).type != "cpu" or on_compute_thread():
        yield
        return
    with one_thread():
        yield
