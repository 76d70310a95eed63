"""A random-initialised model of SmolLM2-135M's shape with a small tokenizer, for benchmarks that
must not depend on downloaded weights."""

from __future__ import annotations

from pathlib import Path

import torch

SMOLLM2_135M = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)


def build_expert(folder: Path, layers: int) -> Path:
    """A random-initialised SmolLM2-135M-shaped model (bf16) and a small byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog 0123456789 + - = ?"] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers}, bos_token_id=0, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
