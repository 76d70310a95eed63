"""The fast decode step against the plain reference: transformers' uncached forward over
each whole history, and the engine's tokens through transformers' own decode forward."""

from __future__ import annotations


import pytest
import torch

import fusion.forward.kv_cache as kv_cache
from fusion.config import SamplingParams, parse_config
from fusion.engine.types import GenerationRequest
from fusion.errors import ConfigError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward.ops import attend
from fusion.forward.llama import FastDecoder, unsupported_reason
from fusion.fuse.registry import make_rule
from tests.conftest import tiny_config_dict


def _expert(path, decode: str = "fast") -> LocalExpert:
    config = parse_config({"experts": [{"name": "x", "model": str(path), "dtype": "float32", "decode": decode}]})
    return LocalExpert.load(config.experts[0])


def _plain_last_logits(model, histories) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([h], device=model.device)).logits[0, -1] for h in histories])  # (B, V)


@pytest.mark.parametrize("model_name", ["llama", "qwen2", "qwen3", "llama3-rope", "mistral"])
def test_fast_decode_equals_plain_forwards_batched_and_alone(tiny_dir, qwen_dir, qwen3_dir, llama3_rope_dir,
                                                             mistral_dir, monkeypatch, model_name):
    """Sessions of different lengths decoded together (a cohort) and alone, through several buffer
    growths, a divergence (crop) and a prompt chunk, give the logits of an uncached forward."""
    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 2)
    paths = {"llama": tiny_dir / "a", "qwen2": qwen_dir, "qwen3": qwen3_dir, "llama3-rope": llama3_rope_dir,
             "mistral": mistral_dir}
    expert = _expert(paths[model_name])
    assert expert._fast_step is not None
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 55)), "s3": [8, 9]}

    def step(names):
        got = expert.step([StepRequest(s, histories[s]) for s in names])
        torch.testing.assert_close(got, _plain_last_logits(expert.model, [histories[s] for s in names]),
                                   rtol=1e-4, atol=1e-4)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]

    for _ in range(8):
        step(["s1", "s2", "s3"])
    for _ in range(3):
        step(["s2"])  # alone: the single-session fast path over its own (copied-out) cache
    histories["s1"] = histories["s1"][:-2] + [11, 12, 13]  # diverges: crop + a 3-id chunk (transformers)
    for _ in range(4):
        step(["s1", "s2", "s3"])
    assert expert.fast_decode_steps >= 13


def test_fast_decoder_shares_the_models_weights(tiny_dir):
    """The fused projections are the model's own storage: the model's forward still works, unchanged."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "b", dtype=torch.float32).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids).logits
        decoder = FastDecoder(model)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == decoder.qkv[0].untyped_storage().data_ptr()


def _greedy_tokens(tiny_dir, decode: str, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    from fusion.frontdoor.service import FusionService

    data = tiny_config_dict(tiny_dir)
    for expert in data["experts"]:
        expert["decode"] = decode
    service = FusionService.from_config(parse_config(data))
    try:
        engine = service.engine
        rule = make_rule("weighted_logits", {}, engine.names)
        requests = [GenerationRequest([p] * 3, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True), rule, [0.5, 0.3, 0.2])
                    for p in prompts]
        events = engine.generate_many(requests)
        assert all(e.fast_decode_steps > 0 for e in engine.experts) == (decode != "transformers")
        return [[ev.token_id for ev in events[r.request_id]] for r in requests]
    finally:
        service.close()


def test_fast_decode_generates_the_tokens_of_transformers_decode(tiny_dir):
    prompts = [[5, 17, 42, 7], list(range(40, 70)), [9]]
    assert _greedy_tokens(tiny_dir, "fast", prompts) == _greedy_tokens(tiny_dir, "transformers", prompts)


def test_unsupported_models_fall_back_or_refuse(tiny_dir, tmp_path):
    """A model the fast step cannot run decodes through transformers under `fast`; `static` refuses it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "rope type 'dynamic'" in unsupported_reason(model)  # its frequencies change with the length
    path = tmp_path / "dynamic-rope"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir / "tok").save_pretrained(path)
    assert _expert(path, "fast")._fast_step is None
    assert unsupported_reason(model, static=True) is not None  # (decode: static refuses it)
    from transformers import LlamaConfig, LlamaForCausalLM

    biased = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, attention_bias=True))
    assert "output projection" in unsupported_reason(biased)
    with pytest.raises(ConfigError, match="decode"):
        parse_config({"experts": [{"name": "x", "model": "m", "decode": "jit"}]})


# -- on a CUDA device (benchmarks/gpu_check.sh; deselected elsewhere, the CPU tests above cover the same paths)
def _cuda_expert(path, decode: str) -> LocalExpert:
    config = parse_config({"experts": [{"name": "x", "model": str(path), "dtype": "float32", "device": "cuda",
                                        "decode": decode}]})
    return LocalExpert.load(config.experts[0])


