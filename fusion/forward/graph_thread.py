"""The thread a compiled CUDA decode step records and replays its CUDA graphs on.

`torch.compile(mode="reduce-overhead")` keeps its CUDA-graph trees (the recorded graphs and their
memory pool) in a tree manager per thread and device, and binds each recorded graph to the manager
of the thread that recorded it. Replayed from several threads at once, one manager's state would be
shared unguarded (the engine steps GPU experts from a pool of threads, the scheduler and the score
pool from their own); and torch before 2.13 created the per-thread state only in the thread that
imported the module, so any other thread failed its first recording with a bare AssertionError in
`cudagraph_trees.get_obj`. A compiled CUDA step therefore runs its whole life on one thread of its
own (`DecodeStep`): compiled (a forward of its own, `forward_of_its_own`), warmed up, recorded and
replayed there, one manager per step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from collections import defaultdict
from collections.abc import Callable

import torch

from fusion.own_thread import OwnThread

logger = logging.getLogger(__name__)

TREE_STATE = ("tree_manager_containers", "tree_manager_locks")
# torch from 2.13 serialises the trees' recordings and warm-ups across threads itself (`graph_capture_lock`);
# before, nothing did, and one thread's recording could be broken by another's (a synchronize in the middle of
# a capture): there the steps' graph threads take turns.
_TAKE_TURNS = threading.Lock()


def prepare_graph_trees() -> None:
    """Give the calling thread the CUDA-graph trees' per-thread state where torch does not create it
    itself (before 2.13): what torch 2.13's `_initialize_tls` does in any thread that asks."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if all(hasattr(local, name) or torch._C._is_key_in_tls(name) for name in TREE_STATE):
        return
    initialize = getattr(cudagraph_trees, "_initialize_tls", None)
    if initialize is not None:
        initialize(local)
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    for name in TREE_STATE:  # copied into the autograd engine's threads started from here, as torch does
        torch._C._stash_obj_in_tls(name, getattr(local, name))


def _prepare_or_warn() -> None:
    # A torch whose trees' internals differ from the ones read here is told of in the log, not by a broken
    # thread: its own handling of the state may still serve.
    try:
        prepare_graph_trees()
    except Exception:
        logger.warning("could not give a compiled CUDA step's thread the CUDA-graph trees' state", exc_info=True)


def graph_thread() -> OwnThread:
    """A new thread for one compiled CUDA step's graphs."""
    return OwnThread("fusion-cuda-graphs", initializer=_prepare_or_warn)


def turns() -> contextlib.AbstractContextManager:
    """What a compiled CUDA step holds around each call on its graph thread (asked once, when the step is
    made): the steps' threads take turns where torch does not serialise the trees' recordings itself
    (before 2.13)."""
    from torch._inductor import cudagraph_trees

    return contextlib.nullcontext() if hasattr(cudagraph_trees, "graph_capture_lock") else _TAKE_TURNS


def forward_of_its_own(module: torch.nn.Module) -> Callable:
    """`module.forward`, bound to a copy of its code object. dynamo keeps compiled graphs per code object,
    shared by every module of the class whose shapes match; a compiled CUDA step's graph holds the CUDA
    graphs it recorded, bound to the tree manager of the thread that recorded them, so that each step
    (one thread each) must compile its own."""
    function = type(module).forward
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    own.__kwdefaults__, own.__qualname__ = function.__kwdefaults__, function.__qualname__
    return types.MethodType(own, module)
