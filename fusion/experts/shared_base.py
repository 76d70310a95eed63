"""Experts that share one base model: each is the base plus its own LoRA adapter (or the base alone),
and their rows of a step run as one batch over one copy of the base weights.

`SharedBaseExpert` is a `LocalExpert` over the base with every member's adapter installed per row
(fusion.experts.multi_lora); a session of member m lives in its cache as "m/<session id>", so each member keeps
its own keys and values while prefix reuse, cohort batching, chunked prefill and the fast decode
step work on all of them together. `AdapterMember` is what the engine sees: one expert per config
entry, with the Expert contract, stepping through the group. The engine steps a group's members
in one call (`step_members`) so that their rows share a forward; alone, a member still works.

`load_local_experts` builds the experts of a config: members that name the same base (same model,
GGUF file, dtype, device, decode, weights, batch_invariant and c_step_prompt_ids) and opt in (`share_base`,
the default) share one, the others load their own copy, with an adapter merged into it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from fusion.compute import run_on_compute_thread
from fusion.config import ExpertConfig
from fusion.errors import InvalidArgumentError
from fusion.experts.expert import Expert, ExpertInfo, LocalExpert, StepRequest
from fusion.experts.loading import codes_folder, load_model_and_tokenizer
from fusion.forward.llama import FastDecoder
from fusion.experts.multi_lora import BASE, MultiAdapter, load_lora

logger = logging.getLogger(__name__)

SEPARATOR = "/"  # never in an expert's name (config pattern), so "member/session" parses back


class SharedBaseExpert(LocalExpert):
    """One base model serving several members' rows, each with its adapter (or none)."""

    def __init__(self, configs: Sequence[ExpertConfig], model, tokenizer, *, model_ref: str, adapters: Sequence[str | None]
                 ) -> None:
        group = configs[0].model_copy(update={
            "name": "+".join(c.name for c in configs), "adapter": None,
            "max_cached_tokens": sum(c.max_cached_tokens for c in configs),
            "prefix_cache_tokens": sum(c.prefix_cache_tokens for c in configs)})
        super().__init__(group, model, tokenizer, model_ref=model_ref)
        loaded = [(c.name, load_lora(a, c.name)) for c, a in zip(configs, adapters) if a is not None]
        self.adapter_index = {name: k for k, (name, _) in enumerate(loaded)}
        self.multi = MultiAdapter(model, [pairs for _, pairs in loaded], [name for name, _ in loaded])
        if self._fast_step is not None:
            if isinstance(self._fast_step.decoder, FastDecoder):
                self._fast_step.decoder.adapters = self.multi
            else:  # a decode step that runs no adapters: transformers' forward (with the adapted linears)
                logger.info("experts %s: %s runs no adapters; decode steps run transformers' forward",
                            group.name, type(self._fast_step.decoder).__name__)
                self._fast_step = None
        if self._row_by_row:  # the C step's table now holds the adapters too
            self.check_row_by_row()
        self.members = [AdapterMember(self, c, f"{model_ref} + {a}" if a else model_ref) for c, a in zip(configs, adapters)]

    def select_base_rows(self) -> None:
        """The next forward of the model runs the bare base (every row without an adapter), whatever rows the
        members' last step left: for a forward of `self.model` outside `step` (a benchmark's plain forward)."""
        self._select_rows([""])

    def _namespace(self, session_id: str) -> str:
        """A member's sessions share kept prefixes only among themselves: its adapter's columns are its own."""
        return session_id.partition(SEPARATOR)[0]

    def _select_rows(self, session_ids: list[str]) -> None:
        rows = [self.adapter_index.get(s.partition(SEPARATOR)[0], BASE) for s in session_ids]
        self.multi.rows.set(rows)
        # Only base rows: the eager fast step skips the adapters' products (their deltas are zero); the static
        # step fills its rows with the base itself.
        self._rows_now = self.multi.rows.rows if self.multi.rows.any_adapter else None

    def step_members(self, parts: Sequence[tuple[AdapterMember, Sequence[StepRequest]]]) -> list[torch.Tensor]:
        """One step over several members' sessions, their rows batched together: per member, (b, V)."""
        requests = [StepRequest(member.key(r.session_id), r.token_ids) for member, reqs in parts for r in reqs]
        logits = self.step(requests)  # (sum b, V)
        sizes = [len(reqs) for _, reqs in parts]
        return list(torch.split(logits, sizes))


