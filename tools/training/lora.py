"""Specialists as LoRA fine-tunes of a pretrained base (SmolLM2-135M-Instruct for the builtins).

The base stays frozen; peft injects rank-`r` adapters into every linear layer of every block and
only those train. The result is saved in peft's standard adapter format (`adapter_config.json` +
`adapter_model.safetensors`, a few MB), plus `fusion_adapter.json`: the recipe, seed, hashes of the
base weights and of the training data the stream drew, timings and the eval figures.

Because the adapter reads through the base's pretrained layers, it understands wordings it never
trained on far better than a model trained from scratch on the same templates.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fusion.models import staged_dir
from fusion.tools.training.loop import Batch, LoopSettings, train_loop

logger = logging.getLogger(__name__)

ADAPTER_MANIFEST = "fusion_adapter.json"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraRecipe:
    stream: Callable[[object, int], Callable[[int], Batch]]  # (tokenizer, seed) -> batches
    steps: int
    rank: int = 16
    alpha: int = 32
    loop: dict = field(default_factory=dict)  # LoopSettings overrides
    start: str | None = None  # the recipe whose finished adapter this one goes on training (same rank)


def sha256_of_files(folder: Path, pattern: str = "*.safetensors") -> str:
    """One SHA-256 over the sorted files of `folder` matching `pattern` (names and bytes)."""
    h = hashlib.sha256()
    for path in sorted(Path(folder).glob(pattern)):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class HashingStream:
    """Wraps a batch stream and hashes every batch it hands out: the data hash of the manifest."""

    def __init__(self, stream: Callable[[int], Batch]):
        self.stream = stream
        self.sha = hashlib.sha256()

    def __call__(self, batch_size: int) -> Batch:
        batch = self.stream(batch_size)
        for tensor in (batch.prefix_ids, batch.input_ids, batch.labels):
            if tensor is not None:
                self.sha.update(tensor.to(torch.int64).numpy().tobytes())
        return batch

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def train_lora(
    kind: str,
    recipe: LoraRecipe,
    out_dir: Path,
    *,
    base_dir: Path,
    seed: int = 0,
    steps: int | None = None,
    minutes: float | None = None,
    base_ref: str | None = None,
    evaluate: Callable[[object, object], dict] | None = None,
    device: str = "cpu",
    resume: bool = True,
    start: Path | None = None,
) -> Path:
    """Train a LoRA adapter for `kind` over the base at `base_dir`; save it (PEFT format) into `out_dir`.

    Deterministic given `seed` and `steps` on one machine. `base_ref` is the base the adapter names
    (`base_model_name_or_path`; default: the folder's name). `evaluate(model, tokenizer)` (optional) runs
    on the trained model and its figures go into the manifest. Training checkpoints into `checkpoint_of(out_dir)`
    and, with `resume`, goes on from a checkpoint found there; a run that ends before the recipe's steps (a
    `minutes` budget) leaves the checkpoint and saves nothing else: the next run goes on. `start`: the finished
    adapter of `recipe.start` that training begins from (its weights; a fresh optimizer).
    """
    if (start is None) != (recipe.start is None):
        raise ValueError(f"{kind}: the recipe starts from {recipe.start or 'the base'}, given start={start}")
    base_dir = Path(base_dir)
    steps = recipe.steps if steps is None else steps  # `minutes` only caps one run: the next one resumes
    if resume and already_trained(Path(out_dir), kind, recipe, steps, seed):
        logger.info("%s: %s already holds this recipe's %d steps with seed %d (--fresh trains it again)", kind,
                    out_dir, steps, seed)
        return Path(out_dir)
    torch.manual_seed(seed)
    peft_model, tokenizer = _lora_model(recipe, base_dir, base_ref, device, start)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    settings = LoopSettings(steps=steps, minutes=minutes, **recipe.loop)
    logger.info("training %s adapter (rank %d, %d trainable parameters): %s", kind, recipe.rank, trainable, settings)
    stream = HashingStream(recipe.stream(tokenizer, seed))
    checkpoint = checkpoint_of(Path(out_dir))
    if not resume and checkpoint.exists():
        checkpoint.unlink()
    # peft injects the adapters into the base model in place: the loop drives that model directly.
    result = train_loop(peft_model.base_model.model, stream, settings, seed=seed, checkpoint=checkpoint)
    if settings.steps is not None and result.steps < settings.steps:
        logger.info("%s: %d of %d steps trained; run it again to go on from %s", kind, result.steps,
                    settings.steps, checkpoint)
        return Path(out_dir)
    figures = evaluate(peft_model, tokenizer) if evaluate is not None else {}
    manifest = {
        "kind": kind,
        "format": "peft-lora",
        "recipe": {"rank": recipe.rank, "alpha": recipe.alpha, "target_modules": list(TARGET_MODULES),
                   "steps": result.steps, **asdict(settings)},
        "seed": seed,
        "base_model": base_ref or base_dir.name,
        "base_sha256": sha256_of_files(base_dir),
        "data_sha256": stream.hexdigest(),
        "trainable_parameters": trainable,
        "initial_loss": round(result.initial_loss, 6),
        "final_loss": round(result.final_loss, 6),
        "tokens": result.tokens,
        "train_seconds": {"gpu" if device.startswith("cuda") else "cpu": round(result.seconds, 1)},
        "trained_on": (torch.cuda.get_device_name(device) if device.startswith("cuda") else
                       f"{platform.machine()} {torch.get_num_threads()} threads") + f", torch {torch.__version__}",
        "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "eval": figures,
    }
    if start is not None:
        # The start's own draws and seed, so that both stages' training data can be checked by hash.
        before = json.loads((Path(start) / ADAPTER_MANIFEST).read_text())
        manifest["start"] = {"recipe": recipe.start, "adapter_sha256": sha256_of_files(start),
                             "seed": before["seed"], "steps": before["recipe"]["steps"],
                             "batch_size": before["recipe"]["batch_size"], "data_sha256": before["data_sha256"]}
    if result.resumed_at:
        manifest["resumed_at_steps"] = result.resumed_at
    peft_model.to("cpu", torch.bfloat16)  # shipped in bf16, the dtype experts run in: half the bytes
    with staged_dir(Path(out_dir), replace=True) as tmp:
        peft_model.save_pretrained(tmp)
        (tmp / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    checkpoint.unlink(missing_ok=True)
    logger.info("saved %s adapter to %s", kind, out_dir)
    return Path(out_dir)


def already_trained(out_dir: Path, kind: str, recipe: LoraRecipe, steps: int, seed: int) -> bool:
    """Whether `out_dir` holds a finished training of the `kind` recipe for `steps` steps with `seed` (no
    checkpoint beside it, a manifest of that kind, rank, steps and loop settings): a run that finished in an
    earlier session is shipped or measured as it is, not trained again."""
    path = Path(out_dir) / ADAPTER_MANIFEST
    if checkpoint_of(Path(out_dir)).exists() or not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    trained = manifest.get("recipe", {})
    return (not manifest.get("partial") and manifest.get("kind") == kind and manifest.get("seed") == seed
            and trained.get("steps") == steps
            and trained.get("rank") == recipe.rank and trained.get("alpha") == recipe.alpha
            and all(trained.get(k) == v for k, v in recipe.loop.items()))


def _lora_model(recipe: LoraRecipe, base_dir: Path, base_ref: str | None, device: str = "cpu",
                start: Path | None = None):
    """The base in float32 with the recipe's LoRA adapters injected (peft), and its tokenizer; the adapters
    hold the weights of the adapter folder `start` when given, else peft's initialisation."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).to(device)
    config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0,
                        target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = base_ref or Path(base_dir).name
    if start is not None:
        saved = json.loads((Path(start) / "adapter_config.json").read_text())
        if (saved["r"], saved["lora_alpha"]) != (recipe.rank, recipe.alpha):
            raise ValueError(f"{start} is a rank-{saved['r']} adapter; the recipe trains rank {recipe.rank}")
        state = {k: v.float() for k, v in load_file(str(Path(start) / "adapter_model.safetensors")).items()}
        loaded = set_peft_model_state_dict(peft_model, state)
        if loaded.unexpected_keys:
            raise ValueError(f"{start}: tensors the recipe's adapter lacks: {loaded.unexpected_keys[:3]}")
    return peft_model, tokenizer


