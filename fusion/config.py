"""Configuration, read once at the edge (YAML → pydantic) and passed down explicitly.

A config names the experts, the default fusion spec, named weight profiles, default sampling
parameters and the service limits. Every validation error names the field and the bad value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fusion.errors import ConfigError, InvalidArgumentError, NotFoundError

DType = Literal["float32", "bfloat16", "float16", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExpertConfig(_Strict):
    """One expert: a causal LM loaded through transformers (a local folder, a hub id or `builtin:NAME`)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str = Field(min_length=1)
    gguf_file: str | None = None
    # A PEFT adapter (LoRA) over `model`: a local folder, a hub id or `builtin:NAME` (shipped).
    adapter: str | None = Field(default=None, min_length=1)
    # Experts naming the same base (model, GGUF file, dtype, device, decode, weights, batch_invariant,
    # c_step_prompt_ids) load it once and run their rows of a step as one batch, each row with its own
    # adapter (fusion.experts.shared_base). False: this expert loads its own copy with its adapter merged into the weights.
    share_base: bool = True
    dtype: DType = "bfloat16"
    device: str = "cpu"
    system_prompt: str | None = None
    chat_template: bool = True  # apply the tokenizer's chat template to prompts
    weight: float = 1.0
    # Remote replicas ("host:port"); empty means the expert runs in-process.
    addresses: list[str] = Field(default_factory=list)
    # Deadline of one remote decode step (every session adds one id); then its sessions fail over.
    # 10 s: the slowest decode step of the default 135M-360M models on a 2-core CPU is well under a
    # second; the rest covers a step queued on the replica behind one prefill chunk
    # (limits.prefill_chunk_tokens) of another stream. Prompt work gets prefill_timeout_s.
    step_timeout_s: float = Field(default=10.0, gt=0)
    # KV budget for this expert's sessions, in cached ids; each session's buffers also reserve spare
    # columns for appends (fusion.forward.kv_cache: up to 128 + 50%), which the budget does not count.
    max_cached_tokens: int = Field(default=65536, gt=0)
    # Keys and values of ended sessions kept for new sessions whose histories begin alike (a system prompt, a
    # conversation's earlier turns), in cached ids (fusion.experts.prefix_pool): a new session sharing at least 16
    # leading ids with a kept one computes only the rest. Counted apart from max_cached_tokens. 0: none kept.
    prefix_cache_tokens: int = Field(default=1024, ge=0)
    num_gpus: float = Field(default=0.0, ge=0.0)  # Ray Serve placement
    # The forward of a steady decode step (one new id per session; prefill and prompt chunks run
    # transformers' forward but with batch_invariant): "transformers" (the model's own eager forward, the
    # reference), "fast" (the project's step for the device: on CUDA the static-shape step over KV slots,
    # captured as CUDA graphs at load (fusion.forward.static_step); on a CPU one function over fused
    # projections (fusion.forward.llama), whose layers run in the C step with int4/int8 weights; Llama,
    # Mistral, Qwen2/3 models, Gemma 3 its own eager one, others fall back to "transformers"), "static" (the
    # static-shape step on any device: eager on a CPU, where it is tested).
    decode: Literal["transformers", "fast", "static"] = "fast"
    # The static step's KV slots (decode: fast on CUDA, or static): columns per slot (the longest history it
    # decodes; a longer one steps eagerly), and the share of the device's memory they take (capped by what
    # is free at load, as vLLM's gpu_memory_utilization), or a number of slots (one is scratch).
    kv_slot_tokens: int = Field(default=4096, gt=0)
    kv_memory_fraction: float = Field(default=0.25, gt=0.0, le=1.0)
    kv_slots: int | None = Field(default=None, ge=2)
    # How the decoder layers' projections are held (fusion.forward.quantized): "dense" (in `dtype`), "int8"
    # (8-bit codes, a scale per output row) or "int4" (4-bit codes, a scale and offset per 32 inputs,
    # GGUF Q4_1's recipe; the output head at 8 bits). Quantized weights run on CPU.
    weights: Literal["dense", "int8", "int4"] = "dense"
    # Every forward of this expert (a prompt, a prompt chunk, a history computed again after eviction or on
    # another replica) runs its ids one row each through the C decode step (`FastDecoder.prefill`), and
    # decode steps read no weight but the codes: an id's keys, values and logits then depend on the ids
    # before it alone, never on the batch, the chunking, prefix reuse or the replica, so a greedy stream
    # that fails over continues with the tokens it would have had. Needs the C step: weights int4 or int8,
    # decode: fast, a CPU, a Llama-family model. A prompt then costs more than with transformers' forward
    # (docs/performance.md).
    batch_invariant: bool = False
    # Where the C decode step runs this expert (as for batch_invariant), a forward whose ids number at most
    # this many in all (a step's new prompts together, or one history, cached ids included) runs them row by
    # row through it rather than through transformers' forward: at a few rows the forward's per-layer
    # operator dispatch costs more than the arithmetic, at many the dense product outruns the codes'
    # (docs/performance.md). 0: prompts always take the forward (unless batch_invariant).
    c_step_prompt_ids: int = Field(default=256, ge=0)

    @model_validator(mode="after")
    def _batch_invariant_has_the_c_step(self) -> ExpertConfig:
        if self.batch_invariant and (self.weights == "dense" or self.decode != "fast"
                                     or not self.device.startswith("cpu")):
            raise ValueError(f"expert {self.name!r}: batch_invariant needs the C decode step: weights int4 or int8, "
                             f"decode: fast and a cpu device (got weights: {self.weights}, decode: {self.decode}, "
                             f"device: {self.device})")
        return self

    @model_validator(mode="after")
    def _quantized_weights_run_on_a_cpu(self) -> ExpertConfig:
        if self.weights != "dense" and not self.device.startswith("cpu"):
            raise ValueError(f"expert {self.name!r}: weights: {self.weights} runs on a CPU (the project's C "
                             f"kernels); on {self.device} use weights: dense")
        return self

    @field_validator("decode", mode="before")
    @classmethod
    def _retired_compiled_decode(cls, value):
        if value == "compiled":
            raise ValueError("decode: compiled was retired: decode: fast captures CUDA graphs on CUDA itself "
                             "(the static step over KV slots)")
        return value

    @field_validator("weight")
    @classmethod
    def _finite_weight(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"weight must be finite, got {value}")
        return value

    # Deadline of a remote call carrying prompt work (a session new on the replica, or more than a
    # few new ids) and of Score calls: a long prompt's forward may take far longer than a decode step.
    prefill_timeout_s: float = Field(default=60.0, gt=0)
    # A replica is marked down after this many consecutive failed calls, or at once when it is
    # unreachable or fails the health check made after a timed-out call.
    failures_before_down: int = Field(default=3, ge=1)
    health_check_timeout_s: float = Field(default=2.0, gt=0)  # deadline of that health check


