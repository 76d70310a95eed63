"""End to end on the real SmolLM2-135M-Instruct checkpoint, through the real fetch and load path."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from fusion.config import parse_config
from fusion.frontdoor.service import FusionService


def test_self_fusion_reproduces_plain_generate(smollm2_dir):
    config = parse_config({
        "experts": [
            {"name": "left", "model": str(smollm2_dir), "weight": 0.35},
            {"name": "right", "model": str(smollm2_dir), "weight": 0.65},
        ],
        "fusion": {"rule": "weighted_logits"},
    })
    service = FusionService.from_config(config)
    prompt = "What is the capital of France?"
    completion = service.complete(prompt, {"max_tokens": 24})
    service.close()

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=24, do_sample=False,
                                                                   pad_token_id=tokenizer.pad_token_id,
                                                                   eos_token_id=tokenizer.eos_token_id))
    expected = out[0, ids.shape[1]:].tolist()
    assert completion.token_ids == expected
    assert "Paris" in completion.text
