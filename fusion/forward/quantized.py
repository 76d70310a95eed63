"""Weight-only quantized projections for CPU decoding: 8-bit per output channel and 4-bit per group.

A decode step of a small model on a CPU is bound by reading its weights: SmolLM2-135M reads 270 MB of
bf16 weights per token. `QuantizedLinear` keeps a projection's weight as int8 codes with one scale per
output row (torch's `_weight_int8pack_mm`), or as 4-bit codes with a scale and an offset per group of
32 inputs along each row (torch's `_weight_int4pack_mm_for_cpu`, the tinygemm layout); both kernels
dequantize inside the product, so a step reads a half or a quarter of the bytes, with no compilation.

    int8:  w[n, k] = q[n, k] · s[n]                                 q in [-127, 127]
    int4:  w[n, k] = (q[n, k] - 8) · s[g, n] + z[g, n],  g = k // 32   q in [0, 15]

The 4-bit recipe is GGUF's Q4_1 (per 32 weights: d = (max - min) / 15, m = min, q = round((w - m) / d),
so s = d and z = m + 8d): a model dequantized from a Q4_1 file, as the builtin SmolLM2 is, gets its
file's own codes back. `quantize_model` replaces a model's decoder projections and output head in place
("int4" keeps the head at 8 bits, as llama.cpp's Q4 files keep the token table at Q8_0: the head's
errors reach the logits unaveraged). Sibling projections of one input (query/key/value, gate/up) are
packed as one matrix, each sibling a row view of it (a copy where the packed layout does not split at
its rows), so the fast decode step runs them as one product and transformers' forward (prefill) still
calls each sibling alone (`QuantizedLinear.fused`).
Two kernels compute the products (`KERNELS`): "native", the project's own (fusion/forward/native_kernels.py:
activations as integer codes times the weights' codes in integers: for 4-bit weights a scale and ~15-bit
codes a group of 32, held as two bytes, for 8-bit weights 16-bit codes a row; the 4-bit codes packed two a
byte in blocks of 8 outputs, so that a SIMD lane computes one output), used wherever a C compiler built them;
and "torch", torch's kernels above (activations in their own dtype; the tinygemm layout), used elsewhere.
The embedding table stays as it is: a step reads one row of it. Products of many rows (prefill, a
step of many sessions) use the dense weight the codes were made from (`DENSE_FROM_ROWS`): the 4-bit
kernel wins by reading fewer bytes, which matters while a product reads its weight once for a few rows.
Except where that dense product is itself slow (`keeps_dense`): a CPU without bfloat16 instructions
multiplies a bfloat16 weight several times slower than the native kernels multiply its codes, at any
number of rows, so there the codes serve every product and the dense weight is not kept.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fusion.forward import native_kernels
logger = logging.getLogger(__name__)

WEIGHT_FORMATS = ("dense", "int8", "int4")
KERNELS = ("native", "torch")
INT4_GROUP = 32  # inputs per 4-bit group: Q4_1's block
INT8_MAX = 127
# Products of at least this many rows (prefill, prompt chunks, a step of many sessions) use the dense
# weight the codes were made from: the 4-bit kernel reads a quarter of the bytes but dequantizes for
# every row block, so past a few dozen rows it falls behind the dense product (docs/performance.md).
DENSE_FROM_ROWS = 24


def keeps_dense(kernel: str, dtype: torch.dtype) -> bool:
    """Whether a projection in `kernel`'s layout keeps the dense weight (in activations of `dtype`) for
    products of many rows: not for the native kernels' bfloat16 or float16 activations on a CPU without
    AVX-512 bfloat16 instructions, where torch's dense bfloat16 product measured several times slower than
    the native 4-bit one at every number of rows tried (docs/performance.md)."""
    if kernel != "native" or dtype == torch.float32:
        return True
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)())


# Siblings that read one input, packed as one matrix (in the order of their outputs).
SIBLINGS = {"self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)),
            "mlp": (("gate_proj", "up_proj"), ("down_proj",))}


def unsupported_reason(linear: nn.Module, weights: str) -> str | None:
    """Why `linear` cannot hold `weights` codes (None: it can)."""
    if not isinstance(linear, nn.Linear):
        return f"{type(linear).__name__} is not a linear layer"
    if linear.weight.device.type != "cpu":
        return f"quantized weights run on CPU (the kernels used here are CPU ones), not {linear.weight.device.type}"
    if weights == "int4":
        if linear.in_features % INT4_GROUP:
            return f"{linear.in_features} inputs are not a multiple of the 4-bit group ({INT4_GROUP})"
        if linear.out_features % 16:
            return f"{linear.out_features} outputs are not a multiple of 16 (the 4-bit kernel's tile)"
    return None


# --- codes ---------------------------------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row codes of weight (N, K): q (N, K) int8 and scales (N,) float32."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
    codes = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 codes of weight (N, K): q (N, K) int32 in [0, 15], and per group (N, K/group) float32 the
    scale s and the offset z of w = (q - 8)·s + z."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/group)
    step = (high - low) / 15
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))  # a constant group: every code 0
    codes = torch.round((w - low[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return codes, step, low + 8 * step


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int = INT4_GROUP
                    ) -> torch.Tensor:
    """The weight (N, K) float32 that int4 codes stand for (the reference the kernel is tested against)."""
    n, k = codes.shape
    return ((codes.view(n, k // group, group).float() - 8) * scales[..., None] + offsets[..., None]).view(n, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) int32 in the CPU kernel's layout, (N, K/2) uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


@functools.cache
def int4_row_block() -> int:
    """The fewest rows of a packed 4-bit matrix that are packed alone: a range of rows starting and ending
    at multiples of it is the packing of those rows by themselves. The layout interleaves rows in blocks
    whose size depends on the CPU's kernel, so it is found by packing, once."""
    codes = torch.randint(0, 16, (512, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = pack_int4(codes)
    for block in (16, 32, 64, 128, 256):
        if all(torch.equal(packed[start:start + block], pack_int4(codes[start:start + block]))
               for start in range(0, 512, block)):
            return block
    return 512


def default_kernel() -> str:
    """The kernel quantized projections use unless told otherwise: the project's own where they are built."""
    return "native" if native_kernels.available() else "torch"


def kernel_for(in_features: int, out_features: int, weights: str, kernel: str | None) -> str:
    """The kernel a projection of `in_features` inputs and `out_features` outputs uses when `kernel` is asked
    for (None: the default): the native kernels take whole groups of 32 inputs, and whole blocks of 8 outputs
    at 4 bits."""
    kernel = kernel or default_kernel()
    if kernel == "native" and (in_features % INT4_GROUP
                               or (weights == "int4" and out_features % native_kernels.OUT_BLOCK)):
        return "torch"
    return kernel


def native_scale_bias(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The native 4-bit layout's (N, 2, K/32) float16 scales and biases, w = q·s + b for codes q in [0, 15],
    from `quantize_int4`'s scales and offsets (N, K/32) (w = (q - 8)·s + offset). float16 as in GGUF's
    Q4_1 blocks: a sixth fewer bytes a step than float32 (24 to 20 a group of 32)."""
    return torch.stack((scales, offsets - 8 * scales), dim=1).to(torch.float16).contiguous()


def tensor_names(weights: str, kernel: str) -> tuple[str, ...]:
    """The buffers of a `QuantizedLinear` of `weights` codes for `kernel`."""
    if weights == "int8":
        return ("codes", "scales")
    return ("nibbles", "scale_bias") if kernel == "native" else ("codes", "scales_offsets")


# --- the projection --------------------------------------------------------------------------------

class QuantizedLinear(nn.Module):
    """`nn.Linear` with quantized weights (module docstring). Buffers: int8: `codes` (N, K) int8 and
    `scales` (N,); int4: `codes` (N, K/2) uint8, packed, and `scales_offsets` (K/32, N, 2), scales in the
    activations' dtype (torch's kernels), or `nibbles` (N/8, 4K) uint8 and `scale_bias` (N/8, K/32, 2, 8)
    float16 (`native_kernels.pack_nibbles`, `pack_scale_bias`) for w = q·s + b (the native kernels; float16,
    as GGUF's Q4_1 keeps them). `fused`: the one matrix this projection is a row view of, with its siblings
    (None: it stands alone)."""

    def __init__(self, weights: str, in_features: int, out_features: int, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None, dense: torch.Tensor | None = None, kernel: str = "torch") -> None:
        super().__init__()
        # The weight (N, K) in the activations' dtype, for products of many rows (`DENSE_FROM_ROWS`):
        # not a buffer, so neither the codes file nor a state dict holds it.
        self.dense = None if dense is None or not keeps_dense(kernel, dense.dtype) else dense.detach()
        if weights not in ("int8", "int4"):
            raise ValueError(f"weights must be int8 or int4, got {weights!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if set(tensors) != set(tensor_names(weights, kernel)):
            raise ValueError(f"{weights} codes for the {kernel} kernel are {tensor_names(weights, kernel)}, "
                             f"got {sorted(tensors)}")
        self.weights, self.in_features, self.out_features = weights, in_features, out_features
        self.kernel = kernel
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.fused: QuantizedLinear | None = None
        self.fused_rows: tuple[int, int] | None = None

    def __setattr__(self, name, value) -> None:
        if name == "fused" and isinstance(value, nn.Module):
            object.__setattr__(self, name, value)  # a reference, not a submodule (its buffers are this one's)
        else:
            super().__setattr__(name, value)

    @classmethod
    def of(cls, linear: nn.Linear, weights: str, dtype: torch.dtype, kernel: str | None = None) -> QuantizedLinear:
        """`linear` quantized; `dtype`: the activations'."""
        return cls.stack([linear], weights, dtype, kernel)

    @classmethod
    def stack(cls, linears: Sequence[nn.Linear], weights: str, dtype: torch.dtype, kernel: str | None = None
              ) -> QuantizedLinear:
        """One projection for `linears` of one input, their outputs side by side, for `kernel` (None: the
        default one)."""
        kernel = kernel_for(linears[0].in_features, sum(lin.out_features for lin in linears), weights, kernel)
        for linear in linears:
            reason = unsupported_reason(linear, weights)
            if reason is not None:
                raise ValueError(f"cannot quantize to {weights}: {reason}")
        weight = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else linears[0].weight.detach()
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("projections with and without bias cannot be fused")
        bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        if weights == "int8":
            codes, scales = quantize_int8(weight)
            tensors = {"codes": codes, "scales": scales if kernel == "native" else scales.to(dtype)}
        elif kernel == "native":
            codes, scales, offsets = quantize_int4(weight)
            tensors = {"nibbles": native_kernels.pack_nibbles(codes),
                       "scale_bias": native_kernels.pack_scale_bias(native_scale_bias(scales, offsets))}
        else:
            codes, scales, offsets = quantize_int4(weight)
            tensors = {"codes": pack_int4(codes),
                       "scales_offsets": torch.stack((scales, offsets), dim=-1).transpose(0, 1).contiguous().to(dtype)}
        return cls(weights, weight.shape[1], weight.shape[0], tensors, bias, weight.to(dtype), kernel)

    def rows(self, start: int, stop: int) -> QuantizedLinear | None:
        """Output rows [start, stop) as a projection whose codes are a view of this one's (its scales are
        copied: they are small), or None where the packed layout does not split there."""
        if self.weights == "int8":
            tensors = {"codes": self.codes[start:stop], "scales": self.scales[start:stop].clone()}
        elif self.kernel == "native":  # whole blocks of outputs
            block = native_kernels.OUT_BLOCK
            if start % block or stop % block:
                return None
            tensors = {"nibbles": self.nibbles[start // block:stop // block],
                       "scale_bias": self.scale_bias[start // block:stop // block]}
        else:
            block = int4_row_block()
            if start % block or stop % block:
                return None
            tensors = {"codes": self.codes[start:stop], "scales_offsets": self.scales_offsets[:, start:stop].contiguous()}
        bias = None if self.bias is None else self.bias[start:stop]
        dense = None if self.dense is None else self.dense[start:stop]
        sub = QuantizedLinear(self.weights, self.in_features, stop - start, tensors, bias, dense, self.kernel)
        sub.fused, sub.fused_rows = self, (start, stop)
        return sub

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] >= DENSE_FROM_ROWS:
            return F.linear(rows, self.dense.to(rows.dtype), self.bias).view(*x.shape[:-1], self.out_features)
        return self.codes_product(x)

    def codes_product(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) from the codes, however many rows: each row's product is then the same
        whatever rows come with it (the native kernels quantize and sum each row on its own)."""
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if self.kernel == "native":
            if self.weights == "int8":
                out = native_kernels.int8_mm(rows, self.codes, self.scales)
            else:
                out = native_kernels.int4_mm(rows, self.nibbles, self.scale_bias)
        elif self.weights == "int8":
            out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales.to(rows.dtype))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.codes, INT4_GROUP,
                                                             self.scales_offsets.to(rows.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weights}, {self.kernel} kernel"


@contextlib.contextmanager
def codes_only() -> Iterator[None]:
    """Every product from the codes, however many rows, while inside (what a decode step computes): for
    measuring the codes' own quality on long texts."""
    global DENSE_FROM_ROWS
    saved, DENSE_FROM_ROWS = DENSE_FROM_ROWS, sys.maxsize
    try:
        yield
    finally:
        DENSE_FROM_ROWS = saved


def is_projection(module: nn.Module) -> bool:
    """A dense or quantized linear layer."""
    return isinstance(module, (nn.Linear, QuantizedLinear))


def fused_projection(parts: Sequence[nn.Module]) -> QuantizedLinear | None:
    """The one matrix `parts` (siblings, in order) are the rows of (views, or copies), covering it whole;
    None if none."""
    first = getattr(parts[0], "fused", None)
    if first is None or any(getattr(p, "fused", None) is not first for p in parts):
        return None
    bounds = [p.fused_rows for p in parts]
    if bounds[0][0] != 0 or bounds[-1][1] != first.out_features or any(
            a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return first


# --- a whole model --------------------------------------------------------------------------------

def projection_groups(model) -> Iterator[tuple[nn.Module, tuple[str, ...]]]:
    """(parent module, sibling names) for each group of projections `quantize_model` packs together."""
    for layer in model.model.layers:
        for block_name, groups in SIBLINGS.items():
            block = getattr(layer, block_name)
            for names in groups:
                yield block, names


def quantize_model(model, weights: str, cache_file: Path | None = None, kernel: str | None = None) -> None:
    """Replace the decoder layers' projections and the output head of `model` (a Llama-, Mistral-, Qwen2-
    or Gemma3-style *ForCausalLM on CPU) with `QuantizedLinear`s, in place. "dense" leaves it as it is.
    `cache_file` (see `packed_cache_file`): codes read from it when it exists, else written to it, so a
    second start skips quantizing and packing. `kernel`: which kernel's layout (None: the default one)."""
    if weights == "dense":
        return
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    started = time.perf_counter()
    kernel = kernel or default_kernel()
    dtype = model.get_input_embeddings().weight.dtype
    stored = _read_codes(cache_file)
    made: dict[str, torch.Tensor] = {}

    def matrix(key: str, linears: Sequence[nn.Linear], kind: str) -> QuantizedLinear:
        """The quantized matrix of `linears` stacked: from the cache file, or made (and kept for it)."""
        own_kernel = kernel_for(linears[0].in_features, sum(lin.out_features for lin in linears), kind, kernel)
        names = tensor_names(kind, own_kernel)
        if stored is not None:
            dense = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else linears[0].weight
            return QuantizedLinear(kind, linears[0].in_features, sum(lin.out_features for lin in linears),
                                   {n: stored[f"{key}.{n}"] for n in names}, stored.get(f"{key}.bias"),
                                   dense.to(dtype), own_kernel)
        made_here = QuantizedLinear.stack(linears, kind, dtype, kernel)
        made.update({f"{key}.{n}": getattr(made_here, n) for n in names})
        if made_here.bias is not None:
            made[f"{key}.bias"] = made_here.bias.detach()
        return made_here

    for index, (block, names) in enumerate(projection_groups(model)):
        linears = [getattr(block, name) for name in names]
        whole = matrix(f"group{index}", linears, weights)
        start = 0
        for name, linear in zip(names, linears):
            stop = start + linear.out_features
            part = whole.rows(start, stop) if len(linears) > 1 else whole
            if part is None:  # rows the packed layout does not split at: the sibling gets codes of its own
                part = matrix(f"group{index}.{name}", [linear], weights)
                part.fused, part.fused_rows = whole, (start, stop)
            setattr(block, name, part)
            start = stop
    model.set_output_embeddings(matrix("head", [model.get_output_embeddings()], "int8"))
    # The head no longer shares the embedding's tensor: a later `tie_weights` must not re-tie them.
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    if cache_file is not None and stored is None:
        _write_codes(cache_file, made)
    logger.info("weights %s to %s in %.2f s (output head int8, %s kernels): %.0f MB of codes and scales",
                "read" if stored is not None else "quantized", weights, time.perf_counter() - started, kernel,
                quantized_bytes(model) / 1e6)


# --- the cache of codes ---------------------------------------------------------------------------

CODES_FORMAT = 4  # bump when the layout or the meaning of a cache file changes


def packed_cache_file(cache_dir: Path, source: str, weights: str, dtype: str, adapter: str | None = None,
                      kernel: str | None = None) -> Path:
    """Where the codes of `source` (a model folder or hub id, with `adapter` merged) at `weights` for
    `kernel` (None: the default one) live: the name hashes the source's files (names, sizes, modification
    times), the format, the activations' dtype, the kernel, torch's version and the CPU's kernel (torch's
    4-bit layout is its CPU kernel's own)."""
    kernel = kernel or default_kernel()
    digest = hashlib.sha256()
    for ref in (source, adapter):
        digest.update(repr(ref).encode())
        folder = Path(ref).expanduser() if ref else None
        if folder is not None and folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    stat = path.stat()
                    digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(f"{weights}:{dtype}:{kernel}:{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}:"
                  f"{int4_row_block()}:{CODES_FORMAT}".encode())
    return Path(cache_dir) / f"{Path(str(source)).name}-{weights}-{digest.hexdigest()[:16]}.safetensors"


def _read_codes(path: Path | None) -> dict[str, torch.Tensor] | None:
    if path is None or not path.exists():
        return None
    from safetensors.torch import load_file

    try:
        # Copied out of the file's buffer: its tensors start where the header leaves them (8-byte
        # alignment), and the 4-bit kernel's vector loads crashed on codes not aligned to 64 bytes.
        return {name: tensor.clone() for name, tensor in load_file(path).items()}
    except Exception as err:  # a damaged file is made again
        logger.warning("ignoring the unreadable codes file %s: %s", path, err)
        return None


def _write_codes(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, partial)
    os.replace(partial, path)  # readers never see a half-written file


def quantized_bytes(model) -> int:
    """Bytes held by `model`'s quantized projections and the matrices their siblings share (each storage
    once)."""
    storages: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for owner in (module, module.fused):
                for tensor in [] if owner is None else list(owner.buffers(recurse=False)) + list(owner.parameters()):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