@pytest.mark.cuda
def test_cuda_decode_equals_plain_forwards(tiny_dir, monkeypatch):
    """The captured step on a GPU (decode: fast), batched and alone, through buffer growths, gives the
    logits of an uncached forward."""
    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 2)
    expert = _cuda_expert(tiny_dir / "a", "fast")
    assert expert._static is not None and expert._static.captured > 0
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 55)), "s3": [8, 9]}
    for names in [["s1", "s2", "s3"]] * 6 + [["s2"]] * 3 + [["s1", "s3"]] * 3:
        got = expert.step([StepRequest(s, histories[s]) for s in names])
        torch.testing.assert_close(got, _plain_last_logits(expert.model, [histories[s] for s in names]).to(got.device),
                                   rtol=1e-3, atol=1e-3)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]
    assert expert.fast_decode_steps >= 10


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["fast", "transformers"])
def test_cuda_trio_overlapped_on_streams_equals_the_cpu_trio(tiny_dir, decode):
    """Three experts on one GPU (a CUDA stream and a pool thread each, overlapped; fast: each one's
    captured graphs replayed on the caller's stream) fuse to the CPU trio's logits."""
    from fusion.frontdoor.service import FusionService

    fused = {}
    for device in ("cpu", "cuda"):
        data = tiny_config_dict(tiny_dir)
        for expert in data["experts"]:
            expert["device"] = device
            expert["decode"] = decode if device == "cuda" else "transformers"
        service = FusionService.from_config(parse_config(data))
        try:
            engine = service.engine
            rule = make_rule("weighted_logits", {}, engine.names)
            batch = engine.new_batch()
            for prompt in ([5, 17, 42, 7], list(range(40, 70))):
                batch.add(engine.admit(GenerationRequest([prompt] * 3, SamplingParams(max_tokens=8, temperature=0.0),
                                                         rule, [0.5, 0.3, 0.2])))
            steps = []
            for _ in range(6):
                step = batch.fused_logits()
                steps.append(step.fused.cpu())
                batch.emit_tokens(step)
            fused[device] = torch.stack(steps)
            if device == "cuda":
                assert all(s is not None for s in engine._streams)
        finally:
            service.close()
    torch.testing.assert_close(fused["cuda"], fused["cpu"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_attention_written_out(dtype):
    """The decode steps' attention over masked cached columns and the row's own new column, eagerly and
    compiled, against softmax(q·k / sqrt(D)) · v in float64 with each kv head repeated for its group
    (within the dtype's rounding)."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, width = 6, 2, 8, 11
    step = attend
    compiled = torch.compile(step, dynamic=True)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for rows in (1, 2):
        q, k, v = (torch.randn(rows, h, dim, generator=generator).to(dtype) for h in (heads, kv_heads, kv_heads))
        keys, values = (torch.randn(rows, kv_heads, width, dim, generator=generator).to(dtype) for _ in range(2))
        filled = torch.tensor([7, 4][:rows])
        mask = (torch.arange(width)[None] < filled[:, None]).view(rows, 1, 1, width)
        expected = []
        for row in range(rows):
            n = int(filled[row])
            all_keys = torch.cat((keys[row, :, :n], k[row, :, None]), dim=1).double()  # (H_kv, n + 1, D)
            all_values = torch.cat((values[row, :, :n], v[row, :, None]), dim=1).double()
            all_keys, all_values = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (all_keys, all_values))
            scores = (q[row].double()[:, None, :] * all_keys).sum(-1) * dim ** -0.5  # (H, n + 1)
            expected.append((scores.softmax(-1)[:, :, None] * all_values).sum(1).reshape(heads * dim))
        expected = torch.stack(expected)  # (rows, H·D)
        for got in (step(q, k, v, keys, values, dim ** -0.5, mask), compiled(q, k, v, keys, values, dim ** -0.5, mask)):
            assert got.shape == (rows, heads * dim) and got.dtype == dtype
            torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_eager_cpu_attention_of_bf16_rounds_once():
    """An eager step on a CPU runs attention's products in float32 (`attention_dtype`: bf16 batched products
    of these shapes measured several times slower): bf16 queries, keys and values give the float64 result
    of those same values rounded once to bf16, where bf16 products would round the scores and the
    probabilities too."""
    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, width, rows = 6, 2, 64, 300, 3
    q, k, v = (torch.randn(rows, h, dim, generator=generator).bfloat16() for h in (heads, kv_heads, kv_heads))
    keys, values = (torch.randn(rows, kv_heads, width, dim, generator=generator).bfloat16() for _ in range(2))
    all_keys = torch.cat((keys, k[:, :, None]), dim=2).double().repeat_interleave(heads // kv_heads, dim=1)
    all_values = torch.cat((values, v[:, :, None]), dim=2).double().repeat_interleave(heads // kv_heads, dim=1)
    scores = (q.double()[:, :, None, :] * all_keys).sum(-1) * dim ** -0.5  # (rows, H, width + 1)
    expected = (scores.softmax(-1)[..., None] * all_values).sum(2).reshape(rows, heads * dim)
    got = attend(q, k, v, keys, values, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=2e-4)