class AdapterMember:
    """One expert of a shared base: the Expert contract over its own namespace of the group's sessions."""

    def __init__(self, group: SharedBaseExpert, config: ExpertConfig, model_ref: str) -> None:
        self.shared_base = group
        self.config = config
        self.info = replace(group.info, name=config.name, model=model_ref, max_cached_tokens=config.max_cached_tokens)
        self._prefix = config.name + SEPARATOR

    def key(self, session_id: str) -> str:
        return self._prefix + session_id

    def step(self, requests: Sequence[StepRequest]) -> torch.Tensor:
        return self.shared_base.step_members([(self, requests)])[0]

    def score(self, session_id: str, token_ids: Sequence[int], num_positions: int) -> torch.Tensor:
        return self.shared_base.score(self.key(session_id), token_ids, num_positions)

    def extend(self, session_id: str, token_ids: Sequence[int], extensions: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.shared_base.extend(self.key(session_id), token_ids, extensions)

    def release(self, session_ids: Sequence[str]) -> None:
        self.shared_base.release([self.key(s) for s in session_ids])

    def describe(self) -> ExpertInfo:
        return self.info

    @property
    def tokenizer(self):
        return self.shared_base.tokenizer

    @property
    def model(self):
        return self.shared_base.model

    @property
    def device(self) -> torch.device:
        return self.shared_base.device

    @property
    def active_sessions(self) -> int:
        return sum(1 for e in self.shared_base.cache.sessions() if e.startswith(self._prefix))

    def cache_stats(self) -> dict[str, int]:
        return self.shared_base.cache_stats()

    def close(self) -> None:
        """The group is closed with its last member (nothing to free beyond garbage collection)."""


def base_key(config: ExpertConfig, model_path: str) -> tuple:
    """Experts with equal keys can share one loaded base."""
    return (model_path, config.gguf_file, config.dtype, config.device, config.decode, config.weights,
            config.batch_invariant, config.c_step_prompt_ids)


def load_local_experts(configs: Sequence[ExpertConfig], resolve_model: Callable[[str], str],
                       compile_cache_dir: Path | None = None) -> list[Expert]:
    """The in-process experts of `configs`, in order: members sharing a base load it once."""
    paths = [resolve_model(c.model) for c in configs]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for index, (config, path) in enumerate(zip(configs, paths)):
        if config.share_base:
            groups[base_key(config, path)].append(index)
    shared = [members for members in groups.values()
              if len(members) > 1 and any(configs[i].adapter is not None for i in members)]
    experts: list[Expert | None] = [None] * len(configs)
    for members in shared:
        group_configs = [configs[i] for i in members]
        adapters = [c.adapter for c in group_configs]
        group = load_shared_base(group_configs, paths[members[0]], adapters, compile_cache_dir)
        for i, member in zip(members, group.members):
            experts[i] = member
    for i, config in enumerate(configs):
        if experts[i] is None:
            experts[i] = LocalExpert.load(config, paths[i], compile_cache_dir)
    return experts  # type: ignore[return-value]


def load_shared_base(configs: Sequence[ExpertConfig], model_path: str, adapters: Sequence[str | None],
                     compile_cache_dir: Path | None = None) -> SharedBaseExpert:
    """Load the base once and install every member's adapter over it."""
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"experts sharing a base need distinct names: {names}")
    logger.info("loading experts %s over one base %s (%s on %s)", ", ".join(names), model_path, configs[0].dtype,
                configs[0].device)

    def load() -> SharedBaseExpert:
        model, tokenizer = load_model_and_tokenizer(configs[0].model_copy(update={"adapter": None}), model_path,
                                                    codes_folder(compile_cache_dir))
        group = SharedBaseExpert(configs, model, tokenizer, model_ref=model_path, adapters=adapters)
        group.warm_up()
        return group

    return run_on_compute_thread(load)