def export_checkpoint(kind: str, recipe: LoraRecipe, out_dir: Path, dest: Path, *, base_dir: Path,
                      base_ref: str | None = None) -> Path:
    """An unfinished training's checkpoint (the one training into `out_dir` keeps) as an adapter folder at
    `dest`, to measure it with `fusion eval` while it trains on; its manifest says it is partial, at which
    step. Nothing ships from it."""
    checkpoint = checkpoint_of(Path(out_dir))
    if not checkpoint.exists():
        raise FileNotFoundError(f"no training checkpoint at {checkpoint}")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    peft_model, _ = _lora_model(recipe, Path(base_dir), base_ref)
    trained = [param for _, param in peft_model.base_model.model.named_parameters() if param.requires_grad]
    if len(trained) != len(state["parameters"]):
        raise ValueError(f"checkpoint {checkpoint} holds {len(state['parameters'])} tensors, the {kind} recipe "
                         f"trains {len(trained)}")
    with torch.no_grad():
        for param, saved in zip(trained, state["parameters"]):
            param.copy_(saved)
    manifest = {"kind": kind, "format": "peft-lora", "partial": True, "step": state["step"],
                "of_steps": recipe.steps, "seed": state["seed"], "train_seconds": round(state["seconds"], 1),
                "base_model": base_ref or Path(base_dir).name, "recent_loss": round(sum(state["recent"]) /
                                                                                     max(1, len(state["recent"])), 6)}
    peft_model.to("cpu", torch.bfloat16)
    with staged_dir(Path(dest), replace=True) as tmp:
        peft_model.save_pretrained(tmp)
        (tmp / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("exported %s's checkpoint at step %d to %s", kind, state["step"], dest)
    return Path(dest)


def checkpoint_of(out_dir: Path) -> Path:
    """Where training into `out_dir` keeps its checkpoint (beside it: the adapter folder is replaced whole)."""
    return out_dir.with_name(out_dir.name + ".checkpoint.pt")


def ship_adapter(trained: Path, dest: Path, *, command: str, base_pin: dict | None = None,
                 figures: dict | None = None) -> Path:
    """Copy a trained adapter folder to `dest` (the package's `fusion/adapters/NAME`), its manifest
    completed with the SHA-256 of each shipped file, the command that reproduces it, the pinned base
    (`base_pin`: the wheel it is fetched from) and eval figures (when given; else kept)."""
    trained, dest = Path(trained), Path(dest)
    manifest = json.loads((trained / ADAPTER_MANIFEST).read_text())
    with staged_dir(dest, replace=True) as tmp:
        files = {}
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            data = (trained / name).read_bytes()
            (tmp / name).write_bytes(data)
            files[name] = hashlib.sha256(data).hexdigest()
        manifest.update({"files": files, "command": command})
        if base_pin is not None:
            manifest["base_pin"] = base_pin
        if figures is not None:
            manifest["eval"] = figures
        (tmp / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("shipped %s as %s", trained, dest)
    return dest

