"""The expert runtime: one causal LM, its tokenizer, and per-session KV caches.

`step(requests)` takes a batch of sessions, each with its full token history, and returns the
next-token logits of each: `(B, V)` float32. Only the uncached suffix of each history is computed.
The same contract is served over gRPC by `services/expert_server.py` and called through
`services/remote_expert.py`; the engine treats both alike except for scheduling (in-process CPU
experts compute on the compute thread, remote ones overlap on threads of their own).

`LocalExpert` is the in-process one. Its loading lives in `fusion.experts.loading`, the batched
forwards of `step` in `fusion.experts.batching` and `extend` with its kept rows in
`fusion.experts.extensions`; this module holds the contract, the expert's state and the one-session
forward every path falls back on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from fusion.compute import run_on_compute_thread, single_team
from fusion.config import ExpertConfig
from fusion.errors import InvalidArgumentError
from fusion.experts.batching import BatchedForwardsMixin
from fusion.experts.extensions import ExtendMixin, ExtensionCall
from fusion.experts.loading import codes_folder, eos_ids, load_model_and_tokenizer, tokenizer_fingerprint
from fusion.forward.llama import (GEMMA, DecodeStep, FastDecoder, decode_on_layers, prefill_on_layers,
                                  unsupported_reason)
from fusion.forward.static_step import StaticStep, static_step_for
from fusion.forward.kv_cache import Cohort, GrowingLayer, cache_holding, is_plain, new_cache
from fusion.experts.prefix_pool import PrefixPool
from fusion.experts.session_cache import SessionCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRequest:
    session_id: str
    token_ids: Sequence[int]  # the session's whole history: prompt + generated ids


@dataclass(frozen=True)
class ExpertInfo:
    name: str
    model: str
    vocab_size: int  # width of the logits rows (may exceed the tokenizer's size: padded rows)
    tokenizer_size: int  # ids the tokenizer can produce
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    max_cached_tokens: int
    max_positions: int | None = None


class Expert(Protocol):
    """What the engine needs from an expert, local or remote."""

    info: ExpertInfo

    def step(self, requests: Sequence[StepRequest]) -> torch.Tensor:  # (B, V) float32
        ...

    def score(self, session_id: str, token_ids: Sequence[int], num_positions: int) -> torch.Tensor:  # (n, V)
        ...

    def extend(self, session_id: str, token_ids: Sequence[int], extensions: Sequence[Sequence[int]]
               ) -> torch.Tensor:  # (k, V): logits after token_ids + extensions[j] ([] : after token_ids)
        ...

    def release(self, session_ids: Sequence[str]) -> None:
        ...

    def describe(self) -> ExpertInfo:  # what it reports about itself (a remote one: its replicas' device)
        ...

    @property
    def active_sessions(self) -> int:  # sessions cached now (0 where unknown)
        ...

    def close(self) -> None:
        ...


class LocalExpert(ExtendMixin, BatchedForwardsMixin):
    """An in-process expert. Thread-safe: concurrent `step` calls are serialised per expert."""

    def __init__(
        self, config: ExpertConfig, model, tokenizer, *, model_ref: str | None = None, max_decode_batch: int = 64
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        self.cache = SessionCache(config.max_cached_tokens)
        self._lock = threading.Lock()
        # per session: its `extend` calls on its current history, oldest first (see `extend`)
        self._extensions: dict[str, list[ExtensionCall]] = {}
        self.max_decode_batch = max_decode_batch
        layers = new_cache(model.config).layers
        self._plain_cache = bool(layers) and all(is_plain(layer) for layer in layers)  # no sliding windows
        self._cohort: Cohort | None = None  # the sessions of the last batched decode step (see Cohort)
        # Released sessions' columns, for new sessions that begin alike (config `prefix_cache_tokens`)
        self.prefixes = PrefixPool(config.prefix_cache_tokens) if config.prefix_cache_tokens and self._plain_cache \
            else None
        self.decode_batches = {"in_place": 0, "rebuilt": 0}  # batched decode steps, by how the batch was had
        # See `_decode_mask`: on CPU, decode steps hand SDPA a ready-made mask.
        self._ready_made_decode_mask = (
            self._plain_cache and self.device.type == "cpu"
            and getattr(model.config, "_attn_implementation", None) == "sdpa"
        )
        self._fast_step = self._decode_step(config, model)  # None: decode steps run transformers' forward
        # The static-shape step over KV slots (decode: fast on CUDA, or static): steady decode steps of histories
        # that fit a slot run there; None: they run `_fast_step`.
        self._static: StaticStep | None = self._static_step(config)
        # Every forward row by row through the C step (config `batch_invariant`; `_forward_tail`)
        self._row_by_row = config.batch_invariant
        if self._row_by_row:
            self.check_row_by_row()
        # Whether the C step runs this expert's short forwards (config `c_step_prompt_ids`): asked on first use,
        # once a shared base's adapters are installed (they change its table), and not at load, where the
        # table would be built for nothing
        self._c_step_prompts: bool | None = None
        # The adapter of each row of the next forward, for experts whose rows run different adapters over
        # one base (fusion.experts.shared_base); None: no adapters.
        self._rows_now: torch.Tensor | None = None
        self.fast_decode_steps = 0  # decode steps (single or batched) that ran `_fast_step`
        width = model.get_output_embeddings().out_features
        self.info = ExpertInfo(
            name=config.name,
            model=model_ref or config.model,
            vocab_size=int(width),
            tokenizer_size=len(tokenizer),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            eos_token_ids=eos_ids(model, tokenizer),
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            device=str(self.device),
            max_cached_tokens=config.max_cached_tokens,
            max_positions=getattr(model.config, "max_position_embeddings", None),
        )

    @classmethod
    def load(cls, config: ExpertConfig, model_path: str | None = None,
             compile_cache_dir: Path | None = None) -> LocalExpert:
        """Load the expert (quantized weights keep their codes under `compile_cache_dir`, `codes_folder`, so
        that the next start reuses them); a static step on CUDA captures its graphs."""
        path = model_path or config.model
        logger.info("loading expert %s from %s (%s on %s)", config.name, path, config.dtype, config.device)

        def load() -> LocalExpert:
            model, tokenizer = load_model_and_tokenizer(config, path, codes_folder(compile_cache_dir))
            expert = cls(config, model, tokenizer, model_ref=path)
            expert.warm_up()
            return expert

        # On the compute thread, like every step after it: a second thread's OpenMP team would slow
        # every later forward (see fusion.compute).
        return run_on_compute_thread(load)

    def _decode_step(self, config: ExpertConfig, model) -> DecodeStep | None:
        """The eager fast decode step, if the model and its cache allow one."""
        if config.decode == "transformers":
            return None
        static = config.decode == "static"
        reason = unsupported_reason(model, static=static)
        if reason is None and not self._plain_cache and getattr(model.config, "model_type", None) not in GEMMA:
            reason = "a cache with non-plain layers"  # (Gemma's step reads its sliding-window layers itself)
        if reason is not None:
            if static:
                raise ValueError(f"expert {config.name!r}: decode: static is not available for this model: {reason}")
            logger.info("expert %s decodes with transformers' forward: %s", config.name, reason)
            return None
        return DecodeStep(model)

    def _static_step(self, config: ExpertConfig) -> StaticStep | None:
        """The static-shape step over KV slots, where the config asks for it (decode: static, or fast on
        CUDA) and the eager step is the Llama-family one."""
        wanted = config.decode == "static" or (config.decode == "fast" and self.device.type == "cuda")
        if not wanted or self._fast_step is None or not isinstance(self._fast_step.decoder, FastDecoder):
            if wanted and self._fast_step is not None:
                logger.info("expert %s: no static step for %s models: its eager step runs", config.name,
                            self.model.config.model_type)
            return None
        return static_step_for(self._fast_step.decoder, columns=config.kv_slot_tokens,
                               memory_fraction=config.kv_memory_fraction, max_batch=self.max_decode_batch,
                               slots=config.kv_slots)

    def _runs_row_by_row(self) -> bool:
        """Whether the C step can run this expert's prompts row by row (`c_step_prompt_ids`): its layers, and
        caches in a dtype it reads in place."""
        try:
            self.check_row_by_row()
        except ValueError:
            return False
        return self._fast_step.decoder.embed.dtype in (torch.bfloat16, torch.float32)

    def _short_for_c_step(self, ids: int) -> bool:
        """Whether a forward of `ids` ids in all runs row by row through the C step (`c_step_prompt_ids`;
        every one where `batch_invariant`). Not while the decoder's C layers are switched off (a benchmark
        timing torch's operators)."""
        if self._row_by_row:
            return True
        if ids > self.config.c_step_prompt_ids:
            return False
        if self._c_step_prompts is None:
            self._c_step_prompts = self._runs_row_by_row()
        return self._c_step_prompts and self._fast_step.decoder.native_layers

    def check_row_by_row(self) -> None:
        """ValueError unless the C step can run every forward of this expert (config `batch_invariant`)."""
        step = self._fast_step
        reason = None
        if step is None or not isinstance(step.decoder, FastDecoder):
            reason = "its decode step is not the fast Llama-family one"
        elif step.decoder._native_step() is None:
            reason = ("the C step cannot run its layers (the kernels did not build, or a projection or adapter "
                      "is not in their layouts; see the log)")
        if reason is not None:
            raise ValueError(f"expert {self.config.name!r}: batch_invariant: {reason}")

    def warm_up(self) -> float:
        """Capture the static step's CUDA graphs now, before the expert serves (captured lazily, the first
        steps would stall every stream beside them). Nothing to do elsewhere. → seconds taken."""
        if self._static is None or self.device.type != "cuda":
            return 0.0
        with torch.no_grad():
            seconds = self._static.capture()
        logger.info("expert %s: decode step ready: %d CUDA graphs in %.1f s", self.info.name, self._static.captured,
                    seconds)
        return seconds

    # -- the expert contract -------------------------------------------------------------------
    def step(self, requests: Sequence[StepRequest]) -> torch.Tensor:
        """Next-token logits for each session: (B, V) float32 on the expert's device.

        Sessions whose cache lacks only the last id (steady decoding) run as one batched forward;
        sessions with nothing cached (new prompts) run as another, left-padded, or one by one row by row
        through the C step where they are few (`c_step_prompt_ids`); the others (a later prompt chunk,
        diverged or evicted histories) run one by one."""
        if not requests:
            return torch.empty(0, self.info.vocab_size)
        ids = [r.session_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"expert {self.info.name!r}: a step names a session twice: {ids}")
        with self._lock, torch.no_grad(), single_team(self.device):
            rows: list[torch.Tensor | None] = [None] * len(requests)
            decode, fresh = [], []
            for i, r in enumerate(requests):
                token_ids = list(r.token_ids)
                self._check_ids(token_ids)
                entry = self.cache.get(r.session_id)
                self._adopt_prefix(r.session_id, entry, token_ids)
                if self._batchable(entry, token_ids):
                    decode.append((i, entry, token_ids))
                elif self._fresh_batchable(entry, token_ids):
                    fresh.append((i, entry, token_ids))
                else:
                    rows[i] = self._forward_tail(r.session_id, token_ids, 1)[-1]
            if fresh and self._short_for_c_step(sum(len(t) for _, _, t in fresh)):
                for i, _, token_ids in fresh:  # few rows: cheaper one prompt at a time through the C step
                    rows[i] = self._forward_tail(requests[i].session_id, token_ids, 1)[-1]
                fresh = []
            for group, batched_forward in ((decode, self._decode_batch), (fresh, self._prefill_batch)):
                if len(group) == 1:
                    i, _, token_ids = group[0]
                    rows[i] = self._forward_tail(requests[i].session_id, token_ids, 1)[-1]
                elif group:
                    try:
                        logits = batched_forward([entry for _, entry, _ in group], [t for _, _, t in group],
                                                 [requests[i].session_id for i, _, _ in group])
                    except Exception:
                        for i, _, _ in group:  # half-updated caches must not be reused
                            self.cache.release(requests[i].session_id)
                        raise
                    for (i, _, _), row in zip(group, logits):
                        rows[i] = row
            self.cache.evict(keep=ids)
        return torch.stack(rows)

    def score(self, session_id: str, token_ids: Sequence[int], num_positions: int) -> torch.Tensor:
        """Logits predicting each of the last `num_positions` ids of `token_ids`: (n, V) float32."""
        if not 0 < num_positions < len(token_ids):
            raise InvalidArgumentError(
                f"num_positions must be in [1, {len(token_ids) - 1}], got {num_positions}"
            )
        with self._lock, torch.no_grad(), single_team(self.device):
            logits = self._forward_tail(session_id, token_ids[:-1], num_positions)
            self.cache.evict(keep=[session_id])
        return logits

    def release(self, session_ids: Sequence[str]) -> None:
        with self._lock:
            for session_id in session_ids:
                self._keep_prefix(session_id)
                self.cache.release(session_id)
                self._extensions.pop(session_id, None)
            if self._cohort is not None:  # free the batch buffers once none of their sessions is left
                alive = {id(entry.kv) for entry in self.cache.entries()}
                if not any(id(member) in alive for member in self._cohort.members):
                    self._cohort = None

    def describe(self) -> ExpertInfo:
        return self.info

    @property
    def active_sessions(self) -> int:
        return len(self.cache)

    def close(self) -> None:
        """Nothing to free beyond what garbage collection does (the model goes with the object)."""

    def cache_stats(self) -> dict[str, int]:
        """A consistent snapshot of the KV cache counters (for metrics scrapes from other threads)."""
        with self._lock:
            return {
                "cached_tokens": self.cache.cached_tokens,
                "reused_tokens": self.cache.hits, "computed_tokens": self.cache.misses,
                "evictions": self.cache.evictions, **{f"decode_batches_{k}": v for k, v in self.decode_batches.items()},
                "prefix_kept_tokens": self.prefixes.kept_tokens if self.prefixes is not None else 0,
                "prefix_adopted_tokens": self.prefixes.adopted_tokens if self.prefixes is not None else 0,
            }

    # -- internals -------------------------------------------------------------------------------
    def _check_ids(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) == 0:
            raise InvalidArgumentError(f"expert {self.info.name!r}: token_ids must not be empty")
        limit = self.info.vocab_size
        bad = [t for t in token_ids if not 0 <= t < limit]
        if bad:
            raise InvalidArgumentError(
                f"expert {self.info.name!r}: token_ids out of range [0, {limit}): {bad[:5]}"
            )
        if self.info.max_positions and len(token_ids) > self.info.max_positions:
            raise InvalidArgumentError(
                f"expert {self.info.name!r}: {len(token_ids)} token_ids exceed the model's "
                f"{self.info.max_positions} positions"
            )

    def _namespace(self, session_id: str) -> str:
        """Which sessions may share kept prefixes with this one (`fusion.experts.prefix_pool`): all of this expert's."""
        return ""

    def _keep_prefix(self, session_id: str) -> None:
        """Offer a session being released to the prefix pool: its columns, where they match its ids."""
        entry = self.cache.peek(session_id)
        if self.prefixes is None or entry is None or entry.kv is None:
            return
        layers = entry.kv.layers
        if not all(isinstance(layer, GrowingLayer) and layer.get_seq_length() == entry.length for layer in layers):
            return
        self.prefixes.keep(self._namespace(session_id), entry.token_ids, [(l.keys, l.values) for l in layers])

    def _adopt_prefix(self, session_id: str, entry, token_ids: list[int]) -> None:
        """A session with nothing cached starts from the longest kept prefix of its ids, copied, if any."""
        if self.prefixes is None or entry.kv is not None:
            return
        found = self.prefixes.adopt(self._namespace(session_id), token_ids)
        if found is not None:
            length, layers = found
            entry.kv = cache_holding(layers)
            entry.token_ids = token_ids[:length]

    def _select_rows(self, session_ids: list[str]) -> None:
        """Before a forward whose batch rows are these sessions' (in order): nothing here; an expert whose
        rows run different adapters sets `_rows_now` (fusion.experts.shared_base)."""

    def _forward_tail(self, session_id: str, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        """Run the uncached suffix of `token_ids`; return logits of its last `num_logits` positions (n, V)."""
        token_ids = list(token_ids)
        self._check_ids(token_ids)
        self._select_rows([session_id])
        entry = self.cache.get(session_id)
        self._adopt_prefix(session_id, entry, token_ids)
        reuse = self.cache.reusable_length(entry, token_ids)
        # Logits are needed for the last `num_logits` positions, so those must be recomputed.
        reuse = min(reuse, len(token_ids) - num_logits)
        if entry.kv is None or reuse == 0:
            entry.kv = new_cache(self.model.config)
            reuse = 0
        elif reuse < entry.length:
            entry.kv.crop(reuse - entry.kv.get_seq_length())  # negative: drop the diverged tail
        suffix = torch.tensor([token_ids[reuse:]], dtype=torch.long, device=self.device)  # (1, S)
        fast = (self._fast_step is not None and suffix.shape[1] == 1 and reuse > 0
                and self._fast_step.decoder.can_read(entry.kv.layers))
        mask = self._decode_mask([reuse + 1], reuse + 1) if suffix.shape[1] == 1 and not fast else None
        try:
            if fast:
                logits = self._static_forward([entry.kv], token_ids[-1:]) if self._static is not None else None
                if logits is None:
                    logits = self._fast_forward(entry.kv.layers, token_ids[-1:], [reuse])  # (1, V)
            elif self._short_for_c_step(len(token_ids)):
                logits = prefill_on_layers(self._fast_step, entry.kv.layers, token_ids[reuse:], self._rows_now,
                                           num_logits)  # (n, V)
            else:
                logits = self.model(input_ids=suffix, attention_mask=mask, cache=entry.kv, use_cache=True,
                                    logits_to_keep=num_logits).logits[0, -num_logits:].float()  # (n, V)
        except Exception:
            self.cache.release(session_id)  # a half-updated cache must not be reused
            raise
        entry.token_ids = token_ids
        self.cache.record(hits=reuse, misses=len(token_ids) - reuse)
        return logits

    def _fast_forward(self, layers: list[GrowingLayer], new_ids: list[int], lengths: list[int]) -> torch.Tensor:
        """One decode step through the fast step over these cache layers (see `decode_on_layers`)."""
        self.fast_decode_steps += 1
        return decode_on_layers(self._fast_step, layers, new_ids, lengths, self._rows_now)

    def _static_forward(self, caches: list, new_ids: list[int]) -> torch.Tensor | None:
        """One decode step of these sessions' caches (each one id short of its history) through the static
        step, each cache moved into a KV slot of its own where it is not in one (a copy, once); its layers
        are views of the slot's row after it. None, with nothing changed, where some history does not fit a
        slot (it steps eagerly). (B, V) float32."""
        step = self._static
        if len(caches) > step.max_batch:
            return None
        lengths = [cache.get_seq_length() for cache in caches]
        if max(lengths) + 1 > step.slots.columns:
            return None
        step.begin()  # (the claims below may copy into slots the last step, on another stream, still reads)
        slots = [step.slots.claim(cache, busy=caches) for cache in caches]
        if None in slots:
            return None
        self.fast_decode_steps += 1
        logits = step(new_ids, lengths, slots, self._rows_now)
        for cache, length in zip(caches, lengths):
            for layer in cache.layers:
                layer.filled(length + 1)
        return logits
