"""`fusion/experts/adapter_merge.py`: an expert that is a base plus a PEFT LoRA adapter, loaded through peft's own
path from a folder, against the merged weights computed by hand and against peft's unmerged model."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from fusion.config import SamplingParams, parse_config
from fusion.engine.types import GenerationRequest
from fusion.errors import AssetError
from fusion.experts.expert import LocalExpert
from fusion.frontdoor.service import FusionService
from tests.conftest import tiny_config_dict

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir, tmp_path_factory):
    """A random (non-zero) LoRA adapter of rank 4 over tiny expert `a`, saved in the PEFT format."""
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapter")
    lora.save_pretrained(out)
    return out


def merged_by_hand(tiny_dir, adapter_dir):
    """The base with W + (alpha / r) B A on every targeted projection, from the saved adapter's tensors."""
    from safetensors.torch import load_file

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    scale = 8 / 4
    changed = 0
    for name, module in model.named_modules():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in tensors:
            a, b = tensors[key], tensors[f"base_model.model.{name}.lora_B.weight"]  # (r, in), (out, r)
            with torch.no_grad():
                module.weight += scale * b @ a
            changed += 1
    assert changed == len(TARGETS) * model.config.num_hidden_layers
    return model.eval()


def test_an_adapter_expert_equals_its_merged_weights_and_peft(tiny_dir, adapter_dir):
    config = parse_config(tiny_config_dict(tiny_dir, names=("a",)))
    with_adapter = config.expert("a").model_copy(update={"adapter": str(adapter_dir)})
    expert = LocalExpert.load(with_adapter)
    ids = [5, 17, 42, 9, 3, 11]
    got = expert.score("s", ids, 4)  # (4, V): the logits predicting the last 4 ids
    expert.release(["s"])
    by_hand = merged_by_hand(tiny_dir, adapter_dir)(torch.tensor([ids])).logits[0, -5:-1]
    assert torch.allclose(got.float(), by_hand, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        assert torch.allclose(got.float(), unmerged(torch.tensor([ids])).logits[0, -5:-1], atol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)(torch.tensor([ids]))
    assert not torch.allclose(got.float(), plain.logits[0, -5:-1], atol=1e-3)  # the adapter changed it


def test_an_adapter_expert_fused_alone_decodes_as_peft_generates(tiny_dir, adapter_dir):
    data = tiny_config_dict(tiny_dir, names=("a",))
    data["experts"][0]["adapter"] = str(adapter_dir)
    service = FusionService.from_config(parse_config(data))
    try:
        rule, weights = service.resolve_spec(None)
        prompt = [5, 17, 42, 9]
        request = GenerationRequest([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
                                    rule, weights)
        fused = [e.token_id for e in service.engine.generate(request)]
    finally:
        service.close()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        out = peft_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  min_new_tokens=12, pad_token_id=0)
    assert fused == out[0, len(prompt):].tolist()


def test_a_missing_adapter_is_a_clear_error(tiny_dir, tmp_path):
    config = parse_config(tiny_config_dict(tiny_dir, names=("a",))).expert("a")
    with pytest.raises(AssetError, match="no PEFT adapter"):
        LocalExpert.load(config.model_copy(update={"adapter": str(tmp_path / "nowhere")}))
