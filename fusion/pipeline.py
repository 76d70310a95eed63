"""Text in, text out: a config's experts, their tokenizers and the engine behind one object.

This is what the CLI, the gRPC coordinator and the Ray Serve deployment share: it turns a prompt into
each expert's own prompt ids, resolves the fusion spec (rule, weights or profile) into a request,
streams tokens with text deltas and stop strings, and scores continuations.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from fusion.config import FusionConfig, FusionSpec, SamplingParams, parse_sampling
from fusion.engine import ErrorEvent, FusionEngine, GenerationRequest, TokenEvent
from fusion.errors import InvalidArgumentError, NotFoundError
from fusion.expert import Expert, LocalExpert
from fusion.rules import FusionRule, make_rule
from fusion.text import Message, TextSample, TextStream, encode_plain, encode_prompt, end_of_turn_id

logger = logging.getLogger(__name__)


@dataclass
class TextEvent:
    token: TokenEvent
    text: str  # the text this token made visible (may be empty while a character or stop is pending)
    finish_reason: str | None = None


@dataclass
class ScoreResult:
    token_ids: list[int]
    logprobs: list[float]

    @property
    def total_logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None


AUTO_ROUTER = "auto"  # `route` rule path: the router trained for exactly these experts, in the cache


class FusionPipeline:
    def __init__(self, config: FusionConfig, engine: FusionEngine, tokenizers: Sequence[Any],
                 cache_dir: Path | None = None) -> None:
        self.config = config
        self.engine = engine
        self.tokenizers = list(tokenizers)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._auto_router: Path | None = None
        self._rule_cache = lru_cache(maxsize=64)(self._make_rule)

    @classmethod
    def from_config(
        cls,
        config: FusionConfig,
        resolve_model: Callable[[str], str] = lambda ref: ref,
        experts: Sequence[Expert] | None = None,
        tokenizers: Sequence[Any] | None = None,
        cache_dir: Path | None = None,
        prepare_router: bool = True,
    ) -> FusionPipeline:
        """Load every expert in-process (the local build), unless experts/tokenizers are given. When the
        config's rule is `route` with `path: auto` and no router exists yet for these experts, one is
        trained now (once; about 8 minutes for the default trio on 2 CPU cores)."""
        if experts is None:
            loaded = [LocalExpert.load(e, resolve_model(e.model)) for e in config.experts]
            experts, tokenizers = loaded, [e.tokenizer for e in loaded]
        if tokenizers is None:
            raise ValueError("tokenizers are required with externally built experts")
        devices = {e.info.device for e in experts}
        device = devices.pop() if len(devices) == 1 else "cpu"
        pipeline = cls(config, FusionEngine(experts, config.limits, device=device), tokenizers, cache_dir)
        if prepare_router and pipeline.uses_auto_router:
            try:
                pipeline.prepare_router()
            except BaseException:
                pipeline.close()
                raise
        return pipeline

    @property
    def uses_auto_router(self) -> bool:
        fusion = self.config.fusion
        return fusion.rule == "route" and fusion.params.get("path") == AUTO_ROUTER

    @property
    def expert_names(self) -> list[str]:
        return self.engine.names

    def close(self) -> None:
        self.engine.close()

    # -- the router trained for these experts ----------------------------------------------------
    def auto_router_path(self) -> Path:
        """Where `path: auto` finds this trio's router: keyed by the experts' names and behaviour."""
        if self._auto_router is None:
            from fusion.assets import default_cache_dir
            from fusion.router import expert_fingerprint

            fingerprints = [expert_fingerprint(e) for e in self.engine.experts]
            key = hashlib.sha256(json.dumps([self.expert_names, fingerprints]).encode()).hexdigest()[:16]
            self._auto_router = (self.cache_dir or default_cache_dir()) / "routers" / f"router-{key}.pt"
        return self._auto_router

    def prepare_router(self, settings=None) -> Path:
        """Train this trio's `auto` router unless the cache has it (`RouterTrainSettings`, default: the
        built-in mix, 450 texts)."""
        path = self.auto_router_path()
        if not path.is_file():
            from fusion.router_training import RouterTrainSettings, train_router

            settings = settings or RouterTrainSettings(minutes=30.0, max_texts=450)
            logger.info("training the router for experts %s once (%d texts); it is cached at %s",
                        self.expert_names, settings.max_texts or 0, path)
            train_router(self, path, settings=settings)
        return path

    # -- requests -----------------------------------------------------------------------------
    def _make_rule(self, name: str, params_json: str) -> FusionRule:
        params = json.loads(params_json)
        if name == "route" and params.get("path") == AUTO_ROUTER:
            path = self.auto_router_path()
            if not path.is_file():
                raise InvalidArgumentError(
                    "fusion.params.path: no router has been trained for these experts yet; configure "
                    "`rule: route` with `path: auto` (trained at start-up) or run `fusion train-router`"
                )
            params["path"] = str(path)
        rule = make_rule(name, params, self.expert_names)
        rule.bind(self.engine.experts)
        return rule

    def resolve_spec(self, spec: FusionSpec | None) -> tuple[FusionRule, list[float]]:
        spec = spec or self.config.fusion
        if spec.profile is not None and spec.profile not in self.config.profiles:
            raise NotFoundError(f"profile: unknown profile {spec.profile!r}; known: {sorted(self.config.profiles)}")
        if spec.weights is not None:
            unknown = sorted(set(spec.weights) - set(self.expert_names))
            if unknown:
                raise NotFoundError(f"weights: unknown expert(s) {unknown}; known: {self.expert_names}")
        rule = self._rule_cache(spec.rule, json.dumps(spec.params, sort_keys=True))
        weights = self.config.weights_for(spec)
        try:
            rule.check_weights(weights)
        except ValueError as err:
            raise InvalidArgumentError(f"weights: {err}") from None
        return rule, weights

    def sampling(self, overrides: dict[str, Any] | SamplingParams | None = None) -> SamplingParams:
        if isinstance(overrides, SamplingParams):
            return overrides
        return parse_sampling(overrides or {}, base=self.config.sampling)

    def prompt_ids(self, prompt: str | Sequence[Message]) -> list[list[int]]:
        """The prompt as each expert expects it (its own chat template and system prompt)."""
        return [encode_prompt(tok, cfg, prompt) for tok, cfg in zip(self.tokenizers, self.config.experts)]

    def sample_ids(self, sample: TextSample | str, max_tokens: int | None = None
                   ) -> tuple[list[list[int]], list[int]]:
        """(one prompt per expert, continuation ids) for a text sample; see `TextSample`."""
        if isinstance(sample, str):
            sample = TextSample(sample)
        if sample.prompt is None:
            prompts = [encode_plain(tok, "\n", add_special_tokens=True) for tok in self.tokenizers]
        else:
            prompts = self.prompt_ids(sample.prompt)
        ids = encode_plain(self.tokenizers[0], sample.text, add_special_tokens=False)
        if sample.end_turn:
            ids.append(end_of_turn_id(self.tokenizers[0]))
        return prompts, ids[:max_tokens] if max_tokens is not None else ids

    def build_request(
        self,
        prompt: str | Sequence[Message],
        sampling: dict[str, Any] | SamplingParams | None = None,
        spec: FusionSpec | None = None,
        request_id: str | None = None,
    ) -> GenerationRequest:
        rule, weights = self.resolve_spec(spec)
        request = GenerationRequest(self.prompt_ids(prompt), self.sampling(sampling), rule, weights)
        if request_id:
            request.request_id = request_id
        self.engine.validate(request)
        return request

    # -- generation ---------------------------------------------------------------------------
    def text_stream(self, request: GenerationRequest) -> TextStream:
        return TextStream(self.tokenizers[0], request.sampling.stop)

    def stream(self, request: GenerationRequest) -> Iterator[TextEvent]:
        """Tokens with text deltas; ends at EOS, a stop id or string, or max_tokens."""
        text = self.text_stream(request)
        events = self.engine.generate(request)
        try:
            for event in events:
                delta = text.push(event.token_id)
                reason = "stop" if text.stopped else event.finish_reason
                if reason is not None:
                    delta += text.flush()
                yield TextEvent(event, delta, reason)
                if reason is not None:
                    return
        finally:
            events.close()

    def complete(self, prompt: str | Sequence[Message], sampling=None, spec: FusionSpec | None = None) -> Completion:
        result = Completion(text="")
        for event in self.stream(self.build_request(prompt, sampling, spec)):
            result.text += event.text
            result.token_ids.append(event.token.token_id)
            result.logprobs.append(event.token.logprob)
            result.events.append(event.token)
            result.finish_reason = event.finish_reason
        return result

    # -- scoring ------------------------------------------------------------------------------
    def score(self, prompt: str, continuation: str, spec: FusionSpec | None = None) -> ScoreResult:
        """Fused log-probabilities of `continuation` after `prompt`, plain text (no chat template)."""
        if not continuation:
            raise InvalidArgumentError("continuation: must not be empty")
        rule, weights = self.resolve_spec(spec)
        prompt_ids = [encode_plain(tok, prompt, add_special_tokens=True) for tok in self.tokenizers]
        if any(not p for p in prompt_ids):
            # A model without BOS has no context for the first continuation token.
            raise InvalidArgumentError("prompt: must not be empty for a tokenizer without a BOS token")
        continuation_ids = encode_plain(self.tokenizers[0], continuation, add_special_tokens=False)
        logprobs = self.engine.score(prompt_ids, continuation_ids, rule, weights)
        return ScoreResult(continuation_ids, logprobs)


__all__ = ["FusionPipeline", "TextEvent", "ScoreResult", "Completion", "ErrorEvent"]