class FusionSpec(_Strict):
    """Which rule merges the experts' logits, its parameters, and where the weights come from."""

    rule: str = "weighted_logits"
    params: dict[str, Any] = Field(default_factory=dict)
    weights: dict[str, float] | None = None  # by expert name; overrides the experts' default weights
    profile: str | None = None  # a named profile from the config

    @model_validator(mode="after")
    def _one_weight_source(self) -> FusionSpec:
        if self.weights is not None and self.profile is not None:
            raise ValueError("give either weights or profile, not both")
        return self


@dataclass(frozen=True)
class SpecOverrides:
    """The fusion fields a request sets; None leaves the config's default (see `layer_spec`)."""

    rule: str | None = None
    params: dict[str, Any] | None = None
    weights: dict[str, float] | None = None
    profile: str | None = None

    @classmethod
    def of(cls, spec: FusionSpec) -> SpecOverrides:
        """Every field of a whole spec, as overrides."""
        return cls(spec.rule, dict(spec.params), dict(spec.weights) if spec.weights is not None else None,
                   spec.profile)


def layer_spec(default: FusionSpec, overrides: SpecOverrides | FusionSpec | None) -> FusionSpec:
    """A request's fusion spec over the config's default. The one merge rule of every front end:
    - rule: the request's, else the default's;
    - params: for the default's own rule, the default's params overridden key by key by the request's;
      for another rule, the request's params alone;
    - weights and profile: a request that sets either replaces the default's weight source.
    InvalidArgumentError names a bad field."""
    if overrides is None:
        return default
    if isinstance(overrides, FusionSpec):
        overrides = SpecOverrides.of(overrides)
    rule = overrides.rule if overrides.rule is not None else default.rule
    inherited = default.params if rule == default.rule else {}
    params = {**inherited, **(overrides.params or {})}
    weights, profile = overrides.weights, overrides.profile
    if weights is None and profile is None:
        weights, profile = default.weights, default.profile
    try:
        return FusionSpec(rule=rule, params=params, weights=weights, profile=profile)
    except ValidationError as err:
        raise InvalidArgumentError(f"spec: {format_validation_error(err)}") from None


