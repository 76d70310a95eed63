"""Tensor helpers shared by the fast decode steps (fusion.forward.llama, fusion.forward.gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusion.forward.quantized import QuantizedLinear, fused_projection


def frozen(tensor: torch.Tensor | QuantizedLinear) -> nn.Parameter | QuantizedLinear:
    """`tensor` as a parameter without gradients (itself when it already is a parameter, or a quantized
    projection)."""
    if isinstance(tensor, (nn.Parameter, QuantizedLinear)):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)


def decoder_shape(model, reason: str | None) -> tuple[int, int, int, float]:
    """A decode step's attention shape for `model`: heads, key/value heads, head width and the norms' epsilon;
    ValueError with `reason`, why the step cannot run the model, where there is one."""
    if reason is not None:
        raise ValueError(f"the fast decode path does not support this model: {reason}")
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim, float(config.rms_norm_eps)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, D) of each row's position (B,) for a rotary table `inv_freq` (D/2,)."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # (B, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (B, D)
    return (angles.cos() * scaling).to(dtype)[:, None, :], (angles.sin() * scaling).to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding applied to heads x (B, H, D), as transformers' `rotate_half` does."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rows_times(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, H, G, K) @ b (B or 1, H, K, N) -> (B, H, G, N). When b has one row shared by all B rows, the
    rows join the group axis, so b is read as it is instead of being expanded into B copies."""
    rows, heads, group, _ = a.shape
    if b.shape[0] == rows:
        return torch.matmul(a, b)
    out = torch.matmul(a.transpose(0, 1).reshape(1, heads, rows * group, a.shape[-1]), b)  # (1, H, B·G, N)
    return out.view(heads, rows, group, -1).transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scale: float, mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One new query per row over its cached columns and its own new key/value: q (B, H, D), k and v
    (B, H_kv, D), keys and values (B or 1, H_kv, width, D), mask (B or 1, 1, 1, width) bool over the
    columns (None: all), `softcap`: scores soft-capped as cap·tanh(score/cap) (Gemma 2). Grouped-query attention without repeating keys (each group's queries share one
    kv head), as plain products: at one query per row, CPU SDPA's flash kernel measured far slower.
    On a CPU both products run in float32
    (`attention_dtype`). Returns (B, H·D) in q's dtype."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    dtype, work = q.dtype, attention_dtype(q)
    q = q.view(batch, kv_heads, heads // kv_heads, dim).to(work)
    k, v = k.to(work), v.to(work)
    cached = rows_times(q, keys.transpose(-1, -2).to(work)).float() * scale  # (B, H_kv, group, width)
    own = (q * k[:, :, None, :]).sum(-1, keepdim=True).float() * scale  # (B, H_kv, group, 1): the new column
    if softcap is not None:
        cached, own = torch.tanh(cached / softcap) * softcap, torch.tanh(own / softcap) * softcap
    if mask is not None:
        cached = cached.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(torch.cat((cached, own), dim=-1), dim=-1).to(work)
    attn = rows_times(probs[..., :-1], values.to(work)) + probs[..., -1:] * v[:, :, None, :]  # (B, H_kv, group, D)
    return attn.reshape(batch, heads * dim).to(dtype)


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention's products run in: float32 on a CPU, whose bf16 batched products of a decode
    step's shapes (a few queries per row) measured several times slower than converting the cached keys
    and values to float32 and multiplying those, from 60 to 2,000 columns (docs/performance.md); q's own
    dtype on a GPU."""
    return torch.float32 if q.device.type == "cpu" else q.dtype


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; each module's weight becomes a
    view of its rows of the fused one, so the model keeps working and memory holds one copy."""
    weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    biases = [lin.bias for lin in linears]
    bias = (nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
            if all(b is not None for b in biases) else None)
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("projections with and without bias cannot be fused")
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight.detach()[start:start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.detach()[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def fuse_projections(linears: list[nn.Module]) -> tuple[torch.Tensor | QuantizedLinear, torch.Tensor | None]:
    """One projection for several of the same input: dense ones as `fuse_linears` fuses them, quantized
    ones as the matrix they are row views of (fusion.forward.quantized), or a stack of theirs (a copy) where they
    are not views of one."""
    if not any(isinstance(lin, QuantizedLinear) for lin in linears):
        return fuse_linears(linears)
    if not all(isinstance(lin, QuantizedLinear) for lin in linears):
        raise ValueError("dense and quantized projections cannot be fused")
    fused = fused_projection(linears) if len(linears) > 1 else linears[0]
    if fused is None:
        raise ValueError("quantized projections that are not row views of one matrix cannot be fused")
    return fused, None


def projection_lists(layer, count: int) -> tuple[nn.ModuleList | nn.ParameterList, ...]:
    """`count` empty per-layer holders for a decode step's projections: module lists when the model's
    projections are quantized (the step keeps the `QuantizedLinear`s), parameter lists otherwise."""
    quantized = isinstance(layer.self_attn.q_proj, QuantizedLinear)
    return tuple(nn.ModuleList() if quantized else nn.ParameterList() for _ in range(count))


def weight_of(linear: nn.Module) -> torch.Tensor | QuantizedLinear:
    """What a decode step multiplies by for `linear`: its weight (N, K) as a frozen parameter, or the
    quantized projection itself."""
    return frozen(linear if isinstance(linear, QuantizedLinear) else linear.weight)


def project(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """x (rows, K) through a dense weight (N, K) or a quantized projection: (rows, N)."""
    if isinstance(weight, QuantizedLinear):
        out = weight(x)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
