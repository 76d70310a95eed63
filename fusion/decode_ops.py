"""Tensor helpers shared by the fast decode steps (fusion.fast_decode, fusion.fast_decode_gemma3)."""

from __future__ import annotations

import torch
from torch import nn


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


def rows_times(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, H, G, K) @ b (B or 1, H, K, N) -> (B, H, G, N). When b has one row shared by all B rows, the
    rows join the group axis, so b is read as it is instead of being expanded into B copies."""
    rows, heads, group, _ = a.shape
    if b.shape[0] == rows:
        return torch.matmul(a, b)
    out = torch.matmul(a.transpose(0, 1).reshape(1, heads, rows * group, a.shape[-1]), b)  # (1, H, B·G, N)
    return out.view(heads, rows, group, -1).transpose(0, 1)
