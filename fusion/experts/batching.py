"""How `LocalExpert.step` batches sessions: new prompts of different lengths prefilled in one
left-padded forward, steadily decoding sessions stepped in one forward over their `Cohort` (reused
in place while the same sessions step), and the attention masks both need.
"""

from __future__ import annotations

import torch

from fusion.forward.kv_cache import Cohort, cache_holding, is_plain, new_cache


class BatchedForwardsMixin:
    """The batched forwards of `step`, for `LocalExpert`. The host provides `model`, `device`,
    `cache`, `max_decode_batch`, `_plain_cache`, `_fast_step`, `_static`, `_select_rows`, `_fast_forward` and
    `_static_forward`, and
    owns the batching state its constructor sets: `_cohort` (the sessions of the last batched decode
    step), `decode_batches` (batched decode steps, by how the batch was had) and
    `_ready_made_decode_mask`."""

    def _batchable(self, entry, token_ids: list[int]) -> bool:
        """Steady decoding: the cache holds exactly all ids but the last, in plain (non-sliding) layers."""
        return (
            self.max_decode_batch > 1
            and entry.kv is not None
            and len(token_ids) == entry.length + 1
            and entry.token_ids == token_ids[:-1]
            and all(is_plain(layer) for layer in entry.kv.layers)
        )

    def _left_padded_mask(self, lengths: list[int], width: int) -> torch.Tensor:
        """Attention mask of rows left-padded to `width`: 1 over each row's last `lengths[row]` columns.
        (B, width) long."""
        mask = torch.zeros(len(lengths), width, dtype=torch.long, device=self.device)
        for row, n in enumerate(lengths):
            mask[row, width - n:] = 1
        return mask

    def _decode_mask(self, lengths: list[int], width: int) -> torch.Tensor:
        """The attention mask of a decode step (one new id per row; row b attends its last `lengths[b]`
        of `width` columns). On CPU it is passed ready-made, (B, 1, 1, width) bool: transformers drops
        an all-ones mask and then asks SDPA for grouped-query attention (`enable_gqa`), which on CPU
        is several times slower over long caches than the packed single-query path it takes when a
        mask is present (docs/performance.md). Otherwise (B, width) long, as transformers expects."""
        mask = self._left_padded_mask(lengths, width)
        return mask.bool()[:, None, None, :] if self._ready_made_decode_mask else mask

    def _fresh_batchable(self, entry, token_ids: list[int]) -> bool:
        """A new prompt (nothing reusable cached) on a model whose cache layers are all plain. (`step` then
        runs the new prompts one by one, row by row through the C step, where they are few or `_row_by_row`.)"""
        if self.max_decode_batch <= 1 or self.cache.reusable_length(entry, token_ids) > 0:
            return False
        return self._plain_cache

    def _prefill_batch(self, entries: list, histories: list[list[int]], sessions: list[str]) -> torch.Tensor:
        """One forward for B new prompts of different lengths, left-padded (padding masked out, positions
        counted from each prompt's first id); each session keeps its own unpadded slice of the keys and
        values. Returns (B, V) float32: the logits after each prompt's last id."""
        lengths = [len(h) for h in histories]
        longest = max(lengths)
        ids = torch.zeros(len(histories), longest, dtype=torch.long, device=self.device)  # (B, longest)
        for row, history in enumerate(histories):
            ids[row, longest - len(history):] = torch.tensor(history, device=self.device)
        mask = self._left_padded_mask(lengths, longest)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, longest)
        self._select_rows(sessions)
        batched = new_cache(self.model.config, spare=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=batched,
                         use_cache=True, logits_to_keep=1)
        for row, (entry, history) in enumerate(zip(entries, histories)):
            start = longest - len(history)
            entry.kv = cache_holding([
                (layer.keys[row:row + 1, :, start:], layer.values[row:row + 1, :, start:]) for layer in batched.layers
            ])
            entry.token_ids = history
        self.cache.record(hits=0, misses=sum(lengths))
        return out.logits[:, -1].float()

    def _decode_batch(self, entries: list, histories: list[list[int]], sessions: list[str]) -> torch.Tensor:
        """One forward for B sessions of different lengths, left-padded into one batch (padding masked
        out). The batch is the expert's `Cohort`: built (one copy of each cache) when the sessions
        differ from the last batched step's, reused in place when they are the same; either way each
        session's cache is then a view of its batch row. With a static step, the sessions step in their KV
        slots instead, where they fit. Returns (B, V) float32 in `entries` order."""
        caches = [e.kv for e in entries]
        if self._static is not None:
            self._select_rows(sessions)
            logits = self._static_forward(caches, [history[-1] for history in histories])
            if logits is not None:
                for entry, history in zip(entries, histories):
                    entry.token_ids = history
                self.cache.record(hits=sum(len(h) - 1 for h in histories), misses=len(entries))
                return logits
        rows = self._cohort.rows_for(caches) if self._cohort is not None else None
        if rows is None:  # other sessions than last step's: copy them into a new batch once
            previous, self._cohort = self._cohort, Cohort(caches)
            if previous is not None:
                previous.release(keep=caches, alive=[e.kv for e in self.cache.entries()])
            rows = list(range(len(entries)))
            self.decode_batches["rebuilt"] += 1
        else:
            self.decode_batches["in_place"] += 1
        cohort = self._cohort
        order = sorted(range(len(entries)), key=rows.__getitem__)  # request index of each batch row
        lengths = cohort.lengths()  # (B,) cached ids per batch row
        new_ids = [histories[i][-1] for i in order]  # batch-row order
        self._select_rows([sessions[i] for i in order])
        if self._fast_step is None:
            mask = self._decode_mask([n + 1 for n in lengths], cohort.frontier + 1)  # cached ids + the new one
        try:
            if self._fast_step is not None:
                logits = self._fast_forward(cohort.layers, new_ids, lengths)
            else:
                logits = self.model(
                    input_ids=torch.tensor([[i] for i in new_ids], device=self.device),  # (B, 1)
                    attention_mask=mask,
                    position_ids=torch.tensor([[n] for n in lengths], device=self.device),  # (B, 1)
                    cache=cohort.batch_cache(),
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1].float()  # (B, V) in batch-row order
        except Exception:
            self._cohort = None
            raise
        cohort.point_members()
        for entry, history in zip(entries, histories):
            entry.token_ids = history
        self.cache.record(hits=sum(lengths), misses=len(entries))
        if rows == list(range(len(rows))):  # already in request order (a steady cohort's usual step): no copy
            return logits
        return logits[torch.tensor(rows, device=logits.device)]  # back in request order
