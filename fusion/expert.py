"""The expert runtime: one causal LM, its tokenizer, and per-session KV caches.

`step(requests)` takes a batch of sessions, each with its full token history, and returns the
next-token logits of each: `(B, V)` float32. Only the uncached suffix of each history is computed.
The same contract is served over gRPC by `services/expert_server.py` and called through
`services/remote_expert.py`; the engine treats both alike except for scheduling (in-process CPU
experts compute on the compute thread, remote ones overlap on threads of their own).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from fusion.adapter_merge import apply_adapter
from fusion.compute import run_on_compute_thread, single_team
from fusion.config import ExpertConfig
from fusion.errors import AssetError, ConfigError, InvalidArgumentError
from fusion.fast_decode import (GEMMA3, DecodeStep, configure_compile_cache, decode_after_shared_history,
                                decode_on_layers, unsupported_reason)
from fusion.kv_cache import Cohort, GrowingLayer, cache_holding, cache_of, is_plain, new_cache
from fusion.quantized import packed_cache_file, quantize_model
from fusion.session_cache import SessionCache

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StepRequest:
    session_id: str
    token_ids: Sequence[int]  # the session's whole history: prompt + generated ids


@dataclass
class _Extensions:
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


# Cache layers whose `update` rebinds keys/values to `torch.cat([old, new])`, never writing in place.
_CONCATENATING = (DynamicLayer, DynamicSlidingWindowLayer)
MAX_EXTENSIONS = 256  # extensions one `extend` call may ask for
MAX_EXTENSION_TOKENS = 64  # ids in one extension
MAX_KEPT_CALLS = 4  # `extend` calls on one history whose rows a session keeps for its next history


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


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the token ↔ id map: equal iff the same ids mean the same strings. Special-token
    roles (which id ends a turn) may differ between variants of one family and do not enter it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8"))
    return digest.hexdigest()[:16]


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (generation_eos, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def load_tokenizer(config: ExpertConfig, model_path: str):
    """The expert's tokenizer (for a remote expert, from the same folder or hub id as its replicas)."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": config.gguf_file} if config.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(model_path, **kwargs)
    except (OSError, ValueError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AssetError(f"expert {config.name!r}: cannot load the tokenizer of {model_path!r}: {first_line}") from None


def load_model_and_tokenizer(config: ExpertConfig, model_path: str, codes_dir: Path | None = None):
    """Load through the real transformers path: a local folder, a hub id, or a GGUF file in a folder;
    with the config's PEFT `adapter` merged in, and its weights quantized as the config says (the codes
    kept under `codes_dir`, if given, for the next start)."""
    from transformers import AutoModelForCausalLM

    looks_local = model_path.startswith((".", "/", "~")) or Path(model_path).exists()
    if looks_local and not Path(model_path).expanduser().exists():
        raise AssetError(f"expert {config.name!r}: model folder not found: {model_path}")
    tokenizer = load_tokenizer(config, model_path)
    kwargs = {"gguf_file": config.gguf_file} if config.gguf_file else {}
    dtype = _DTYPES.get(config.dtype, "auto")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs)
    except (OSError, ValueError, EnvironmentError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AssetError(f"expert {config.name!r}: cannot load model {model_path!r}: {first_line}") from None
    if config.adapter is not None:
        model = apply_adapter(model, config.adapter, config.name)
    model.to(config.device).eval()
    if config.weights != "dense":
        cache_file = None if codes_dir is None else packed_cache_file(
            codes_dir, model_path, config.weights, config.dtype, config.adapter)
        try:
            quantize_model(model, config.weights, cache_file)
        except ValueError as err:
            raise ConfigError(f"experts.{config.name}.weights: {config.weights} is not available for "
                              f"{model_path!r}: {err}") from None
    return model, tokenizer


def codes_folder(compile_cache_dir: Path | None) -> Path | None:
    """Where quantized weights' codes are kept (fusion.quantized): beside the compiled decode steps, as
    they too are made for this machine's CPU kernels."""
    return None if compile_cache_dir is None else Path(compile_cache_dir) / "weights"


class LocalExpert:
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
        self._extensions: dict[str, list[_Extensions]] = {}
        self.max_decode_batch = max_decode_batch
        layers = new_cache(model.config).layers
        self._plain_cache = bool(layers) and all(is_plain(layer) for layer in layers)  # no sliding windows
        self._cohort: Cohort | None = None  # the sessions of the last batched decode step (see Cohort)
        self.decode_batches = {"in_place": 0, "rebuilt": 0}  # batched decode steps, by how the batch was had
        # See `_decode_mask`: on CPU, decode steps hand SDPA a ready-made mask.
        self._ready_made_decode_mask = (
            self._plain_cache and self.device.type == "cpu"
            and getattr(model.config, "_attn_implementation", None) == "sdpa"
        )
        self._fast_step = self._decode_step(config, model)  # None: decode steps run transformers' forward
        # The adapter of each row of the next forward, for experts whose rows run different adapters over
        # one base (fusion.shared_base); None: no adapters.
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
        """Load the expert; a compiled decode step keeps its compiled code, and quantized weights their
        codes (`codes_folder`), under `compile_cache_dir`
        (else inductor's default folder) so that the next start reuses it."""
        path = model_path or config.model
        logger.info("loading expert %s from %s (%s on %s)", config.name, path, config.dtype, config.device)
        if config.decode == "compiled" and compile_cache_dir is not None:
            configure_compile_cache(compile_cache_dir)

        def load() -> LocalExpert:
            model, tokenizer = load_model_and_tokenizer(config, path, codes_folder(compile_cache_dir))
            expert = cls(config, model, tokenizer, model_ref=path)
            if expert._fast_step is not None and expert._fast_step.mode != "off":
                expert.warm_up()
            return expert

        # On the compute thread, like every step after it: a second thread's OpenMP team would slow
        # every later forward (see fusion.compute).
        return run_on_compute_thread(load)

    def _decode_step(self, config: ExpertConfig, model) -> DecodeStep | None:
        """The fast decode step the config asks for, if the model and its cache allow one."""
        if config.decode == "transformers":
            return None
        reason = unsupported_reason(model, compiled=config.decode == "compiled")
        if reason is None and not self._plain_cache and getattr(model.config, "model_type", None) != GEMMA3:
            reason = "a cache with non-plain layers"  # (Gemma 3's step reads its sliding-window layers itself)
        if reason is not None:
            if config.decode == "compiled":
                raise ValueError(f"expert {config.name!r}: decode: compiled is not available for this model: {reason}")
            logger.info("expert %s decodes with transformers' forward: %s", config.name, reason)
            return None
        if config.decode == "fast":
            return DecodeStep(model, "off")
        return DecodeStep(model, "cudagraphs" if self.device.type == "cuda" else "inductor")

    def warm_up(self) -> float:
        """Compile a compiled decode step's graphs now (or load them from inductor's cache), before the
        expert serves, on three scratch sessions released afterwards. Compiled lazily, they would stall
        the first batched step and the first single ones, and every stream stepping beside them (up to
        two minutes each on a cold cache for SmolLM2 on 2 cores). Call it on the thread that will step
        the expert (the compute thread): the graphs are compiled for its thread count. The expert's
        counters are left as they were. → seconds taken."""
        start = time.perf_counter()
        counters = (self.fast_decode_steps, dict(self.decode_batches), self.cache.hits, self.cache.misses,
                    self.cache.evictions)
        top = max(2, min(self.info.tokenizer_size, self.info.vocab_size))
        histories = {f"warm-up-{uuid.uuid4().hex}": [(7 * k + 3) % top for k in range(1, n + 1)]
                     for n in (6, 4, 5)}
        a, b, c = histories
        try:
            # a prefill of two sessions, a decode step of both (the any-rows graph), the shorter alone (the
            # one-row graph, over its row of batch buffers wider than its own columns), then a third
            # session alone from its prefill on (buffers of its own: another stride, after which dynamo
            # compiles the one-row graph for any)
            for names in ([a, b], [a, b], [b], [c], [c]):
                self.step([StepRequest(name, histories[name]) for name in names])
                for name in names:
                    histories[name].append(len(histories[name]) % top)
        finally:
            self.release(list(histories))
        (self.fast_decode_steps, self.decode_batches, self.cache.hits, self.cache.misses,
         self.cache.evictions) = counters
        seconds = time.perf_counter() - start
        logger.info("expert %s: decode step ready (compiled or loaded) in %.1f s", self.info.name, seconds)
        return seconds

    # -- the expert contract -------------------------------------------------------------------
    def step(self, requests: Sequence[StepRequest]) -> torch.Tensor:
        """Next-token logits for each session: (B, V) float32 on the expert's device.

        Sessions whose cache lacks only the last id (steady decoding) run as one batched forward;
        sessions with nothing cached (new prompts) run as another, left-padded; the others (a later
        prompt chunk, diverged or evicted histories) run one by one."""
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
                if self._batchable(entry, token_ids):
                    decode.append((i, entry, token_ids))
                elif self._fresh_batchable(entry, token_ids):
                    fresh.append((i, entry, token_ids))
                else:
                    rows[i] = self._forward_tail(r.session_id, token_ids, 1)[-1]
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
                call = _Extensions(token_ids, base_logits, [], [], None, base_logits[None])
            earlier = self._extensions.get(session_id, [])  # calls on this same history (see `_advance`)
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
                         grown: list[tuple[int, ...]]) -> _Extensions:
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
            return _Extensions(token_ids, base_logits, grown, rows, None, logits, 1, (keys, values))  # rows: 0..R-1
        ids = torch.zeros(len(longest), width, dtype=torch.long, device=self.device)  # (R, width), right-padded
        for row, e in enumerate(longest):
            ids[row, : len(e)] = torch.tensor(e, device=self.device)
        batch_kv = self._repeated(kv, len(longest), width)
        positions = torch.arange(start, start + width, device=self.device)[None].expand(len(longest), -1)
        out = self.model(input_ids=ids, position_ids=positions, cache=batch_kv, use_cache=True)
        last = torch.tensor([len(e) - 1 for e in grown], device=self.device)
        logits = out.logits[torch.tensor(rows, device=self.device), last].float()  # (k, V)
        self.cache.record(hits=start * len(longest), misses=sum(len(e) for e in longest))
        return _Extensions(token_ids, base_logits, grown, rows, batch_kv, logits, width)

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

    def _adopt(self, entry, call: _Extensions, index: int, token_ids: list[int]) -> torch.Tensor:
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

    def release(self, session_ids: Sequence[str]) -> None:
        with self._lock:
            for session_id in session_ids:
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
        ran 4-5x slower at 1k cached ids than the packed single-query path it takes when a mask is
        present. Otherwise (B, width) long, as transformers expects."""
        mask = self._left_padded_mask(lengths, width)
        return mask.bool()[:, None, None, :] if self._ready_made_decode_mask else mask

    def _fresh_batchable(self, entry, token_ids: list[int]) -> bool:
        """A new prompt (nothing reusable cached) on a model whose cache layers are all plain."""
        if self.max_decode_batch <= 1 or self.cache.reusable_length(entry, token_ids) > 0:
            return False
        return self._plain_cache

    def _select_rows(self, session_ids: list[str]) -> None:
        """Before a forward whose batch rows are these sessions' (in order): nothing here; an expert whose
        rows run different adapters sets `_rows_now` (fusion.shared_base)."""

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
        session's cache is then a view of its batch row. Returns (B, V) float32 in `entries` order."""
        caches = [e.kv for e in entries]
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
        return logits[torch.tensor(rows, device=logits.device)]  # back in request order

    def _forward_tail(self, session_id: str, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        """Run the uncached suffix of `token_ids`; return logits of its last `num_logits` positions (n, V)."""
        token_ids = list(token_ids)
        self._check_ids(token_ids)
        self._select_rows([session_id])
        entry = self.cache.get(session_id)
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
                logits = self._fast_forward(entry.kv.layers, token_ids[-1:], [reuse])  # (1, V)
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
