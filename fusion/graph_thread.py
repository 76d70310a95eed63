"""The thread a compiled CUDA decode step records and replays its CUDA graphs on.

`torch.compile(mode="reduce-overhead")` keeps its CUDA-graph trees (the recorded graphs and their
memory pool) in a tree manager per thread and device, and binds each recorded graph to the manager
of the thread that recorded it. Replayed from several threads at once, one manager's state would be
shared unguarded (the engine steps GPU experts from a pool of threads, the scheduler and the score
pool from their own); and torch before 2.13 created the per-thread state only in the thread that
imported the module, so any other thread failed its first recording with a bare AssertionError in
`cudagraph_trees.get_obj`. A compiled CUDA step therefore runs its whole life on one thread of its
own (`DecodeStep`): compiled, warmed up, recorded and replayed there, one manager per step.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from fusion.own_thread import OwnThread

TREE_STATE = ("tree_manager_containers", "tree_manager_locks")


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


def graph_thread() -> OwnThread:
    """A new thread for one compiled CUDA step's graphs."""
    return OwnThread("fusion-cuda-graphs", initializer=prepare_graph_trees)
