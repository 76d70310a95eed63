"""`LocalExpert.extend`: the logits after a session's history plus each of several extensions.

The history is computed as `step` computes it (only its uncached suffix); the extensions then run as
one batch over copies of its keys/values, or, when each is one id, as one fast decode step that reads
the session's own columns in place. The rows are kept until the session's history changes: cross-
tokenizer fusion looks ahead and usually commits a path it looked at, and a history that is this
one plus one of the extensions is then adopted without a forward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from fusion.compute import single_team
from fusion.errors import InvalidArgumentError
from fusion.forward.llama import decode_after_shared_history
from fusion.forward.kv_cache import GrowingLayer, cache_of

# Cache layers whose `update` rebinds keys/values to `torch.cat([old, new])`, never writing in place.
_CONCATENATING = (DynamicLayer, DynamicSlidingWindowLayer)
MAX_EXTENSIONS = 256  # extensions one `extend` call may ask for
MAX_EXTENSION_TOKENS = 64  # ids in one extension
MAX_KEPT_CALLS = 4  # `extend` calls on one history whose rows a session keeps for its next history


@dataclass
class ExtensionCall:
    """One `extend` call of a session: the keys/values of its batch rows (each right-padded to `width`
    new columns) and its extensions' logits, so that the next call, whose history is that history plus
    one of them, starts without a forward. An extension that is a prefix of another shares its row."""

    base: list[int]  # the history the extensions extend
    base_logits: torch.Tensor | None  # (V,) after `base`
    extensions: list[tuple[int, ...]]  # the distinct nonempty extensions
    rows: list[int]  # the batch row holding each extension (in its first columns)
    kv: object  # a cache whose row rows[j] holds base + extensions[j] (then more columns up to `width`)
    logits: torch.Tensor  # (len(extensions), V) after each
    width: int = 1
    # Instead of `kv` (one-id extensions through the fast step): each row's new column, (layers, R, H_kv, D)
    # keys and values, to append to the session's own cache, which holds `base`.
    new_columns: tuple[torch.Tensor, torch.Tensor] | None = None

    def index_of(self, token_ids: list[int]) -> int | None:
        """The extension whose history is `token_ids` (None: none, or its row's columns after it cannot
        be dropped)."""
        n = len(self.base)
        if len(token_ids) <= n or len(token_ids) > n + self.width or token_ids[:n] != self.base:
            return None
        extension = tuple(token_ids[n:])
        if extension not in self.extensions:
            return None
        if len(extension) < self.width and not all(_croppable(layer) for layer in self.kv.layers):
            return None
        return self.extensions.index(extension)


def _croppable(layer) -> bool:
    """Whether dropping a layer's last columns restores the state it had before them: a full-attention
    layer, or a sliding-window one that has not yet dropped any column."""
    if type(layer) is GrowingLayer:
        return True
    window = getattr(layer, "sliding_window", None)
    return window is not None and layer.get_seq_length() < window


class ExtendMixin:
    """`extend` and the kept rows it adopts, for `LocalExpert`. The host provides `model`, `device`,
    `info`, `cache`, `_lock`, `_fast_step`, `_row_by_row`, `_rows_now`, `fast_decode_steps`, `_check_ids`,
    `_select_rows` and `_forward_tail`, and owns `_extensions` (per session: its `extend` calls on its
    current history, oldest first), which `release` empties for the sessions it frees."""

    def extend(self, session_id: str, token_ids: Sequence[int], extensions: Sequence[Sequence[int]]
               ) -> torch.Tensor:
        """Logits after `token_ids` + each extension (an empty extension: after `token_ids` itself):
        (k, V) float32. The history is computed as `step` would (only its uncached suffix); the
        extensions then run as one batch over copies of its keys/values (an extension that is a prefix
        of another shares its row), and are not cached, except that they are kept until the session's
        history changes (with those of earlier calls on the same history): a history that is this one
        plus one of them is then adopted without a forward (cross-tokenizer fusion looks ahead and
        usually commits a path it looked at; a row's columns after the adopted extension are dropped
        where every cache layer can drop columns)."""
        token_ids = list(token_ids)
        extensions = [list(e) for e in extensions]
        if not extensions:
            raise InvalidArgumentError("extensions: give at least one (an empty one means the history itself)")
        if len(extensions) > MAX_EXTENSIONS:
            raise InvalidArgumentError(f"extensions: {len(extensions)} exceed the limit {MAX_EXTENSIONS}")
        if max(len(e) for e in extensions) > MAX_EXTENSION_TOKENS:
            raise InvalidArgumentError(f"extensions: one holds more than {MAX_EXTENSION_TOKENS} ids")
        self._check_ids(token_ids)
        longest = max(len(e) for e in extensions)
        self._check_ids(token_ids + [t for e in extensions for t in e] or token_ids)
        if self.info.max_positions and len(token_ids) + longest > self.info.max_positions:
            raise InvalidArgumentError(f"expert {self.info.name!r}: history + extension exceed the model's "
                                       f"{self.info.max_positions} positions")
        with self._lock, torch.no_grad(), single_team(self.device):
            base_logits = self._advance(session_id, token_ids)  # (V,); the cache now holds token_ids
            self._select_rows([session_id])
            entry = self.cache.get(session_id)
            grown = list(dict.fromkeys(tuple(e) for e in extensions if e))  # distinct, in order
            if grown:
                call = self._extension_batch(entry.kv, token_ids, base_logits, grown)
            else:
                call = ExtensionCall(token_ids, base_logits, [], [], None, base_logits[None])
            earlier = self._extensions.get(session_id, [])  # calls on this same history (see `_advance`)
            # (rows of transformers' forward are not adopted where every forward must be the C step's)
            if not (self._row_by_row and call.kv is not None):
                self._extensions[session_id] = (earlier + [call])[-MAX_KEPT_CALLS:]
            self.cache.evict(keep=[session_id])
            for gone in [s for s in self._extensions if s not in self.cache]:  # evicted sessions
                del self._extensions[gone]
        if not any(extensions):
            return base_logits[None].expand(len(extensions), -1)  # no copy
        if all(extensions) and [tuple(e) for e in extensions] == call.extensions:
            return call.logits  # the lookahead's usual call: no copy
        index = {e: j for j, e in enumerate(call.extensions)}
        return torch.stack([call.logits[index[tuple(e)]] if e else base_logits for e in extensions])

    def _extension_batch(self, kv, token_ids: list[int], base_logits: torch.Tensor,
                         grown: list[tuple[int, ...]]) -> ExtensionCall:
        """One forward over the extensions `grown` (distinct, nonempty) of the history `token_ids`, whose
        keys/values `kv` holds: one batch row per extension that is no prefix of another (a prefix
        reads its logits from the longer row, at its own last column)."""
        longest = [e for e in grown if not any(len(f) > len(e) and f[: len(e)] == e for f in grown)]
        row_of = {}
        for row, e in enumerate(longest):
            for n in range(1, len(e) + 1):
                row_of.setdefault(e[:n], row)
        width = max(len(e) for e in longest)
        start = len(token_ids)
        rows = [row_of[e] for e in grown]
        if width == 1 and self._fast_step is not None and self._fast_step.decoder.can_read(kv.layers):
            # one id per row after the session's own columns: one fast step reads them once, unexpanded
            self.fast_decode_steps += 1
            logits, keys, values = decode_after_shared_history(self._fast_step, kv.layers, [e[0] for e in longest],
                                                               start, self._rows_now)
            self.cache.record(hits=start * len(longest), misses=len(longest))
            return ExtensionCall(token_ids, base_logits, grown, rows, None, logits, 1, (keys, values))  # rows: 0..R-1
        ids = torch.zeros(len(longest), width, dtype=torch.long, device=self.device)  # (R, width), right-padded
        for row, e in enumerate(longest):
            ids[row, : len(e)] = torch.tensor(e, device=self.device)
        batch_kv = self._repeated(kv, len(longest), width)
        positions = torch.arange(start, start + width, device=self.device)[None].expand(len(longest), -1)
        out = self.model(input_ids=ids, position_ids=positions, cache=batch_kv, use_cache=True)
        last = torch.tensor([len(e) - 1 for e in grown], device=self.device)
        logits = out.logits[torch.tensor(rows, device=self.device), last].float()  # (k, V)
        self.cache.record(hits=start * len(longest), misses=sum(len(e) for e in longest))
        return ExtensionCall(token_ids, base_logits, grown, rows, batch_kv, logits, width)

    @staticmethod
    def _repeated(kv, rows: int, width: int):
        """A copy of a one-row cache repeated over `rows` batch rows, with room for `width` more columns:
        full-attention layers are copied once each (expanded views, no spare beyond `width`); layers
        whose update concatenates (transformers' dynamic and sliding-window layers) hold expanded views
        of the session's tensors, which their first update copies anyway; others are deep-copied and
        repeated."""
        layers = []
        for layer in kv.layers:
            if type(layer) is GrowingLayer and layer.keys is not None:
                layers.append(GrowingLayer.holding(layer.keys.expand(rows, -1, -1, -1),
                                                   layer.values.expand(rows, -1, -1, -1), spare=width))
            elif type(layer) in _CONCATENATING and layer.is_initialized and layer.keys.shape[0] == 1:
                layer = copy.copy(layer)  # shares nothing it writes: update rebinds keys/values to new tensors
                layer.keys = layer.keys.expand(rows, -1, -1, -1)
                layer.values = layer.values.expand(rows, -1, -1, -1)
                layers.append(layer)
            else:
                layer = copy.deepcopy(layer)
                layer.batch_repeat_interleave(rows)
                layers.append(layer)
        return cache_of(layers)

    def _advance(self, session_id: str, token_ids: list[int]) -> torch.Tensor:
        """Make the session's cache hold `token_ids`; the logits after them (V,). Adopts an extension of
        the session's kept `extend` calls when the history is their base plus that extension."""
        kept = self._extensions.pop(session_id, [])
        entry = self.cache.get(session_id)
        if kept and entry.kv is not None and entry.token_ids == kept[0].base:
            if token_ids == kept[0].base and kept[-1].base_logits is not None:
                self._extensions[session_id] = kept  # the same history: its calls stay adoptable
                return kept[-1].base_logits
            for call in reversed(kept):
                index = call.index_of(token_ids)
                if index is not None:
                    return self._adopt(entry, call, index, token_ids)
        return self._forward_tail(session_id, token_ids, 1)[-1]

    def _adopt(self, entry, call: ExtensionCall, index: int, token_ids: list[int]) -> torch.Tensor:
        """The session's cache becomes the batch row of `call`'s extension `index`, cut after it (or, for
        a fast-step call, gets that row's new column appended); its logits (V,)."""
        if call.new_columns is not None:  # the session's cache still holds call.base (checked by `_advance`)
            keys, values = call.new_columns  # (layers, R, H_kv, D)
            row = call.rows[index]
            for layer, k, v in zip(entry.kv.layers, keys, values):
                layer.update(k[row, None, :, None], v[row, None, :, None])  # (1, H_kv, 1, D)
            entry.token_ids = list(token_ids)
            self.cache.record(hits=len(token_ids), misses=0)
            return call.logits[index]
        call.kv.batch_select_indices(torch.tensor([call.rows[index]], device=self.device))
        surplus = call.width - (len(token_ids) - len(call.base))
        if surplus:
            call.kv.crop(-surplus)
        entry.kv, entry.token_ids = call.kv, list(token_ids)
        self.cache.record(hits=len(token_ids), misses=0)
        return call.logits[index]
