"""Loading an expert: its tokenizer and model through transformers (a local folder, a hub id or a GGUF
file), the config's adapter merged in and its weights quantized as the config says, and what names
them to the others: the tokenizer's fingerprint (experts fuse ids only when their tokenizers agree)
and the model's end-of-sequence ids. A coordinator of remote experts loads only the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from fusion.experts.adapter_merge import apply_adapter
from fusion.config import ExpertConfig
from fusion.errors import AssetError, ConfigError
from fusion.forward.quantized import packed_cache_file, quantize_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def check_device(config: ExpertConfig) -> torch.device:
    """The expert's device, or ConfigError naming the field where this machine has none such."""
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise ConfigError(f"experts.{config.name}.device: {config.device!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible"
            raise ConfigError(f"experts.{config.name}.device: {config.device!r}, but torch {torch.__version__} sees "
                              f"no CUDA device ({build}); use device: cpu, or a CUDA build of torch on a GPU machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"experts.{config.name}.device: {config.device!r}, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def load_model_and_tokenizer(config: ExpertConfig, model_path: str, codes_dir: Path | None = None):
    """Load through the real transformers path: a local folder, a hub id, or a GGUF file in a folder;
    with the config's PEFT `adapter` merged in, and its weights quantized as the config says (the codes
    kept under `codes_dir`, if given, for the next start)."""
    from transformers import AutoModelForCausalLM

    check_device(config)
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
    """Where quantized weights' codes are kept (fusion.forward.quantized): beside the compiled decode steps, as
    they too are made for this machine's CPU kernels."""
    return None if compile_cache_dir is None else Path(compile_cache_dir) / "weights"
