"""The decode step at fixed shapes over preallocated KV slots: the CUDA implementation of a steady decode
step, captured as CUDA graphs, and run eagerly (the same shapes, no graphs) on a CPU, where the tests hold it
to the other steps.

A graph replays fixed device addresses, so everything a step reads or writes lives in buffers allocated
once:

    KVSlots      per layer, keys and values (slots, H_kv, columns, D), sized from the device's memory. A
                 decoding session owns one slot; its cache layers are views of the slot's row
                 (`GrowingLayer.adopting`), so transformers' forward writes prompt chunks into the slot in
                 place, and a step writes each row's new key and value at (slot, position). Slot 0 is
                 scratch: rows that pad a batch to its bucket step there.
    StaticStep   ids, positions, slots and adapter rows (max_batch,) each, and one graph per (bucket, width):
                 rows padded to a bucket (1, 2, 4, ... max_batch), attention over each slot's first `width`
                 columns (a power of two at least `min_width`, masked per row past its own length).

    ids (B,) ─ embed ─ rotary(positions) ─ for each layer: gather the rows' slots' first `width` columns
               (B, H_kv, width, D) → `DecoderLayer` (the fast step's own layer, adapters per row included)
               → write the new key and value at (slot, position) ─ final norm ─ head → (B, V) float32

Graphs are captured at warm-up (`capture`) on a side stream into one memory pool per step, with
`torch.cuda.CUDAGraph` directly: no compiler, no CUDA-graph trees, no thread-local state, so that any
thread replays them (on its current stream: experts on their own streams overlap). A replay is one launch.
One step's buffers are shared by whoever steps it, so each step first waits for the last one's work on
whatever stream that ran (`begin`).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fusion.forward.kv_cache import GrowingLayer
from fusion.forward.llama import FastDecoder, rms_norm
from fusion.forward.ops import rotary

logger = logging.getLogger(__name__)

SCRATCH = 0  # the slot padding rows step in
MAX_SLOTS = 512  # slots one expert keeps however much memory it may take (more sessions than steps hold)
MIN_WIDTH = 256  # the narrowest attention width graphs are captured for (columns a short history reads)


def widths_for(columns: int, min_width: int) -> list[int]:
    """The attention widths graphs are captured for: powers of two from `min_width`, then `columns` itself."""
    widths, width = [], min(min_width, columns)
    while width < columns:
        widths.append(width)
        width *= 2
    return widths + [columns]


def buckets_for(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below `max_batch`, then `max_batch`."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch]


def bytes_per_slot(decoder: FastDecoder, columns: int) -> int:
    """Device bytes one slot takes: keys and values of every layer over `columns` columns."""
    itemsize = decoder.embed.element_size()
    return 2 * len(decoder.blocks) * decoder.num_kv_heads * columns * decoder.head_dim * itemsize


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory (a CPU's: the host's)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


def slots_that_fit(decoder: FastDecoder, columns: int, memory_fraction: float) -> int:
    """How many slots `memory_fraction` of the device's memory holds (capped by what is free now, as vLLM's
    `gpu_memory_utilization` caps its blocks), at most `MAX_SLOTS`, at least 2 (scratch and one session)."""
    free, total = device_memory(decoder.embed.device)
    budget = min(total * memory_fraction, free * 0.9)
    return max(2, min(MAX_SLOTS, int(budget // bytes_per_slot(decoder, columns))))


class KVSlots:
    """Preallocated keys and values, one row per slot, and which session's cache holds each slot."""

    def __init__(self, decoder: FastDecoder, slots: int, columns: int) -> None:
        if slots < 2:
            raise ValueError(f"KV slots need at least 2 (one is scratch), got {slots}")
        shape = (slots, decoder.num_kv_heads, columns, decoder.head_dim)
        like = decoder.embed
        # Zeros: a step attends masked columns, and a NaN there would poison the masked-out product.
        self.keys = [like.new_zeros(shape) for _ in decoder.blocks]  # per layer (slots, H_kv, columns, D)
        self.values = [like.new_zeros(shape) for _ in decoder.blocks]
        self.columns = columns
        self._owner: list[weakref.ref | None] = [None] * slots  # the cache (a DynamicCache) in each slot
        self._slot_of: dict[int, int] = {}  # id(cache) -> its slot
        self._used: list[float] = [0.0] * slots  # when each slot was last stepped (for eviction)
        logger.info("KV slots: %d of %d columns (%.1f MiB)", slots - 1, columns,
                    sum(t.numel() * t.element_size() for t in self.keys + self.values) / 2**20)

    @property
    def count(self) -> int:
        return len(self._owner)

    def slot_of(self, cache) -> int | None:
        """The slot whose row `cache`'s layers still view, or None."""
        slot = self._slot_of.get(id(cache))
        if slot is None or self._owner[slot] is None or self._owner[slot]() is not cache:
            return None
        return slot if self._views(cache, slot) else None

    def _views(self, cache, slot: int) -> bool:
        # Every forward updates a cache's layers alike, so its first and last layers stand for all.
        layers = cache.layers
        return len(layers) == len(self.keys) and all(
            type(layers[i]) is GrowingLayer and layers[i]._key_buffer is not None
            and layers[i]._key_buffer.data_ptr() == self.keys[i][slot].data_ptr()
            and layers[i].capacity == self.columns for i in (0, -1))

    def _free(self, slot: int) -> bool:
        owner = self._owner[slot]
        cache = owner() if owner is not None else None
        return cache is None or not self._views(cache, slot)

    def claim(self, cache, busy: Sequence = ()) -> int | None:
        """The slot `cache` steps in: its own, or a free one its columns are copied into, evicting the
        least recently stepped session not in `busy` (its columns copied out to buffers of its own) when
        none is free. None when its history and the new column do not fit a slot."""
        slot = self.slot_of(cache)
        if slot is None:
            length = cache.get_seq_length()
            if length + 1 > self.columns:
                return None
            slot = self._take(busy)
            if slot is None:
                return None
            for index, layer in enumerate(cache.layers):
                self.keys[index][slot, :, :length] = layer.keys[0]
                self.values[index][slot, :, :length] = layer.values[0]
            cache.layers = [GrowingLayer.adopting(self.keys[i][slot : slot + 1], self.values[i][slot : slot + 1], length)
                            for i in range(len(self.keys))]
            self._owner[slot], self._slot_of[id(cache)] = weakref.ref(cache), slot
        self._used[slot] = time.monotonic()
        return slot

    def _take(self, busy: Sequence) -> int | None:
        for slot in range(1, self.count):
            if self._free(slot):
                self._forget(slot)
                return slot
        busy_ids = {id(cache) for cache in busy}
        candidates = [s for s in range(1, self.count) if id(self._owner[s]()) not in busy_ids]
        if not candidates:
            return None
        slot = min(candidates, key=self._used.__getitem__)
        evicted = self._owner[slot]()
        evicted.layers = [GrowingLayer.holding(layer.keys, layer.values) for layer in evicted.layers]
        self._forget(slot)
        return slot

    def _forget(self, slot: int) -> None:
        self._slot_of = {key: s for key, s in self._slot_of.items() if s != slot}
        self._owner[slot] = None


