"""The one front door: every caller (Python, CLI, eval, bench, gRPC, HTTP, Ray) goes through a
`FusionService`.

A request names a prompt (text or chat messages), sampling overrides and fusion overrides. The
service alone
  1. layers the request over the config's defaults (`fusion.config.layer_spec`, one merge rule),
  2. admits it: formats each expert's prompt, builds the rule (loading a router, once, cached),
     resolves the weights and runs every check once, each before the work it bounds
     (`fusion.engine.admission`),
  3. streams `TextEvent`s from the continuous-batching `Scheduler` (`fusion.frontdoor.streams`: text
     deltas, stop strings, usage; the types are `fusion.frontdoor.types`),
and scores continuations and describes itself. Admission runs on the caller's thread; async callers
use `submit_async`/`score_async`, which run it in a worker thread, off their event loop.

Experts whose tokenizers differ fuse over text (`fusion.crosstok.step`): the service then decodes and
scores each request on the process's compute thread, one text piece per step (no continuous batching
yet), with the training-free rules; `route` needs experts of one tokenizer.

Loading never trains: a `route` rule with `router: auto` needs the router trained for these experts
(shipped with the project for the default trio, else made by `fusion train-router`); without it the
service refuses to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from fusion.engine.admission import is_token_ids
from fusion.compute import run_on_compute_thread, single_team
from fusion.config import (FusionConfig, FusionSpec, SamplingParams, SpecOverrides, ToolCalls, layer_spec,
                           parse_sampling)
from fusion.crosstok.step import CrossParams, CrossTokenizerFusion
from fusion.crosstok.decode import score_text
from fusion.engine.core import FusionEngine
from fusion.engine.types import ExpertAttribution, GenerationRequest, StepTimings, new_request_id
from fusion.errors import AssetError, ConfigError, FusionError, InvalidArgumentError
from fusion.experts.expert import Expert
from fusion.models import default_cache_dir, shipped_router
from fusion.frontdoor.healing import heal, ids_starting_with
from fusion.frontdoor.streams import CrossRequestStream, RequestStream, Settlement
from fusion.fuse.router import expert_fingerprint
from fusion.fuse.registry import known_rules, make_rule
from fusion.fuse.rules import FusionRule
from fusion.engine.scheduler import Scheduler
from fusion.frontdoor.types import (Completion, ExpertDescription, FusionRequest, PromptLogprobs, ScoreResult,
                                  ServiceDescription, TextEvent, Usage)
from fusion.experts.shared_base import load_local_experts
from fusion.crosstok.spelling import spelling_for, token_bytes_of
from fusion.fuse.structured import GrammarCompiler
from fusion.engine.tenancy import LOCAL, Tenant
from fusion.frontdoor.text import (Message, TextSample, TextStream, document_context, encode_pair, encode_plain, encode_prompt,
                         end_of_turn_id)

logger = logging.getLogger(__name__)

AUTO_ROUTER = "auto"
ROUTE_NEEDS_ONE_TOKENIZER = ("the route rule needs experts of one tokenizer (its router reads token ids); these "
                             "experts' tokenizers differ, so they fuse over text with weighted_logits, mixture, "
                             "confidence or logit_arithmetic")  # `route` rule path: the router trained for exactly these experts, in the cache
PREPARE_HINT = "run `fusion train-router` for these experts (the default trio's router ships with the project)"


class ScoreAbandoned(FusionError):
    """A score whose caller went away (cancelled, past its deadline) stops at its next chunk."""


# -- the service --------------------------------------------------------------------------------
class FusionService:
    def __init__(self, config: FusionConfig, engine: FusionEngine, tokenizers: Sequence[Any],
                 cache_dir: Path | None = None, *, require_router: bool = True) -> None:
        """`engine` runs `config.experts` in order (in-process or remote); `tokenizers` is each one's.
        With `require_router`, a configured `router: auto` router that is not trained yet is an
        AssetError naming the command that prepares it."""
        self.config = config
        self.engine = engine
        self.tokenizers = list(tokenizers)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._auto_router: Path | None = None
        self._auto_router_read: Path | None = None  # the last checkpoint `router: auto` was logged to read
        self._rules = lru_cache(maxsize=64)(self._built_rule)
        self._token_texts = lru_cache(maxsize=1 << 16)(self._decode_token)
        self._bytes_table: list[bytes] | None = None  # id -> its bytes (`token_bytes`)
        # the ids that begin with a healed token's bytes, per those bytes (a pass over the vocabulary each)
        self._ids_starting_with = lru_cache(maxsize=1024)(lambda prefix: ids_starting_with(self._token_table(), prefix))
        # Structured output's grammars, compiled over the experts' shared tokenizer (its view built on first use).
        self.grammars = GrammarCompiler(self.tokenizers[0], engine.vocab_size, tuple(sorted(engine.eos_token_ids)))
        self._scheduler: Scheduler | None = None
        self._admission_observers: list[Callable[[str, str, float], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        # Async callers' admissions and scores wait on pools of their own, so a flood of one never
        # delays the other (nor anything on the event loop's default executor).
        self._admission_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fusion-admit")
        self._score_pool = ThreadPoolExecutor(max_workers=max(2, min(64, config.limits.max_concurrent_sessions)),
                                              thread_name_prefix="fusion-score")
        self.cross: CrossTokenizerFusion | None = None
        if engine.mixed_tokenizers:  # fuse over text; each tokenizer's spelling is built once per process
            spellings = [spelling_for(tok, e.info.tokenizer_fingerprint, e.info.eos_token_ids)
                         for tok, e in zip(self.tokenizers, engine.experts)]
            self.cross = CrossTokenizerFusion(engine.experts, spellings, CrossParams(**config.cross_tokenizer))
            if config.fusion.rule == "route":
                raise ConfigError(f"fusion.rule: {ROUTE_NEEDS_ONE_TOKENIZER}")
        if require_router and self.uses_auto_router and not self.auto_router_checkpoint().is_file():
            raise AssetError(f"fusion.params.router: auto: no router is trained for experts {self.expert_names} "
                             f"yet ({self.auto_router_path()}); {PREPARE_HINT}")

    @classmethod
    def from_config(
        cls,
        config: FusionConfig,
        resolve_model: Callable[[str], str] = lambda ref: ref,
        experts: Sequence[Expert] | None = None,
        tokenizers: Sequence[Any] | None = None,
        cache_dir: Path | None = None,
        require_router: bool = True,
    ) -> FusionService:
        """Load every expert in-process (the local build), unless experts and tokenizers are given."""
        if experts is None:
            compile_cache = Path(cache_dir) / "compiled" if cache_dir is not None else None
            experts = load_local_experts(config.experts, resolve_model, compile_cache)
            tokenizers = [e.tokenizer for e in experts]
        if tokenizers is None:
            raise ValueError("tokenizers are required with externally built experts")
        devices = {e.info.device for e in experts}
        device = devices.pop() if len(devices) == 1 else "cpu"
        mixed = config.alignment == "text" or len({e.info.tokenizer_fingerprint for e in experts}) > 1
        engine = FusionEngine(experts, config.limits, device=device, mixed_tokenizers=mixed)
        try:  # on the compute thread: building it runs the experts (their fingerprints)
            return run_on_compute_thread(cls, config, engine, tokenizers, cache_dir, require_router=require_router)
        except BaseException:
            engine.close()
            raise

    @property
    def expert_names(self) -> list[str]:
        return self.engine.names

    @property
    def experts(self) -> list[Expert]:
        return list(self.engine.experts)

    @property
    def active(self) -> int:
        """Requests admitted and not finished (running or waiting for a batch slot)."""
        return self._scheduler.active if self._scheduler is not None else 0

    def add_step_observer(self, observer: Callable[[StepTimings], None]) -> None:
        """Call `observer` with every decode step's timings (on the stepping thread; keep it cheap)."""
        self.engine.step_observers.append(observer)

    def add_admission_observer(self, observer: Callable[[str, str, float], None]) -> None:
        """Call `observer(request id, tenant id, seconds waited)` as each request takes its first batch
        slot (on the stepping thread, under the scheduler's lock; keep it cheap)."""
        self._admission_observers.append(observer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.stop()
        self._admission_pool.shutdown(wait=False, cancel_futures=True)
        self._score_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # -- the router trained for these experts ----------------------------------------------------
    @property
    def uses_auto_router(self) -> bool:
        fusion = self.config.fusion
        return fusion.rule == "route" and AUTO_ROUTER in (fusion.params.get("router"), fusion.params.get("path"))

    def auto_router_checkpoint(self) -> Path:
        """The router `router: auto` reads: one trained here for these experts (`auto_router_path`), else
        the one shipped for exactly these config experts (builtin models and adapters), else the missing
        `auto_router_path`."""
        trained = self.auto_router_path()
        found = trained if trained.is_file() else (shipped_router(self.config.experts) or trained)
        if found != self._auto_router_read and found.is_file():  # one stat, only when it changes
            # said once: a router trained here shadows the shipped one, which figures must not miss
            logger.info("router: auto reads %s (%s)", found,
                        "trained here for these experts" if found == trained else "shipped with the project")
            self._auto_router_read = found
        return found

    def auto_router_path(self) -> Path:
        """Where `router: auto` finds a router trained here for these experts (`fusion train-router`
        writes it): keyed by the experts' names and behaviour."""
        if self._auto_router is None:
            fingerprints = [expert_fingerprint(e) for e in self.engine.experts]
            key = hashlib.sha256(json.dumps([self.expert_names, fingerprints]).encode()).hexdigest()[:16]
            self._auto_router = (self.cache_dir or default_cache_dir()) / "routers" / f"router-{key}.pt"
        return self._auto_router

    # -- admission ---------------------------------------------------------------------------------
    def _built_rule(self, name: str, params_json: str) -> FusionRule:
        """`_make_rule` where it is asked for (an admission thread), on that thread alone: a router's
        tensors must not start a second OpenMP team (fusion.compute), nor wait for a decode step."""
        with single_team():
            return self._make_rule(name, params_json)

    def _make_rule(self, name: str, params_json: str) -> FusionRule:
        params = json.loads(params_json)
        if name == "route" and self.cross is not None:
            raise InvalidArgumentError(f"rule: {ROUTE_NEEDS_ONE_TOKENIZER}")
        if name != "route":
            rule = make_rule(name, params, self.expert_names)
            rule.bind(self.engine.experts)
            return rule
        router = params.get("router", params.get("path"))
        params = self._router_params(params)
        try:
            rule = make_rule(name, params, self.expert_names)
            rule.bind(self.engine.experts)
        except ConfigError as err:  # unreadable, or trained for other experts: the detail stays in the log
            logger.error("router %r (%s) cannot be used: %s", router, params["path"], err)
            raise InvalidArgumentError(f"fusion.params.router: router {router!r} cannot be used with these experts "
                                       "(the server's log says why)") from None
        return rule

    def _router_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """`route` params with the router's name resolved to its checkpoint: `auto` (the router trained
        for these experts) or a name from the config's `routers`. Only the config names files."""
        params = dict(params)
        name = params.pop("router", None)
        path = params.pop("path", None)  # the config's legacy spelling (requests may not send it)
        if name is None and path is not None:
            name = AUTO_ROUTER if path == AUTO_ROUTER else None
        if name == AUTO_ROUTER:
            checkpoint = self.auto_router_checkpoint()
            if not checkpoint.is_file():
                raise InvalidArgumentError(f"fusion.params.router: no router is trained for these experts yet; "
                                           f"{PREPARE_HINT}")
        elif name is not None:
            checkpoint = Path(self.config.routers[name])  # known: FusionConfig.check_spec
        elif path is not None:
            checkpoint = Path(path)
        else:
            raise InvalidArgumentError(f"fusion.params.router: the route rule needs a router; known: {self.router_names}")
        return {**params, "path": str(checkpoint)}

    @property
    def router_names(self) -> list[str]:
        return [AUTO_ROUTER, *sorted(self.config.routers)]

    def spec(self, overrides: SpecOverrides | FusionSpec | None = None) -> FusionSpec:
        """The request's fusion spec over the config's default (`layer_spec`)."""
        if overrides is not None and overrides.params and overrides.params.get("path", AUTO_ROUTER) != AUTO_ROUTER:
            raise InvalidArgumentError(f"fusion.params.path: requests may not name files on the server; pick a "
                                       f"router by name with params.router (known: {self.router_names})")
        return layer_spec(self.config.fusion, overrides)

    def resolve_spec(self, overrides: SpecOverrides | FusionSpec | None = None) -> tuple[FusionRule, list[float]]:
        """The rule (built once per distinct rule and params) and one weight per expert."""
        spec = self.spec(overrides)
        self.config.check_spec(spec)  # unknown profile, expert or router: NotFoundError naming it
        rule = self._rules(spec.rule, json.dumps(spec.params, sort_keys=True))
        weights = self.config.weights_for(spec)
        self.engine.admission.weights(rule, weights)
        return rule, weights

    def sampling(self, overrides: Mapping[str, Any] | SamplingParams | None = None,
                 tenant: Tenant = LOCAL) -> SamplingParams:
        """The request's sampling fields over the config's defaults, field by field. A tenant's
        max_tokens caps a request that does not ask, and refuses one that asks for more (a retry
        could never succeed)."""
        if isinstance(overrides, SamplingParams):
            params, asked = overrides, "max_tokens" in overrides.model_fields_set
        else:
            data = dict(overrides or {})
            params, asked = parse_sampling(data, base=self.config.sampling), data.get("max_tokens") is not None
        cap = tenant.max_tokens
        if cap is not None and params.max_tokens > cap:
            if asked:
                raise InvalidArgumentError(f"max_tokens: {params.max_tokens} exceeds this API key's "
                                           f"max_tokens_per_request={cap}")
            params = params.model_copy(update={"max_tokens": cap})
        return params

    def prompt_ids(self, prompt: str | Sequence[Message], *, plain: bool = False,
                   tools: ToolCalls | None = None, continue_final_message: bool = False) -> list[list[int]]:
        """The prompt as each expert expects it (its own chat template and system prompt, the `tools` it
        may call, its last message continued rather than answered with `continue_final_message`); `plain`:
        the text as is, after each tokenizer's BOS."""
        if plain:
            if is_token_ids(prompt):  # ids of the experts' shared vocabulary, as sent (`Admission.prompt`)
                return [list(prompt) for _ in self.tokenizers]
            return [encode_plain(tok, prompt, add_special_tokens=True) for tok in self.tokenizers]
        functions = [fn.model_dump(exclude_none=True) for fn in tools.functions] if tools is not None else None
        syntax = self.grammars.tool_syntax  # the fused answer's: every expert is asked for calls in it
        return [encode_prompt(tok, cfg, prompt, functions, syntax, continue_final_message=continue_final_message)
                for tok, cfg in zip(self.tokenizers, self.config.experts)]

    def token_text(self, token_id: int) -> str:
        """One id's text on its own, special tokens included (the first expert's tokenizer: the experts
        share one); what OpenAI-style logprobs show per token. Cached."""
        return self._token_texts(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """One id's own bytes as its tokenizer spells them: a token holding part of a character (a byte
        of byte-level BPE, a byte-fallback piece) gives its bytes, not U+FFFD's; a special token, its
        text's. The table is built once, on first use."""
        table = self._token_table()
        raw = table[token_id] if 0 <= token_id < len(table) else b""
        return raw or self.token_text(token_id).encode("utf-8")

    def _token_table(self) -> list[bytes]:
        """id -> its bytes as the tokenizer spells them (b"" for special tokens; empty where spelling.py
        cannot read the decoder). Built once, on first use."""
        table = self._bytes_table  # read on every logprob entry: locked only while it is built
        if table is None:
            with self._lock:
                if self._bytes_table is None:
                    try:
                        self._bytes_table = token_bytes_of(self.tokenizers[0])
                    except ConfigError:  # a decoder spelling.py cannot read: the decoded text's bytes
                        self._bytes_table = []
                table = self._bytes_table
        return table

    def _decode_token(self, token_id: int) -> str:
        if token_id < 0:  # a text piece of experts with different tokenizers: no id of one vocabulary
            return ""
        return self.tokenizers[0].decode([token_id])

    def sample_ids(self, sample: TextSample | str, max_tokens: int | None = None
                   ) -> tuple[list[list[int]], list[int]]:
        """(one prompt per expert, continuation ids) for a text sample; see `TextSample`."""
        if isinstance(sample, str):
            sample = TextSample(sample)
        if sample.prompt is None:  # a text on its own (lm-evaluation-harness's rolling log-likelihood)
            prompts = [document_context(tok) for tok in self.tokenizers]
        else:
            prompts = self.prompt_ids(sample.prompt, continue_final_message=sample.continued)
        text = sample.text
        if sample.continued:  # as a healed request is decoded: its prompt's last token written again
            prompts, healing = heal(prompts, self._token_table(), self._ids_starting_with)
            text = (healing.text if healing is not None else "") + text
        ids = encode_plain(self.tokenizers[0], text, add_special_tokens=False)
        if sample.end_turn:
            ids.append(end_of_turn_id(self.tokenizers[0]))
        return prompts, ids[:max_tokens] if max_tokens is not None else ids

    def admit(self, request: FusionRequest) -> GenerationRequest:
        """Layer, format and validate a request once; the engine request it becomes. Every bound is
        checked before the work it guards (prompt size before tokenizing). Blocking (tokenizes, may load
        a router): async callers use `submit_async`. Its tensors (a bias row, a router) are built on the
        calling thread alone, never starting a second OpenMP team (fusion.compute)."""
        with single_team():
            return self._admit(request)

    def _admit(self, request: FusionRequest) -> GenerationRequest:
        admission = self.engine.admission  # every check (fusion.engine.admission), each before the work it bounds
        admission.prompt(request.prompt, plain=request.plain, continue_final_message=request.continue_final_message)
        if request.request_id:
            admission.request_id(request.request_id)
        rule, weights = self.resolve_spec(request.spec)
        sampling = self.sampling(request.sampling, request.tenant)
        admission.sampling(sampling)
        tools = sampling.structured.tool_calls if sampling.structured is not None else None
        prompt_ids = self.prompt_ids(request.prompt, plain=request.plain, tools=tools,
                                     continue_final_message=request.continue_final_message)
        healing = None
        if sampling.token_healing and (request.plain or request.continue_final_message):  # the caller's text ends it
            prompt_ids, healing = heal(prompt_ids, self._token_table(), self._ids_starting_with)
        admission.prompt_ids(prompt_ids, rule, weights, sampling.max_tokens)
        generation = GenerationRequest(prompt_ids, sampling, rule, weights, tenant=request.tenant)
        if healing is not None:
            generation.healed_text = healing.text
            generation.first_token_mask = healing.first_token_mask(self.engine.vocab_size, self.engine.device)
        if sampling.structured is not None:
            generation.grammar = self.grammars.matcher(sampling.structured)
        if request.request_id:  # session ids must be unique on every expert: a caller's id only prefixes ours
            generation.request_id = f"{request.request_id}/{new_request_id()}"
        return generation if self.cross is not None else self.engine.prepare(generation)

    # -- generation --------------------------------------------------------------------------------
    def _running_scheduler(self) -> Scheduler:
        with self._lock:
            if self._closed:
                raise RuntimeError("the service is closed")
            if self._scheduler is None:
                self._scheduler = Scheduler(self.engine, admission_observers=self._admission_observers).start()
            return self._scheduler

    def _open(self, request: FusionRequest, generation: GenerationRequest,
              on_start: Callable[[str, int], None] | None = None) -> RequestStream | CrossRequestStream:
        """Reserve the request's tokens on its tenant's quota (prompt + max_tokens, before any work;
        settled with what it used when it ends), then start it; `on_start(request id, prompt tokens)` runs
        just before anything can step it."""
        prompt_tokens = len(generation.prompt_ids[0])
        settlement = Settlement.reserve(request.tenant, prompt_tokens + generation.sampling.max_tokens, prompt_tokens)
        try:
            if on_start is not None:
                on_start(generation.request_id, prompt_tokens)
            if self.cross is not None:
                return CrossRequestStream(self.cross, self.expert_names, generation, request.plain, settlement)
            handle = self._running_scheduler().submit(generation)
        except BaseException:
            settlement.close()
            raise
        text = TextStream.after(self.tokenizers[0], generation.sampling.stop, generation.prompt_ids[0],
                                generation.healed_text)
        return RequestStream(generation, handle, text, settlement)

    def submit(self, request: FusionRequest) -> RequestStream | CrossRequestStream:
        """Admit a request (or raise InvalidArgument / NotFound / ResourceExhausted) and stream it."""
        return self._open(request, self.admit(request))

    async def submit_async(self, request: FusionRequest, on_start: Callable[[str, int], None] | None = None
                           ) -> RequestStream | CrossRequestStream:
        """`submit` with admission on the admission pool, off the caller's event loop (and apart from
        the default executor, where scoring waits). `on_start(request id, prompt tokens)` runs once the
        request is admitted, before it is queued (a trace registered there sees every step of it)."""
        loop = asyncio.get_running_loop()
        generation = await loop.run_in_executor(self._admission_pool, self.admit, request)
        return self._open(request, generation, on_start)

    def complete(self, prompt: str | Sequence[Message], sampling: Mapping[str, Any] | SamplingParams | None = None,
                 spec: SpecOverrides | FusionSpec | None = None) -> Completion:
        """The whole answer to one request (a convenience over `submit`)."""
        result = Completion(text="")
        for event in self.submit(FusionRequest(prompt, sampling, spec)):
            result.text += event.text
            result.token_ids.append(event.token.token_id)
            result.logprobs.append(event.token.logprob)
            result.events.append(event.token)
            result.finish_reason = event.finish_reason
            result.usage = event.usage
        return result

    # -- scoring -----------------------------------------------------------------------------------
    def score(self, prompt: str, continuation: str, spec: SpecOverrides | FusionSpec | None = None,
              tenant: Tenant = LOCAL, abandoned: threading.Event | None = None) -> ScoreResult:
        """Fused log-probabilities of `continuation` after `prompt`, plain text (no chat template).

        The lm-evaluation-harness convention (`fusion.frontdoor.text.encode_pair`): the prompt's trailing
        whitespace moves to the continuation, prompt + continuation are encoded together and the
        tokens after the prompt's own encoding are scored; `ScoreResult.text` is the scored text."""
        admission = self.engine.admission
        admission.score_texts(prompt, continuation)
        rule, weights = self.resolve_spec(spec)
        if self.cross is not None:
            return self._score_text(prompt, continuation, rule, weights, tenant)
        prompt_ids, continuation_ids, scored = self.pair_ids(prompt, continuation)
        admission.score_tokens(continuation_ids)
        tokens = len(prompt_ids[0]) + len(continuation_ids)
        with self._reserved(tenant, tokens):
            logprobs = self.engine.score(prompt_ids, continuation_ids, rule, weights,
                                         run_chunk=self._chunk_runner(tenant, abandoned))
        return ScoreResult(continuation_ids, logprobs, len(prompt_ids[0]), scored)

    def _chunk_runner(self, tenant: Tenant, abandoned: threading.Event | None):
        """How a score's chunks run: each between decode steps, in the tenant's fair turn; none once the
        caller went away (its sessions are then freed)."""
        scheduler = self._running_scheduler()

        def run_chunk(job):
            if abandoned is not None and abandoned.is_set():
                raise ScoreAbandoned("the caller abandoned the score")
            return scheduler.run_between_steps(tenant, job)

        return run_chunk

    async def _on_score_pool(self, fn: Callable, *args):
        """`fn(*args, abandoned)` on the scoring pool, off the caller's event loop; a cancelled caller sets
        `abandoned`, so the work stops at its next chunk."""
        loop = asyncio.get_running_loop()
        abandoned = threading.Event()
        try:
            return await loop.run_in_executor(self._score_pool, fn, *args, abandoned)
        except asyncio.CancelledError:
            abandoned.set()
            raise

    @contextlib.contextmanager
    def _reserved(self, tenant: Tenant, tokens: int) -> Iterator[None]:
        """`tokens` held on the tenant's quota for the work within, then settled as used (work that
        failed half-way was still done)."""
        settlement = Settlement.reserve(tenant, tokens, tokens)
        try:
            yield
        finally:
            settlement.close()

    def _score_text(self, prompt: str, continuation: str, rule: FusionRule, weights: list[float],
                    tenant: Tenant = LOCAL) -> ScoreResult:
        """Experts of different tokenizers: the continuation's text pieces after the plain prompt, whose
        last id is held back so that it may merge with the continuation as each expert would spell it."""
        self.engine.admission.score_text_bytes(continuation)
        prompt_ids = [encode_plain(tok, prompt, add_special_tokens=True) for tok in self.tokenizers]
        with self._reserved(tenant, len(prompt_ids[0]) + len(continuation.encode("utf-8"))):
            scored = run_on_compute_thread(score_text, self.cross, prompt_ids, continuation.encode("utf-8"),
                                           [(rule, weights)], hold_back_prompt=True)
        pieces = [p.decode("utf-8", "replace") for p in scored.pieces if p is not None]
        return ScoreResult([], scored.logprobs[0], len(prompt_ids[0]), continuation, pieces)

    def score_texts(self, samples: Sequence[TextSample | str | tuple[str, str]],
                    specs: Sequence[SpecOverrides | FusionSpec | None]) -> tuple[list[float], list[float | None], int]:
        """Experts of different tokenizers: the total natural-log probability of the samples' texts under
        each spec, each expert's own (text level; None: no spec reads it), and the texts' UTF-8 bytes. A
        sample with a chat prompt is scored after each expert's formatted prompt; a plain text, after
        its document context (the BOS); a (prompt, continuation) pair, the continuation after the plain
        prompt (as `score`). `end_turn` scores the end of the text too."""
        if self.cross is None:
            raise InvalidArgumentError("score_texts: the experts share a tokenizer; score token ids instead")
        resolved = [self.resolve_spec(s) for s in specs]
        totals, experts, num_bytes = [0.0] * len(specs), [None] * len(self.expert_names), 0
        for sample in samples:
            hold_back, end = False, False
            if isinstance(sample, tuple):
                prompts = [encode_plain(tok, sample[0], add_special_tokens=True) for tok in self.tokenizers]
                text, hold_back = sample[1].encode("utf-8"), True
            else:
                sample = TextSample(sample) if isinstance(sample, str) else sample
                if sample.continued:
                    raise InvalidArgumentError("score_texts: a continued sample is healed over a token of one "
                                               "vocabulary; not available when the experts' tokenizers differ")
                if sample.prompt is None:
                    prompts = [document_context(tok) for tok in self.tokenizers]
                else:
                    prompts = self.prompt_ids(sample.prompt)
                text, end = sample.text.encode("utf-8"), sample.end_turn
            scored = run_on_compute_thread(score_text, self.cross, prompts, text, resolved, end=end,
                                           hold_back_prompt=hold_back)
            for i, logprobs in enumerate(scored.logprobs):
                totals[i] += sum(logprobs)
            for i, logprobs in enumerate(scored.expert_logprobs):
                if logprobs is not None:
                    experts[i] = (experts[i] or 0.0) + sum(logprobs)
            num_bytes += len(text)
        return totals, experts, num_bytes

    def pair_ids(self, prompt: str, continuation: str) -> tuple[list[list[int]], list[int], str]:
        """(one prompt per expert, continuation ids, scored text) of a plain prompt and continuation by
        lm-evaluation-harness's rule (`fusion.frontdoor.text.encode_pair`); the continuation ids are the first
        expert's (the experts share one vocabulary)."""
        pairs = [encode_pair(tok, prompt, continuation) for tok in self.tokenizers]
        _, continuation_ids, scored = pairs[0]
        return [context for context, _, _ in pairs], continuation_ids, scored

    def prompt_logprobs(self, prompt: str | Sequence[int], top: int = 0, tenant: Tenant = LOCAL,
                        abandoned: threading.Event | None = None) -> PromptLogprobs:
        """The fused log-probability of every token of a plain prompt after the tokens before it (the first
        has none), with the `top` likeliest alternatives at each: what OpenAI's `echo` with `logprobs`
        and vLLM's `prompt_logprobs` return, and what lm-evaluation-harness's `local-completions` reads
        for log-likelihood tasks. `prompt`: text (encoded as a completion's prompt is) or token ids of
        the experts' shared vocabulary. Scored like `score`, in chunks between decode steps."""
        admission = self.engine.admission
        admission.prompt_logprobs(prompt, top)
        ids = self.prompt_ids(prompt, plain=True)[0]
        admission.prompt_tokens(ids)
        if len(ids) < 2:
            return PromptLogprobs(ids, [None] * len(ids), [None] * len(ids), [None] * len(ids))
        rule, weights = self.resolve_spec(None)
        alternatives: list[tuple[list[int], list[float], int]] = []
        with self._reserved(tenant, len(ids)):
            logprobs = self.engine.score([ids[:1]] * len(self.engine.experts), ids[1:], rule, weights,
                                         run_chunk=self._chunk_runner(tenant, abandoned), alternatives=alternatives,
                                         top=max(top, 1))
        return PromptLogprobs(ids, [None, *logprobs],
                              [None, *((i, v) for i, v, _ in alternatives)] if top else [None] * len(ids),
                              [None, *(r for _, _, r in alternatives)])

    async def prompt_logprobs_async(self, prompt: str | Sequence[int], top: int = 0,
                                    tenant: Tenant = LOCAL) -> PromptLogprobs:
        """`prompt_logprobs` on the scoring pool, off the caller's event loop."""
        return await self._on_score_pool(self.prompt_logprobs, prompt, top, tenant)

    async def score_async(self, prompt: str, continuation: str,
                          spec: SpecOverrides | FusionSpec | None = None, tenant: Tenant = LOCAL) -> ScoreResult:
        """`score` on the scoring pool, off the caller's event loop; its chunks take the tenant's turns
        between decode steps."""
        return await self._on_score_pool(self.score, prompt, continuation, spec, tenant)

    # -- description -------------------------------------------------------------------------------
    def describe(self) -> ServiceDescription:
        experts = []
        for expert, expert_config in zip(self.engine.experts, self.config.experts):
            experts.append(ExpertDescription(
                info=expert.describe(), default_weight=expert_config.weight, addresses=list(expert_config.addresses),
                active_sessions=expert.active_sessions,
            ))
        return ServiceDescription(
            experts=experts,
            rules={name: tuple(getattr(factory, "param_names", ())) for name, factory in sorted(known_rules().items())},
            profiles={name: dict(weights) for name, weights in sorted(self.config.profiles.items())},
            default_spec=self.config.fusion,
            default_sampling=self.config.sampling,
            limits=self.config.limits,
            active_requests=self.active,
        )


__all__ = [  # the front door and the types it takes and gives (defined in fusion.frontdoor.types)
    "FusionService", "FusionRequest", "RequestStream", "CrossRequestStream", "TextEvent", "Usage", "ScoreResult",
    "Completion", "PromptLogprobs", "ServiceDescription", "ExpertDescription", "ExpertAttribution", "AUTO_ROUTER",
]
