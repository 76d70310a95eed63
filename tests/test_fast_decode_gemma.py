"""Gemma 2's and Gemma 3's fast decode step (fusion.forward.gemma) against the plain reference: a
separately loaded copy of the model, uncached, over each whole history, past its sliding window, and its
own greedy `generate`."""

from __future__ import annotations

import pytest
import torch

from fusion.experts.expert import StepRequest
from fusion.forward.llama import unsupported_reason
from fusion.forward.gemma import GemmaDecoder
from tests.test_fast_decode import _expert

WINDOW = 6


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def gemma_dir(request, tmp_path_factory, tiny_dir):
    """A tiny Gemma 3: sliding-window and full-attention layers with their own rotary tables (the full
    one linearly scaled), grouped keys, and random norm weights (Gemma's norms apply 1 + w); or a tiny
    Gemma 2: one rotary table, no head norms, attention scores and logits soft-capped (caps low enough
    that the tanh bends them)."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    path = tmp_path_factory.mktemp(request.param) / "g"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tok")
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=0, bos_token_id=None)
    if request.param == "gemma2":
        torch.manual_seed(12)
        model = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=1.5, final_logit_softcapping=4.0))
    else:
        torch.manual_seed(11)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _plain_last_logits(model, history) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([history])).logits[0, -1]  # (V,)


def test_gemma_fast_steps_equal_plain_forwards_past_the_window_and_greedy_generate(gemma_dir):
    expert, reference = _expert(gemma_dir), _reference(gemma_dir)
    assert isinstance(expert._fast_step.decoder, GemmaDecoder)
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 40))}
    for _ in range(3 * WINDOW):  # both sessions well past the window; each steps alone (sliding layers)
        got = expert.step([StepRequest(s, h) for s, h in histories.items()])
        for (s, history), row in zip(histories.items(), got):
            torch.testing.assert_close(row, _plain_last_logits(reference, history), rtol=1e-4, atol=1e-4)
            histories[s] = history + [int(row.argmax())]
    assert expert.fast_decode_steps >= 2 * (3 * WINDOW - 1)  # all but each prompt's prefill
    with torch.no_grad():
        generated = reference.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=3 * WINDOW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
    assert histories["s1"] == generated[0].tolist()


def test_gemma_lookahead_rows_read_the_session_cache_and_adoption_appends(gemma_dir):
    """One-id extensions after one history are rows of one fast step over the session's own layers
    (sliding-window ones included); the adopted row's column is appended, past the window too."""
    expert, reference = _expert(gemma_dir), _reference(gemma_dir)
    history = [5, 17, 42, 9]
    for _ in range(2 * WINDOW):
        expert.extend("s", history, [[]])
        steps = expert.fast_decode_steps
        extensions = [[3], [40], [7]]
        out = expert.extend("s", history, extensions)
        assert expert.fast_decode_steps == steps + 1
        for row, ext in zip(out, extensions):
            torch.testing.assert_close(row, _plain_last_logits(reference, history + ext), rtol=1e-4, atol=1e-4)
        chosen = extensions[len(history) % 3]
        before = expert.cache.misses
        again = expert.extend("s", history + chosen, [[]])
        assert expert.cache.misses == before  # adopted, nothing computed
        torch.testing.assert_close(again[0], _plain_last_logits(reference, history + chosen), rtol=1e-4, atol=1e-4)
        history = history + chosen
    assert len(history) > 2 * WINDOW
    expert.release(["s"])


def test_gemma_has_no_static_step_and_refuses_what_it_does_not_compute(gemma_dir):
    model = _reference(gemma_dir)
    assert "sliding windows" in unsupported_reason(model, static=True)  # (decode: static refuses it)
    assert unsupported_reason(model) is None
    model.config.use_bidirectional_attention = True
    assert "bidirectional" in unsupported_reason(model)
    assert _expert(gemma_dir, "transformers")._fast_step is None