class StaticStep:
    """A `FastDecoder`'s decode step at fixed shapes over `KVSlots` (see the module docstring)."""

    def __init__(self, decoder: FastDecoder, slots: KVSlots, max_batch: int, min_width: int | None = None) -> None:
        self.decoder = decoder
        self.slots = slots
        self.max_batch = max_batch
        self.buckets = buckets_for(max_batch)
        self.widths = widths_for(slots.columns, MIN_WIDTH if min_width is None else min_width)
        device = decoder.embed.device
        self.device = device
        # The static inputs every graph reads (views of their first rows): ids, positions and slots, filled by
        # one copy from the host a step, and each row's adapter (-1: the base), copied on the device.
        self._inputs = torch.zeros(3, max_batch, dtype=torch.long, device=device)
        self._inputs[2] = SCRATCH
        self._ids, self._positions, self._slots = self._inputs
        self._adapter_rows = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self._columns = torch.arange(slots.columns, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps that replayed a captured graph (the rest ran eagerly)
        self._done: torch.cuda.Event | None = None  # the last step's end on its stream (see `begin`)
        self.shapes: Counter[tuple[int, int]] = Counter()  # steps by (bucket, width)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def shape_for(self, rows: int, longest: int) -> tuple[int, int]:
        """The (bucket, width) a step of `rows` rows whose longest cached history is `longest` ids runs at."""
        if not 0 < rows <= self.max_batch:
            raise ValueError(f"a static step takes 1 to {self.max_batch} rows, got {rows}")
        if longest >= self.slots.columns:
            raise ValueError(f"a history of {longest} ids leaves no column for the new id in slots of "
                             f"{self.slots.columns}")
        bucket = next(b for b in self.buckets if b >= rows)
        width = next(w for w in self.widths if w > longest)  # columns [0, longest) read, the new one written
        return bucket, width

    def begin(self) -> None:
        """Order the caller's stream after the last step's work, whichever stream that ran on: the static
        buffers, the slots and the graphs' outputs are shared, and a replay is queued, not finished, when
        it returns. Call before touching the slots (a claim's copies); each step calls it too."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)

    def __call__(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                 adapter_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, V) float32 after each row's new id `ids[b]`, at `positions[b]` (its cached ids) in
        slot `slots[b]`, adapted by `adapter_rows[b]` (B,) (None: the base); writes each row's new key and
        value at column `positions[b]` of its slot."""
        rows = len(ids)
        bucket, width = self.shape_for(rows, max(positions))
        self.begin()
        padding = bucket - rows  # rows of id 0 at position 0 in the scratch slot, through the base
        host = torch.tensor([list(ids) + [0] * padding, list(positions) + [0] * padding,
                             list(slots) + [SCRATCH] * padding], dtype=torch.long)  # (3, bucket)
        self._inputs[:, :bucket].copy_(host)
        self._adapter_rows[:bucket].fill_(-1)
        if adapter_rows is not None:
            self._adapter_rows[:rows].copy_(adapter_rows)
        self.shapes[bucket, width] += 1
        graph = self._graphs.get((bucket, width))
        if graph is not None:
            graph[0].replay()
            self.replays += 1
            logits = graph[1][:rows].clone()
        else:
            logits = self._compute(bucket, width)[:rows]
        if self.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.device))
        return logits

    def _compute(self, rows: int, width: int) -> torch.Tensor:
        """The step over the first `rows` static inputs, attention over `width` columns: (rows, V) float32."""
        decoder = self.decoder
        ids, positions, slots = self._ids[:rows], self._positions[:rows], self._slots[:rows]
        adapter_rows = self._adapter_rows[:rows] if decoder.adapters is not None else None
        x = F.embedding(ids, decoder.embed)  # (rows, hidden)
        cos, sin = rotary(positions, decoder.inv_freq, decoder.rope_scaling, x.dtype)  # (rows, 1, D) each
        mask = (self._columns[:width][None, :] < positions[:, None]).view(rows, 1, 1, width)
        for layer, block in enumerate(decoder.blocks):
            keys = self.slots.keys[layer][:, :, :width].index_select(0, slots)  # (rows, H_kv, width, D)
            values = self.slots.values[layer][:, :, :width].index_select(0, slots)
            x, k, v = block(x, cos, sin, keys, values, mask, adapter_rows)
            self.slots.keys[layer][slots, :, positions] = k  # (rows, H_kv, D) at each row's new column
            self.slots.values[layer][slots, :, positions] = v
        return decoder._head(rms_norm(x, decoder.norm, decoder.eps), False)  # (rows, V) float32

    def capture(self) -> float:
        """Capture one CUDA graph per (bucket, width) on a side stream into one memory pool; → seconds taken.
        Scratch inputs only: every row steps slot 0 at position 0."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs are captured on CUDA; on a CPU the static step runs eagerly")
        start = time.perf_counter()
        self._ids.zero_()
        self._positions.zero_()
        self._slots.fill_(SCRATCH)
        self._adapter_rows.fill_(-1)
        # Other threads may launch work while a graph is captured (other experts' steps): only this thread's
        # unsafe calls fail the capture.
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # The largest shapes first, so that the pool's blocks serve every smaller graph after them.
            for bucket in reversed(self.buckets):
                for width in reversed(self.widths):
                    for _ in range(2):  # warm-up: kernels chosen and libraries' handles made outside capture
                        self._compute(bucket, width)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                        out = self._compute(bucket, width)
                    self._graphs[(bucket, width)] = (graph, out)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batches %s, widths %s) in %.1f s", len(self._graphs),
                    self.buckets, self.widths, seconds)
        return seconds


def static_step_for(decoder: FastDecoder, *, columns: int, memory_fraction: float, max_batch: int,
                    slots: int | None = None) -> StaticStep:
    """A static step for `decoder` with KV slots of `columns` columns: `slots` of them, or as many as
    `memory_fraction` of the device's memory holds."""
    count = slots if slots is not None else slots_that_fit(decoder, columns, memory_fraction)
    count = max(count, 2)
    if count - 1 < max_batch:
        logger.warning("KV slots for %d sessions, fewer than max_decode_batch %d: larger batches step in turns",
                       count - 1, max_batch)
    return StaticStep(decoder, KVSlots(decoder, count, columns), min(max_batch, count - 1))