FLOAT32_MAX = 3.4028234663852886e38
MIN_TEMPERATURE = 0.01  # smaller positive temperatures are raised to it (vLLM's rule): logits / 1e-40 overflow


MAX_LOGPROBS = 20  # top alternatives a token's log-probability may come with (OpenAI's bound)


class ToolFunction(_Strict):
    """A function the experts may call (OpenAI's `tools[].function`): its parameters a JSON Schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolCalls(_Strict):
    """Tool calls in the Hermes syntax (fusion.fuse.tool_calls): the functions the experts are shown, and
    which they may call: "auto" (the fused distribution decides; the grammar starts at the trigger),
    "required" (a call from the first token) or one function's name; `parallel`: several calls."""

    functions: list[ToolFunction] = Field(min_length=1)
    choice: str = "auto"
    parallel: bool = True

    @model_validator(mode="after")
    def _known_choice(self) -> "ToolCalls":
        names = [fn.name for fn in self.functions]
        if len(set(names)) != len(names):
            raise ValueError("functions: names must be distinct")
        if self.choice not in ("auto", "required", *names):
            raise ValueError(f"choice: {self.choice!r} is neither auto, required nor one of the functions {names}")
        return self

    def callable(self) -> list[ToolFunction]:
        """The functions a call may name."""
        return [fn for fn in self.functions if self.choice in ("auto", "required", fn.name)]


