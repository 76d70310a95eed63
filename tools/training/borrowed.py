"""Input embeddings borrowed from a pretrained model, for small trained modules (the router)."""

from __future__ import annotations

import torch
from torch import nn


class BorrowedEmbedding(nn.Module):
    """Input embeddings read from another model's frozen table [V, Hb] through a trained projection
    [Hb, H]. Every token, seen in training or not, goes through the same projection, so a word never
    seen in training lands near the words the base model puts it near ("multiplied" by "multiply").
    Baked into a plain nn.Embedding (table @ projection) before saving."""

    def __init__(self, table: torch.Tensor, dim: int, std: float = 0.02) -> None:
        super().__init__()
        self.register_buffer("table", table, persistent=False)  # [V, Hb], frozen
        self.proj = nn.Linear(table.shape[1], dim, bias=False)
        with torch.no_grad():  # outputs at the scale of a freshly initialised embedding
            sample = table[torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(0))[:4096]]
            self.proj.weight.mul_(std / self.proj(sample).std().clamp(min=1e-8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table[ids])  # [..., H]

    @torch.no_grad()
    def baked(self) -> nn.Embedding:
        return nn.Embedding.from_pretrained(self.proj(self.table), freeze=False)  # [V, H]
