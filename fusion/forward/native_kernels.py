"""The project's own CPU kernels for quantized products of a few rows (fusion/forward/kernels/quantized_mm.c) and the
decode step's layers (fusion/forward/kernels/decoder_step.c), built with the machine's C compiler on first use and
loaded through ctypes.

Why our own: a decode step multiplies each weight matrix by a few rows, and torch's 4-bit kernel converts
every weight to float before multiplying. These kernels multiply integers, as llama.cpp's CPU kernels do:
for 4-bit weights each group of 32 activations becomes its own scale and codes of about 15 bits, held as two
bytes, multiplied by AVX2's byte multiply-add with eight outputs a vector; a group without outliers keeps one
byte a code (as llama.cpp's blocks all do; one byte everywhere moved SmolLM2's next-token distribution about
ten times as far from bf16's, docs/performance.md), and `FUSION_INT4_COARSE_SPREAD` sets which groups do; for
8-bit weights each row becomes int16 codes with one scale. A plain C loop runs where the compiler does not
target AVX2.

The build is one translation unit, about a second with gcc; the library is kept under the cache folder, named by
the source's hash, the compiler and the CPU, so a second start loads it. Where no compiler is found, the
build fails, or `FUSION_NATIVE_KERNELS=0` is set, `library()` is None and the projections keep torch's
kernels (fusion/forward/quantized.py). The steps call the library directly, skipping torch's dispatcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).with_name("kernels")
# One translation unit (library.c) of the products, the decode step's layers and the route rule's passes.
SOURCE = KERNELS_DIR / "library.c"
SOURCES = (KERNELS_DIR / "quantized_mm.c", KERNELS_DIR / "decoder_step.c", KERNELS_DIR / "logit_rows.c", SOURCE)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
ENV_SWITCH = "FUSION_NATIVE_KERNELS"
# Flags added after FLAGS, for builds made to check the kernels (a sanitizer's, say; the tests run one).
EXTRA_FLAGS_ENV = "FUSION_KERNEL_CFLAGS"


def build_flags() -> tuple[str, ...]:
    return (*FLAGS, *shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def _cache_dir() -> Path:
    from fusion.models import default_cache_dir

    return Path(default_cache_dir()) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _machine_signature() -> str:
    """What the library's machine code depends on besides its source: the CPU's model and features."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    import platform

    return "\n".join(wanted) or platform.processor() or platform.machine()


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # concurrent builders each write a whole file


def declare_products(lib: ctypes.CDLL) -> None:
    """The signatures of a built library's products (`fusion_int4_mm`, `fusion_int8_mm`): x, rows, k, codes,
    params, n, out, is_bf16, threads -> 0, or -1 when out of memory."""
    for function in (lib.fusion_int4_mm, lib.fusion_int8_mm):
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        function.restype = ctypes.c_int


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot be had (module docstring)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler found: quantized products use torch's kernels")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        digest = hashlib.sha256()
        flags = build_flags()
        parts = (*(path.read_bytes() for path in SOURCES), version.encode(), " ".join(flags).encode(),
                 _machine_signature().encode())
        for part in parts:
            digest.update(part)
        target = _cache_dir() / f"kernels-{digest.hexdigest()[:16]}.so"
        if not target.exists():
            started = time.perf_counter()
            _build(compiler, flags, target)
            logger.info("built the quantized-product kernels in %.1f s: %s", time.perf_counter() - started, target)
        # torch is imported first, so the library's OpenMP calls use the runtime torch already loaded.
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        logger.warning("quantized products use torch's kernels: the project's own could not be built (%s)", err)
        return None
    declare(lib)
    return lib


def declare(lib: ctypes.CDLL) -> None:
    """Every signature of a built library (`declare_products`' and the step's, the rule's passes', the
    clocks'), and the int4 products' coarse spread this process runs with."""
    declare_products(lib)
    lib.fusion_decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_void_p]
    lib.fusion_decode_layers.restype = ctypes.c_int
    lib.fusion_logit_statistics.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                                            ctypes.c_int, *[ctypes.c_void_p] * 5]
    lib.fusion_logit_statistics.restype = None
    lib.fusion_mixture.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.fusion_mixture.restype = None
    lib.fusion_router_head.argtypes = [ctypes.c_void_p, *[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_int,
                                       *[ctypes.c_void_p] * 3]
    lib.fusion_router_head.restype = ctypes.c_int
    lib.fusion_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                                    ctypes.c_void_p]
    lib.fusion_rms_norm.restype = None
    lib.fusion_step_clocks.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.fusion_step_clocks.restype = ctypes.c_int64
    lib.fusion_set_coarse_spread.argtypes = [ctypes.c_int]
    lib.fusion_set_coarse_spread(_coarse_spread)