class StructuredOutput(_Strict):
    """Output constrained to a grammar, as one token mask on the fused distribution (fusion.fuse.structured):
    exactly one of a JSON Schema, any JSON object, a regular expression, a choice of strings, a
    grammar in Lark syntax (llguidance's dialect), or tool calls. vLLM's `structured_outputs` fields,
    and OpenAI's `tools`."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    tool_calls: ToolCalls | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutput":
        given = [name for name in ("json_schema", "regex", "choice", "grammar", "tool_calls")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, json_object, regex, choice, grammar, tool_calls; "
                             f"got {given or 'none'}")
        if self.choice is not None and any(not c for c in self.choice):
            raise ValueError("choice: the strings must not be empty")
        return self


class SamplingParams(_Strict):
    """Per-request sampling parameters (vLLM semantics; 0 disables top_k, 1.0 disables top_p).

    Every float must be finite in float32, the sampler's dtype; list lengths and ids are bounded by
    the service's `Limits` and vocabulary at admission (`FusionService.admit`)."""

    temperature: float = Field(default=0.0, ge=0.0)  # 0 = greedy
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    banned_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    max_tokens: int = Field(default=128, gt=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)  # top alternatives returned per token
    structured: StructuredOutput | None = None  # constrain the output to a grammar
    # Back a prompt that ends in the caller's text (a plain prompt, a continued final message) up over its
    # last token, the first token starting with that token's text (fusion.frontdoor.healing).
    token_healing: bool = False

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise ValueError(f"must be finite in float32, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        return MIN_TEMPERATURE if 0.0 < value < MIN_TEMPERATURE else value

    @field_validator("logit_bias")
    @classmethod
    def _bounded_bias(cls, value: dict[int, float]) -> dict[int, float]:
        # OpenAI's range: +-100 already forces or forbids a token; +inf would turn the row into NaN.
        for token_id, bias in value.items():
            if token_id < 0:
                raise ValueError(f"token id must be >= 0, got {token_id}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {token_id} must be in [-100, 100], got {bias}")
        return value

    @field_validator("banned_token_ids", "stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int]) -> list[int]:
        for token_id in value:
            if token_id < 0:
                raise ValueError(f"token id must be >= 0, got {token_id}")
        return value


class Limits(_Strict):
    """Explicit service limits; requests beyond them are refused, never queued without bound."""

    max_prompt_tokens: int = Field(default=4096, gt=0)
    max_tokens: int = Field(default=1024, gt=0)
    max_concurrent_sessions: int = Field(default=64, gt=0)
    max_batch_size: int = Field(default=16, gt=0)
    # How long an admitted request may wait for its first batch slot before it is refused (with a
    # retry time); a request preempted for another tenant's share waits without this bound.
    max_queue_wait_s: float = Field(default=30.0, gt=0)
    # How long one chunk of a Score may hold the compute thread while no request decodes: a request
    # arriving then waits at most about this before its prefill (while requests decode, a chunk
    # takes a fraction of a step instead). Longer chunks score a little faster alone.
    score_slice_s: float = Field(default=0.01, gt=0)
    # Prompt tokens (per expert) one decode step computes for joining sessions: a long prompt is
    # prefilled in chunks between the running streams' steps instead of stalling them.
    prefill_chunk_tokens: int = Field(default=512, gt=0)
    # Between the coordinator and its experts: sized for batched logits (B x V x 2 bytes).
    max_message_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # What a client may send the coordinator in one message; requests are small, so a few MiB.
    max_request_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # A caller's request id prefixes the session id in every expert call and in logs.
    max_request_id_chars: int = Field(default=128, gt=0)
    # Bounds on one request's fields, checked at admission before any tokenizing or decoding.
    max_prompt_bytes: int = Field(default=256 * 1024, gt=0)  # UTF-8 bytes of the prompt or all messages
    max_messages: int = Field(default=256, gt=0)
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_chars: int = Field(default=256, gt=0)  # per stop string
    # Bytes of a request's structured-output spec (schema, regex, choices or grammar), checked before
    # it is compiled; compiling stays within llguidance's own limits on grammar size and work per step.
    max_grammar_bytes: int = Field(default=64 * 1024, gt=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    max_logit_bias: int = Field(default=1024, ge=0)  # entries of logit_bias
    max_banned_token_ids: int = Field(default=4096, ge=0)
    max_score_tokens: int = Field(default=2048, gt=0)  # continuation tokens of one Score
    # With API keys: the fraction of max_concurrent_sessions one key may hold (at least 1 stream),
    # so one key never takes every slot while another waits.
    key_share: float = Field(default=0.5, gt=0, le=1)
    # Expert servers: Step and Score calls in flight at once (the gRPC server refuses beyond a few
    # more, for health, Info and Release), sessions waiting in the step queue, and sessions in one
    # Step call (a coordinator splits its calls to fit). Beyond them: RESOURCE_EXHAUSTED naming it.
    # A coordinator takes its streams plus max_concurrent_rpcs other calls.
    max_concurrent_rpcs: int = Field(default=128, gt=0)
    # Expert servers: a session not stepped for this long loses its KV cache (its coordinator is gone,
    # or it will re-prefill): no memory held, and no autoscaling load counted, for a dead coordinator.
    session_idle_s: float = Field(default=120.0, gt=0)
    # The HTTP API's edge: open connections (past it the longest idle one is closed), the time a
    # connection has to send a request's headers, to send its body, and to stay idle after a response.
    max_http_connections: int = Field(default=4096, gt=0)
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    http_keep_alive_s: float = Field(default=5.0, gt=0)
    # Bytes of large bodies (over 64 KiB) one key may have parsed per second: parsing holds the GIL,
    # so a flood of large bodies would stall every stream (a valid chat body is at most a few MB).
    http_parse_bytes_per_s: int = Field(default=4 * 1024 * 1024, gt=0)
    max_queued_steps: int = Field(default=1024, gt=0)
    max_sessions_per_step: int = Field(default=256, gt=0)


class TLSConfig(_Strict):
    """Certificate files (PEM) for TLS on every gRPC server and channel.

    Servers (coordinator and experts) present `cert_file`/`key_file`. Channels (clients → coordinator,
    coordinator → experts) trust `ca_file` (the system roots when unset). With `require_client_auth`
    an expert server accepts only callers presenting a certificate signed by `ca_file`, and the
    coordinator presents `client_cert_file`/`client_key_file` to its experts (mutual TLS).
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    require_client_auth: bool = False
    server_name: str | None = None  # the name checked in servers' certificates, if not the dialled host

    @model_validator(mode="after")
    def _pairs(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("give both cert_file and key_file, or neither")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("give both client_cert_file and client_key_file, or neither")
        if self.require_client_auth and self.ca_file is None:
            raise ValueError("require_client_auth needs ca_file (the CA that signs client certificates)")
        return self


class SecurityConfig(_Strict):
    """Transport security and authentication of both gRPC services.

    `plaintext` defaults to true so that configs written before this section keep working on
    loopback; a server serving plaintext on a non-loopback address logs a WARNING. A `tls` section
    switches every server and channel to TLS (plaintext then defaults to false; giving both
    `plaintext: true` and `tls` is an error). API keys (hashed, in `api_keys_file` or in the YAML
    text of the environment variable `api_keys_env`) are then required by the Fusion service. The
    Expert service accepts only the coordinator: by its client certificate (`tls.require_client_auth`)
    and/or a shared secret read from the environment variable `expert_secret_env` or `expert_secret_file`.
    """

    plaintext: bool = True
    tls: TLSConfig | None = None
    api_keys_file: str | None = None
    api_keys_env: str | None = None
    expert_secret_env: str | None = None
    expert_secret_file: str | None = None
    # Origins whose browser apps may call the HTTP API (CORS), e.g. ["https://app.example.com"].
    allowed_origins: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _tls_means_no_plaintext(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tls") is not None:
            if data.get("plaintext") is True:
                raise ValueError("give either plaintext: true or a tls section, not both")
            data = {**data, "plaintext": False}
        return data

    @model_validator(mode="after")
    def _explicit(self) -> SecurityConfig:
        if not self.plaintext and self.tls is None:
            raise ValueError("plaintext: false needs a tls section (cert_file, key_file, ca_file)")
        if self.expert_secret_env is not None and self.expert_secret_file is not None:
            raise ValueError("give either expert_secret_env or expert_secret_file, not both")
        if self.api_keys_file is not None and self.api_keys_env is not None:
            raise ValueError("give either api_keys_file or api_keys_env, not both")
        return self

    # The pepper of API key hashes (fusion.services.api_keys): an environment variable or a file; neither
    # means the documented default pepper.
    api_keys_pepper_env: str | None = None
    api_keys_pepper_file: str | None = None

    @model_validator(mode="after")
    def _one_pepper_source(self) -> SecurityConfig:
        if self.api_keys_pepper_env is not None and self.api_keys_pepper_file is not None:
            raise ValueError("give either api_keys_pepper_env or api_keys_pepper_file, not both")
        return self


# Keys an older config may still hold, and why each went (a clear refusal rather than "extra input").
RETIRED_KEYS = {"fusion_step": "retired: the route step runs eagerly (on a CPU its vocabulary passes and "
                               "head are C calls, faster than the compiled step was); remove the key"}


class FusionConfig(_Strict):
    experts: list[ExpertConfig] = Field(min_length=1)
    fusion: FusionSpec = Field(default_factory=FusionSpec)
    profiles: dict[str, dict[str, float]] = Field(default_factory=dict)
    # Router checkpoints by name; a `route` request picks one with `params.router` (never a path).
    # `auto` is reserved: the router trained for exactly these experts, in the model cache.
    routers: dict[str, str] = Field(default_factory=dict)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: Limits = Field(default_factory=Limits)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    # How experts' distributions meet: "auto" fuses token ids when every expert shares one tokenizer and
    # text (fusion.crosstok.step) when they differ; "text" fuses over text even for one tokenizer.
    alignment: Literal["auto", "text"] = "auto"
    # fusion.crosstok.step.CrossParams fields (top_k, min_path_prob, max_paths, depth) for text-level fusion.
    cross_tokenizer: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _no_retired_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in RETIRED_KEYS.items():
                if key in data:
                    raise ValueError(f"{key}: {why}")
        return data

    @field_validator("cross_tokenizer")
    @classmethod
    def _cross_params(cls, value: dict[str, float]) -> dict[str, float]:
        known = {"top_k": int, "min_path_prob": float, "max_paths": int, "depth": int}
        for name, v in value.items():
            if name not in known:
                raise ValueError(f"cross_tokenizer: unknown field {name!r}; known: {sorted(known)}")
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (known[name] is int and v < 1):
                raise ValueError(f"cross_tokenizer.{name}: must be a finite number >= {0 if known[name] is float else 1}")
            if name == "min_path_prob" and v >= 1:
                raise ValueError("cross_tokenizer.min_path_prob: must be in [0, 1)")
        return {k: known[k](v) for k, v in value.items()}

    @field_validator("routers")
    @classmethod
    def _router_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if name == "auto":
                raise ValueError("'auto' is reserved for the router trained for these experts")
            if not name or not all(c.isalnum() or c in "-_." for c in name):
                raise ValueError(f"router name {name!r}: use letters, digits, '-', '_' and '.'")
            if not path:
                raise ValueError(f"router {name!r}: give the checkpoint's path")
        return value

    @model_validator(mode="after")
    def _cross_check(self) -> FusionConfig:
        names = [e.name for e in self.experts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate expert names: {duplicates}")
        for profile, weights in self.profiles.items():
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(f"profile {profile!r} names unknown experts {unknown}; known: {names}")
        try:
            self.check_spec(self.fusion)
        except NotFoundError as err:
            raise ValueError(f"fusion: {err}") from None
        return self

    @property
    def expert_names(self) -> list[str]:
        return [e.name for e in self.experts]

    def expert(self, name: str) -> ExpertConfig:
        for expert in self.experts:
            if expert.name == name:
                return expert
        raise NotFoundError(f"unknown expert {name!r}; known: {self.expert_names}")

    def check_spec(self, spec: FusionSpec) -> None:
        """Raise NotFoundError if a spec names unknown experts, profiles or routers."""
        names = self.expert_names
        if spec.profile is not None and spec.profile not in self.profiles:
            raise NotFoundError(f"profile: unknown profile {spec.profile!r}; known: {sorted(self.profiles)}")
        if spec.weights is not None:
            unknown = sorted(set(spec.weights) - set(names))
            if unknown:
                raise NotFoundError(f"weights: unknown expert(s) {unknown}; known: {names}")
        router = spec.params.get("router") if spec.rule == "route" else None
        if router is not None and router != "auto" and router not in self.routers:
            raise NotFoundError(f"fusion.params.router: unknown router {router!r}; known: "
                                f"{['auto', *sorted(self.routers)]}")

    def weights_for(self, spec: FusionSpec) -> list[float]:
        """Resolve a spec's weights to one float per expert, in config order."""
        self.check_spec(spec)
        if spec.profile is not None:
            chosen = self.profiles[spec.profile]
        elif spec.weights is not None:
            chosen = spec.weights
        else:
            return [e.weight for e in self.experts]
        # Experts a profile or request leaves out take no part (weight 0).
        return [float(chosen.get(e.name, 0.0)) for e in self.experts]


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: `field.path: message (got value)`."""
    lines = []
    for problem in err.errors():
        if not problem["loc"]:  # the whole config's check: its message names the field (no value to echo)
            lines.append(problem["msg"].removeprefix("Value error, "))
            continue
        where = ".".join(str(p) for p in problem["loc"])
        got = problem.get("input")
        shown = repr(got)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"{where}: {problem['msg']} (got {shown})")
    return "; ".join(lines)


def parse_config(data: Any, *, source: str = "config") -> FusionConfig:
    try:
        return FusionConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {format_validation_error(err)}") from None


def load_config(path: str | Path) -> FusionConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return parse_config(data, source=str(path))


def parse_sampling(data: dict[str, Any], *, base: SamplingParams | None = None) -> SamplingParams:
    """Sampling params from a request dict layered over defaults; InvalidArgumentError names the field."""
    merged = (base.model_dump() if base is not None else {}) | data
    try:
        return SamplingParams.model_validate(merged)
    except ValidationError as err:
        raise InvalidArgumentError(format_validation_error(err)) from None
