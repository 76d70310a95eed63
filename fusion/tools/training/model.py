"""Build a small Llama on an existing tokenizer, and save it beside a copy of that tokenizer."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
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


def build_model(tokenizer, shape: ModelShape, *, seed: int) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM over the tokenizer's full vocabulary, tied embeddings."""
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
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    logger.info("built Llama %s: %.1fM parameters, vocab %d", asdict(shape), n / 1e6, vocab)
    return model


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
