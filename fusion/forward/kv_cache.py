"""Key/value caches that append in place.

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies the whole
cache of that layer on every decoding step: at 1k cached ids and 8 sessions that copying was 45% of an
expert step on a 2-core CPU. `GrowingLayer` keeps keys and values in buffers with spare columns and
writes new columns in place; `keys`/`values` are views of the filled part. The buffer grows by half
its size (at least `spare` columns) when full, so appends cost amortised O(new columns).

`Cohort` keeps a batched decode step's sessions side by side: their caches become views of rows of
one left-padded batch buffer, so consecutive steps of the same sessions copy nothing.

Models whose cache has sliding-window (or other non-plain) layers keep transformers' own layers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DEFAULT_SPARE = 128  # columns reserved beyond what is filled when a buffer is (re)allocated


class GrowingLayer(DynamicLayer):
    """A full-attention layer's cache: buffers (B, H, capacity, D) of which the first `length` columns
    are filled; `keys`/`values` are (B, H, length, D) views of them."""

    def __init__(self, spare: int | None = None) -> None:
        super().__init__()
        spare = DEFAULT_SPARE if spare is None else spare
        if spare < 0:
            raise ValueError(f"spare must be >= 0, got {spare}")
        self.spare = spare
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, spare: int | None = None) -> GrowingLayer:
        """A layer holding a copy of `keys`/`values` (B, H, n, D), with `spare` free columns after them."""
        layer = cls(spare)
        layer.update(keys, values)
        return layer

    @classmethod
    def adopting(cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> GrowingLayer:
        """A layer over existing buffers (B, H, capacity, D) whose first `length` columns are filled."""
        layer = cls(spare=0)
        layer.lazy_initialization(key_buffer, value_buffer)
        layer._key_buffer, layer._value_buffer, layer._length = key_buffer, value_buffer, length
        return layer

    @property
    def capacity(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed + self.spare, self.capacity + self.capacity // 2)
        batch, heads, _, key_dim = key_states.shape
        # Zeros, not garbage: the fast decode step (fusion.forward.llama) attends masked spare columns,
        # and a NaN there would poison the masked-out product.
        keys = key_states.new_zeros(batch, heads, capacity, key_dim)
        values = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
        if self._length:
            keys[..., : self._length, :] = self._key_buffer[..., : self._length, :]
            values[..., : self._length, :] = self._value_buffer[..., : self._length, :]
        self._key_buffer, self._value_buffer = keys, values

    def reserve(self, needed: int, like: torch.Tensor | None = None) -> None:
        """Make room for `needed` columns in the existing buffers (growing them as `update` would); a layer
        that holds none yet allocates them shaped as `like` (B, H, 0, D), in its dtype."""
        if self._key_buffer is None:
            if like is None:
                raise ValueError("reserve needs a layer that holds keys already, or a tensor to shape its buffers")
            if not self.is_initialized:
                self.lazy_initialization(like, like)
            self._reserve(needed, like, like)
            return
        self._reserve(needed, self._key_buffer, self._value_buffer)

    def row_view(self, row: int, start: int, length: int) -> GrowingLayer:
        """A layer whose buffers are row `row` of this one's from column `start` on (views, no copy):
        appending to it writes into that row, until it outgrows the row and copies itself out."""
        return GrowingLayer.adopting(self._key_buffer[row : row + 1, :, start:],
                                     self._value_buffer[row : row + 1, :, start:], length)

    def is_row_view(self, batch: GrowingLayer, row: int, start: int) -> bool:
        """Whether this layer's buffers are still `batch.row_view(row, start, ...)`'s."""
        return all(
            mine is not None and mine._base is theirs
            and mine.storage_offset() == theirs.storage_offset() + row * theirs.stride(0) + start * theirs.stride(2)
            for mine, theirs in ((self._key_buffer, batch._key_buffer), (self._value_buffer, batch._value_buffer))
        )

    # `keys`/`values` are views of the filled columns, made on access: moving the fill mark is then an
    # int assignment (a cohort moves it on every member layer after every step).
    @property
    def keys(self) -> torch.Tensor | None:
        buffer = self.__dict__.get("_key_buffer")
        return None if buffer is None else buffer[..., : self._length, :]

    @keys.setter
    def keys(self, value) -> None:  # transformers' base class initialises it to None
        if value is not None:
            raise AttributeError("GrowingLayer.keys is a view of its buffer; append with update()")

    @property
    def values(self) -> torch.Tensor | None:
        buffer = self.__dict__.get("_value_buffer")
        return None if buffer is None else buffer[..., : self._length, :]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("GrowingLayer.values is a view of its buffer; append with update()")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self._length = end
        return self.keys, self.values

    def filled(self, length: int) -> None:
        """Mark the first `length` columns filled: ones written into the buffers in place (within capacity)."""
        if not self._length <= length <= self.capacity:
            raise ValueError(f"cannot mark {length} columns filled: {self._length} are, of {self.capacity}")
        self._length = length

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of columns to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(0, self._length + tokens_to_remove)

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self._length = 0
        super().reset()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._key_buffer is not None:
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._key_buffer is not None:
            self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
            self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))


def is_plain(layer) -> bool:
    """A full-attention layer that batched steps can pad and extend (not sliding-window, not quantised)."""
    return type(layer) in (DynamicLayer, GrowingLayer)


def new_cache(model_config, spare: int | None = None) -> DynamicCache:
    """An empty cache for `model_config` whose plain layers append in place."""
    cache = DynamicCache(config=model_config)
    cache.layers = [GrowingLayer(spare) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # layers created lazily, one per model layer
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def cache_of(layers: list) -> DynamicCache:
    """A cache made of the given layer objects."""
    cache = DynamicCache()
    cache.layers = list(layers)
    return cache


def cache_holding(layers: list[tuple[torch.Tensor, torch.Tensor]], spare: int | None = None) -> DynamicCache:
    """A cache holding copies of per-layer (keys, values), each (B, H, n, D), with `spare` free columns."""
    return cache_of([GrowingLayer.holding(keys, values, spare) for keys, values in layers])


class Cohort:
    """Sessions decoded together whose caches are rows of one left-padded batch buffer per layer.

    A batched decode step needs the sessions' keys/values side by side in one padded batch. Copying
    them there on every step (and each new column back) costs a pass over every cache per step.
    Instead, the batch is built once; afterwards each session's cache layers are views of its row
    (`GrowingLayer.row_view`), and a step whose sessions are exactly the cohort's, each still a view
    of its row and ending at the common frontier, runs on the batch buffers in place. A session
    extended on its own (a crop, a prompt chunk) either writes into its row or, past the row's
    capacity, copies itself out; either way `rows_for` no longer matches and the next step rebuilds.

    Row b holds its session's columns [starts[b], frontier); columns before are zero padding."""

    def __init__(self, caches: list[DynamicCache], spare: int | None = None) -> None:
        spare = DEFAULT_SPARE if spare is None else spare
        lengths = [cache.get_seq_length() for cache in caches]
        longest = max(lengths)
        self.members = list(caches)  # the sessions' cache objects, by identity
        self.starts = [longest - n for n in lengths]
        self.layers: list[GrowingLayer] = []
        for index in range(len(caches[0].layers)):
            sources = [cache.layers[index] for cache in caches]
            buffers = []
            for part in ("keys", "values"):
                first = getattr(sources[0], part)  # (1, H, n, D)
                # Zeros around the rows: padding and spare columns are masked out but must not hold NaNs.
                buffer = first.new_zeros(len(sources), first.shape[1], longest + 1 + spare, first.shape[-1])
                for row, (source, start) in enumerate(zip(sources, self.starts)):
                    buffer[row, :, start:longest] = getattr(source, part)[0]
                buffers.append(buffer)
            self.layers.append(GrowingLayer.adopting(*buffers, length=longest))
        self.point_members()

    @property
    def frontier(self) -> int:
        return self.layers[0].get_seq_length()

    def lengths(self) -> list[int]:
        return [self.frontier - start for start in self.starts]

    def rows_for(self, caches: list[DynamicCache]) -> list[int] | None:
        """The row of each cache if these are exactly the cohort's sessions, unchanged since its last
        step; otherwise None."""
        if len(caches) != len(self.members):
            return None
        row_of = {id(cache): row for row, cache in enumerate(self.members)}
        rows = [row_of.get(id(cache)) for cache in caches]
        if None in rows or len(set(rows)) != len(rows):
            return None
        frontier = self.frontier
        for cache, row in zip(caches, rows):
            start = self.starts[row]
            if cache.get_seq_length() != frontier - start or not self._still_row_view(cache, row):
                return None
        return rows

    def _still_row_view(self, cache: DynamicCache, row: int) -> bool:
        """Whether the cache's layers are still views of `row`. A cache's layers are appended, cropped
        and reallocated together (every forward updates each layer alike), so its first and last
        layers stand for all."""
        layers = cache.layers
        if len(layers) != len(self.layers):
            return False
        start = self.starts[row]
        return all(isinstance(layers[i], GrowingLayer) and layers[i].is_row_view(self.layers[i], row, start)
                   for i in (0, -1))

    def batch_cache(self) -> DynamicCache:
        """The batch as one cache (B rows) for a forward; call `point_members` after it."""
        return cache_of(self.layers)

    def point_members(self) -> None:
        """Make every member's layers views of its row, up to the frontier (after a step, or after the
        batch buffers grew and moved)."""
        frontier = self.frontier
        for row, (cache, start) in enumerate(zip(self.members, self.starts)):
            length = frontier - start
            if self._still_row_view(cache, row):  # the common case: only the fill mark moves
                for own in cache.layers:
                    own._length = length
            else:  # first pointing, or the batch buffers grew and moved
                cache.layers = [batch.row_view(row, start, length) for batch in self.layers]

    def release(self, keep: list[DynamicCache], alive: list[DynamicCache]) -> None:
        """Dissolve the cohort: `alive` members not in `keep` that are still views of its rows get
        buffers of their own (the others are gone), so that the batch buffers are freed."""
        kept, living = {id(cache) for cache in keep}, {id(cache) for cache in alive}
        for row, cache in enumerate(self.members):
            if id(cache) in kept or id(cache) not in living:
                continue
            if self._still_row_view(cache, row):
                cache.layers = [GrowingLayer.holding(own.keys, own.values) for own in cache.layers]
        self.members = []