@contextlib.contextmanager
def coarse_spread(spread: int) -> Iterator[None]:
    """Within the block, the int4 products keep a group of activations at one byte a code when its max|x| is
    at most `spread` times its mean |x| (0: never; the default is COARSE_SPREAD), in the kernels and in
    `grouped_activations`. For comparisons of two steps whose float sums differ in their last bits: at one
    byte a code such a difference can round a code a whole step apart."""
    global _coarse_spread
    previous, _coarse_spread = _coarse_spread, spread
    _apply_spread_if_loaded()  # (a library loaded later reads `_coarse_spread` itself)
    try:
        yield
    finally:
        _coarse_spread = previous
        _apply_spread_if_loaded()


def _apply_spread_if_loaded() -> None:
    if library.cache_info().currsize > 0 and library() is not None:
        library().fusion_set_coarse_spread(_coarse_spread)


def available() -> bool:
    return library() is not None


# --- the C boundary: every tensor a kernel reads or writes is checked before the call ----------------
# The C code trusts its arguments (a wrong shape reads or writes past a buffer), so each entry point checks
# here what the C takes: the device, the dtype, the shape (sizes the kernel derives from others included)
# and a dense layout. Cheap next to any kernel call (microseconds).

def check_tensor(function: str, name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...],
                 shape: tuple[int | None, ...], contiguous: bool = True) -> None:
    """Raise a ValueError naming `function`'s argument `name` unless `tensor` is a CPU tensor of one of
    `dtypes`, of `shape` (None: any size on that axis), and contiguous where asked."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{function}: {name} must be a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{function}: {name} must be on the CPU, got {tensor.device}")
    if tensor.dtype not in dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{function}: {name} must be {wanted}, got {str(tensor.dtype).removeprefix('torch.')}")
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        sizes = ["*" if size is None else str(size) for size in shape]
        wanted = f"({sizes[0]},)" if len(sizes) == 1 else "(" + ", ".join(sizes) + ")"
        raise ValueError(f"{function}: {name} must have shape {wanted}, got {tuple(tensor.shape)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{function}: {name} must be contiguous, got strides {tensor.stride()}")


def _check_product(function_name: str, rows: torch.Tensor, codes: torch.Tensor, params: torch.Tensor) -> int:
    """The product's arguments as `fusion_int4_mm` / `fusion_int8_mm` read them; its output width N."""
    check_tensor(function_name, "rows", rows, (torch.float32, torch.bfloat16), (None, None))
    k = rows.shape[1]
    if function_name == "fusion_int4_mm":
        if k % 32:
            raise ValueError(f"{function_name}: rows' width must be a multiple of 32 (the groups), got {k}")
        check_tensor(function_name, "nibbles", codes, (torch.uint8,), (None, 4 * k))
        check_tensor(function_name, "scale_bias", params, (torch.float16,), (codes.shape[0], k // 32, 2, OUT_BLOCK))
        return codes.shape[0] * OUT_BLOCK
    check_tensor(function_name, "codes", codes, (torch.int8,), (None, k))
    check_tensor(function_name, "scales", params, (torch.float32,), (codes.shape[0],))
    return codes.shape[0]


def _product(function_name: str, rows: torch.Tensor, codes: torch.Tensor, params: torch.Tensor,
             out_features: int) -> torch.Tensor:
    """rows (M, K), contiguous -> (M, N) in rows' dtype (the kernels read float32 and bfloat16; other
    dtypes go through float32)."""
    if rows.dtype not in (torch.float32, torch.bfloat16):
        return _product(function_name, rows.float(), codes, params, out_features).to(rows.dtype)
    lib = library()
    if lib is None:
        raise RuntimeError("the project's quantized kernels are not available")
    outputs = _check_product(function_name, rows, codes, params)
    if outputs != out_features:
        raise ValueError(f"{function_name}: the weight has {outputs} outputs, not {out_features}")
    out = torch.empty(rows.shape[0], out_features, dtype=rows.dtype)
    status = getattr(lib, function_name)(rows.data_ptr(), rows.shape[0], rows.shape[1], codes.data_ptr(),
                                         params.data_ptr(), out_features, out.data_ptr(),
                                         int(rows.dtype == torch.bfloat16), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"{function_name}: could not allocate the activations' buffers")
    return out


def int4_mm(rows: torch.Tensor, nibbles: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ the int4 weight (N, K) whose codes are `nibbles` (N/8, 4K) uint8 (`pack_nibbles`) and
    whose per-group scales and biases are `scale_bias` (N/8, K/32, 2, 8) float16 (`pack_scale_bias`) -> (M, N)."""
    if scale_bias.dtype != torch.float16:
        raise TypeError(f"int4_mm: scale_bias must be float16, got {scale_bias.dtype}")
    return _product("fusion_int4_mm", rows, nibbles, scale_bias, nibbles.shape[0] * OUT_BLOCK)


def int8_mm(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ (codes (N, K) int8 · scales (N,) float32 per row).T -> (M, N)."""
    return _product("fusion_int8_mm", rows, codes, scales, codes.shape[0])


# --- the route rule's passes over the vocabulary (logit_rows.c) ---------------------------------------

MIXTURE_MAX = 16  # the experts `mixture` takes (logit_rows.c)


def reads_logits(logits: torch.Tensor) -> bool:
    """Whether `logit_statistics` and `mixture` take these logits: float32 on a CPU, the kernels already loaded
    in this process (for the experts' quantized weights). The fusion step never builds them itself: a build
    on a request's path would stall that request's first token by seconds."""
    return (logits.dtype == torch.float32 and logits.device.type == "cpu" and library.cache_info().currsize > 0
            and library() is not None)


def logit_statistics(rows: torch.Tensor, floor: float) -> tuple[torch.Tensor, ...]:
    """rows (R, V) float32 -> per row (R,): the first id holding the maximum (long), the maximum, the runner-up
    less it (0 where the maximum ties), ln Σ e^y and the entropy, y = max(z - max, floor) (float32 each)."""
    rows = rows.contiguous()
    check_tensor("fusion_logit_statistics", "rows", rows, (torch.float32,), (None, None))
    count, width = rows.shape
    best_ids = torch.empty(count, dtype=torch.int64)
    best, runner_up, log_total, entropy = (torch.empty(count) for _ in range(4))
    library().fusion_logit_statistics(rows.data_ptr(), count, width, floor, torch.get_num_threads(),
                                      best_ids.data_ptr(), best.data_ptr(), runner_up.data_ptr(), log_total.data_ptr(),
                                      entropy.data_ptr())
    return best_ids, best, runner_up, log_total, entropy


def rms_norm(rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm of float32 rows (B, n) with a float32 weight (n,), in C: (B, n) float32
    (within float32 rounding of `fusion.forward.llama.rms_norm`, which sums the squares in its own order)."""
    rows = rows.float().contiguous()
    check_tensor("fusion_rms_norm", "rows", rows, (torch.float32,), (None, None))
    check_tensor("fusion_rms_norm", "weight", weight, (torch.float32,), (rows.shape[1],))
    out = torch.empty_like(rows)
    library().fusion_rms_norm(rows.data_ptr(), weight.data_ptr(), rows.shape[0], rows.shape[1], eps, out.data_ptr())
    return out


class RouterParams(ctypes.Structure):
    """logit_rows.c's router_params: a router's shape and pointers to its float32 tensors."""

    _fields_ = [("experts", ctypes.c_int64), ("features", ctypes.c_int64), ("embed_dim", ctypes.c_int64),
                ("hidden", ctypes.c_int64), ("comp_width", ctypes.c_int64), ("context", ctypes.c_int64),
                ("windows", ctypes.c_int64 * 4), ("window_count", ctypes.c_int64), ("vocabulary", ctypes.c_int64),
                ("embed", ctypes.c_void_p),
                ("norm_weight", ctypes.c_void_p), ("norm_bias", ctypes.c_void_p), ("norm_eps", ctypes.c_float),
                ("w1", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("route_weight", ctypes.c_void_p), ("route_bias", ctypes.c_void_p), ("comp_down", ctypes.c_void_p),
                ("gate_mean", ctypes.c_void_p), ("gate_whiten", ctypes.c_void_p), ("gate_limit", ctypes.c_float),
                ("generalist", ctypes.c_int64)]


ROUTER_MAX_WIDTH = 1024  # the widest router input or hidden layer `router_head` takes (logit_rows.c)
ROUTER_MAX_WINDOWS = 4
ROUTER_MAX_EXPERTS = 64


def router_head(params: RouterParams, features: torch.Tensor, context: torch.Tensor, allowed: torch.Tensor,
                fail_safe: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router's head for B rows in one call (logit_rows.c's `fusion_router_head`): features (B, F) float32,
    context (B, K) recent ids (-1: none), allowed (E, B) bool -> its weights (E, B), the complementary
    logit's share keep (B,) and the complementary layer's input times keep (B, comp_width). `params` must
    point at tensors alive for the call (`fusion.fuse.router.Router`'s native head keeps them)."""
    features = features.float().contiguous()
    context = context.to(torch.int64).contiguous()
    allowed = allowed.to(torch.uint8).contiguous()
    check_tensor("fusion_router_head", "features", features, (torch.float32,), (None, params.features))
    rows = features.shape[0]
    check_tensor("fusion_router_head", "context", context, (torch.int64,), (rows, params.context))
    check_tensor("fusion_router_head", "allowed", allowed, (torch.uint8,), (params.experts, rows))
    weights, keep = torch.empty(params.experts, rows), torch.empty(rows)
    comp = torch.empty(rows, params.comp_width)
    status = library().fusion_router_head(ctypes.byref(params), features.data_ptr(), context.data_ptr(),
                                          allowed.data_ptr(), rows, int(fail_safe), weights.data_ptr(),
                                          keep.data_ptr(), comp.data_ptr())
    if status == -2:
        raise IndexError(f"router_head: a context id lies outside the router's {params.vocabulary} embeddings")
    if status != 0:
        raise ValueError("router_head: the router is wider than the C head takes")
    return weights, keep, comp


def mixture(logits: torch.Tensor, log_weights: torch.Tensor, normalizers: torch.Tensor,
            complementary: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """logsumexp over experts of log_weights (E, B) + logits (E, B, V) - normalizers (E, B): (B, V) float32.
    `complementary` = (inputs (B, C), weight (C, V), bias (V,), scale (B,)): adds scale[b] · bias + inputs[b] @
    weight to row b in the same pass (the route rule's complementary logit)."""
    logits, log_weights, normalizers = (t.float().contiguous() for t in (logits, log_weights, normalizers))
    check_tensor("fusion_mixture", "logits", logits, (torch.float32,), (None, None, None))
    experts, count, width = logits.shape
    if experts > MIXTURE_MAX:
        raise ValueError(f"mixture takes at most {MIXTURE_MAX} experts, got {experts}")
    check_tensor("fusion_mixture", "log_weights", log_weights, (torch.float32,), (experts, count))
    check_tensor("fusion_mixture", "normalizers", normalizers, (torch.float32,), (experts, count))
    comp = [None, 0, None, None, None]
    if complementary is not None:
        inputs, weight, bias, scale = (t.float().contiguous() for t in complementary)
        if inputs.shape[0] != count or weight.shape != (inputs.shape[1], width) or bias.shape != (width,):
            raise ValueError("mixture: the complementary logit's inputs, weight and bias do not fit the logits")
        check_tensor("fusion_mixture", "scale", scale, (torch.float32,), (count,))
        comp = [inputs.data_ptr(), inputs.shape[1], weight.data_ptr(), bias.data_ptr(), scale.data_ptr()]
    out = torch.empty(count, width)
    library().fusion_mixture(logits.data_ptr(), log_weights.data_ptr(), normalizers.data_ptr(), experts, count, width,
                             torch.get_num_threads(), *comp, out.data_ptr())
    return out


# --- references: what the kernels compute, in plain torch (for tests and for reading) ---------------

CODE_MAX = 32767  # the int8 weights' activation codes: int16
SPLIT_MAX = 128 * 127  # the int4 weights' activation codes: two signed bytes each, a scale a group of 32


def _spread_setting() -> int:
    value = os.environ.get("FUSION_INT4_COARSE_SPREAD", "4")
    if not value.isdigit():
        raise ValueError(f"FUSION_INT4_COARSE_SPREAD: a whole number >= 0 is expected, got {value!r}")
    return int(value)


# A group whose max|x| is at most this many times its mean |x| keeps one byte a code (0: none does): a step
# about a tenth faster for about twice the KL to bf16 at 4 (docs/performance.md).
COARSE_SPREAD = _spread_setting()
_coarse_spread = COARSE_SPREAD  # as the loaded kernels have it (`coarse_spread`)
OUT_BLOCK = 8  # the int4 layout's outputs a block


def quantized_activations(rows: torch.Tensor) -> torch.Tensor:
    """rows (M, K) as the int8 weights' integer products see them, float64: each row rounded to int16 codes
    times its max|x| / 32767 (halves rounded away from zero; the arithmetic in float32, as in C)."""
    x = rows.float()
    amax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, CODE_MAX / amax, torch.zeros_like(amax))
    scaled = x * inverse
    codes = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (codes.double() * (amax / CODE_MAX).double()).view(rows.shape)


def grouped_activations(rows: torch.Tensor) -> torch.Tensor:
    """rows (M, K) as the int4 weights' integer products see them, float64: each group of 32 rounded to codes
    c (to nearest, ties to even) times its max|x| / (128 · 127) (the arithmetic in float32, as in C; the C
    holds each code as two bytes, 128 · high + low, which is exact). A group without outliers
    (COARSE_SPREAD · Σ|c| ≥ 32 · 128 · 127, or as `coarse_spread` sets it) keeps its high bytes alone: c
    rounded to a multiple of 128, halves up."""
    x = rows.float().view(rows.shape[0], -1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, SPLIT_MAX / amax, torch.zeros_like(amax))
    codes = torch.round(x * inverse)
    coarse = _coarse_spread * codes.abs().sum(-1, keepdim=True) >= 32 * SPLIT_MAX  # (M, K/32, 1)
    codes = torch.where(coarse, 128 * torch.floor((codes + 64) / 128), codes)
    return (codes.double() * (amax / SPLIT_MAX).double()).view(rows.shape)


def int4_mm_reference(rows: torch.Tensor, codes: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    """What `int4_mm` computes, float64, from codes (N, K) in [0, 15] and scale_bias (N, 2, K/32) (before
    packing): the codes' part multiplies the quantized activations, the biases' part the exact ones."""
    n, k = codes.shape
    scales, biases = scale_bias.double().unbind(1)  # (N, K/32) each
    weight_codes = (codes.double().view(n, -1, 32) * scales[..., None]).view(n, k)
    weight_biases = biases.repeat_interleave(32, dim=1)  # (N, K)
    return grouped_activations(rows) @ weight_codes.T + rows.double() @ weight_biases.T


def int8_mm_reference(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `int8_mm` computes, float64."""
    return quantized_activations(rows) @ (codes.double() * scales.double()[:, None]).T


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in [0, 15], N a multiple of 8, in the kernel's layout (N/8, 4K) uint8: block b, group g
    is 128 bytes, byte 32t + 4o + i holding the code of output 8b + o, input 32g + 8t + i in its low nibble
    and that of input 32g + 8t + 4 + i in its high one (quantized_mm.c)."""
    n, k = codes.shape
    # (blocks, o, groups, t, half, i) -> (blocks, groups, t, o, i) per half
    quads = codes.to(torch.uint8).view(n // OUT_BLOCK, OUT_BLOCK, k // 32, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    return (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).reshape(n // OUT_BLOCK, 4 * k).contiguous()


def pack_scale_bias(scale_bias: torch.Tensor) -> torch.Tensor:
    """Scales and biases (N, 2, K/32) in the kernel's layout (N/8, K/32, 2, 8): each block's eight outputs'
    for a group side by side."""
    n, _, groups = scale_bias.shape
    return scale_bias.view(n // OUT_BLOCK, OUT_BLOCK, 2, groups).permute(0, 3, 2, 1).contiguous()
