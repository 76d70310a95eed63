"""Build a small Llama on an existing tokenizer, and save it beside a copy of that tokenizer."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from fusion.models import staged_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int = 8192  # a RoPE limit only; nothing is allocated per position

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")


def build_model(tokenizer, shape: ModelShape, *, seed: int, tied: bool = True) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM over the tokenizer's full vocabulary (input and output
    embeddings tied unless `tied` is False)."""
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos is None or eos == tokenizer.unk_token_id:
        eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    logger.info("built Llama %s: %.1fM parameters, vocab %d", asdict(shape), n / 1e6, vocab)
    return model


def base_input_embeddings(model_dir: Path, vocab_size: int) -> torch.Tensor:
    """The first `vocab_size` rows of a saved model's input embeddings, float32 [vocab_size, H]."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            key = next((k for k in weights.keys() if k.endswith("embed_tokens.weight")), None)
            if key is not None:
                table = weights.get_tensor(key)
                if table.shape[0] < vocab_size:
                    raise ValueError(f"{model_dir}: {table.shape[0]} embedding rows, the tokenizer has {vocab_size}")
                return table[:vocab_size].float()
    raise ValueError(f"{model_dir}: no safetensors file holds input embeddings (embed_tokens.weight)")


class BorrowedEmbedding(nn.Module):
    """Input embeddings read from another model's frozen table [V, Hb] through a trained projection
    [Hb, H]. Every token, seen in training or not, goes through the same projection, so a word the
    specialist never saw lands near the words the base model puts it near ("multiplied" by
    "multiply"). Baked into a plain nn.Embedding (table @ projection) before saving."""

    def __init__(self, table: torch.Tensor, dim: int, std: float = 0.02) -> None:
        super().__init__()
        self.register_buffer("table", table, persistent=False)  # [V, Hb], frozen
        self.proj = nn.Linear(table.shape[1], dim, bias=False)
        with torch.no_grad():  # outputs at the scale of a freshly initialised embedding
            sample = table[torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(0))[:4096]]
            self.proj.weight.mul_(std / self.proj(sample).std().clamp(min=1e-8))

    @classmethod
    def fitted(cls, table: torch.Tensor, target: torch.Tensor, rows: torch.Tensor) -> "BorrowedEmbedding":
        """A projection that reproduces `target` [V, H] on `rows` (the ids a model was trained on): the
        least-norm solution of table[rows] @ P = target[rows], exact when rows <= table's width."""
        borrowed = cls(table, target.shape[1])
        with torch.no_grad():
            solution = torch.linalg.lstsq(table[rows].double(), target[rows].double(), driver="gelsd").solution
            borrowed.proj.weight.copy_(solution.T.float())  # [H, Hb]
        return borrowed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table[ids])  # [..., H]

    @torch.no_grad()
    def baked(self) -> nn.Embedding:
        return nn.Embedding.from_pretrained(self.proj(self.table), freeze=False)  # [V, H]


def save_expert(model, tokenizer, out_dir: Path, metadata: dict) -> Path:
    """Save weights (bf16), tokenizer and `fusion_expert.json` into `out_dir`, atomically."""
    out_dir = Path(out_dir)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    with staged_dir(out_dir, replace=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "fusion_expert.json").write_text(json.dumps(metadata, indent=2) + "\n")
    logger.info("saved %s", out_dir)
    return out_dir
