"""`fusion/forward/quantized.py`: 8- and 4-bit weight-only projections against the plain reference (the product
with the weight their codes stand for), the model's own forward through them against the fast decode
step, experts with quantized weights end to end, and the config's checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import fusion.forward.kv_cache as kv_cache
import fusion.forward.quantized as quantized
from fusion.forward import native_kernels
from fusion.config import parse_config
from fusion.errors import ConfigError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward.llama import FastDecoder
from fusion.forward.quantized import (INT4_GROUP, QuantizedLinear, dequantize_int4, fused_projection, int4_row_block,
                              quantize_int4, quantize_int8, quantize_model, quantized_bytes)
from fusion.experts.shared_base import load_local_experts
from tests.conftest import tiny_config_dict


def _linear(n: int, k: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.2)
    return linear


KERNELS = pytest.mark.parametrize("kernel", quantized.KERNELS)


@pytest.fixture
def default_kernel(request, monkeypatch) -> str:
    """Every projection quantized in the test uses the parametrized kernel."""
    monkeypatch.setattr(quantized, "default_kernel", lambda: request.param)
    return request.param


DEFAULT_KERNELS = pytest.mark.parametrize("default_kernel", quantized.KERNELS, indirect=True)


def _dequantized(q: QuantizedLinear, linear: torch.nn.Linear) -> torch.Tensor:
    """The weight (N, K) float32 that `q`'s codes stand for, from the quantization functions alone."""
    if q.weights == "int8":
        codes, scales = quantize_int8(linear.weight)
        return codes.float() * scales.to(q.scales.dtype).float()[:, None]
    codes, scales, offsets = quantize_int4(linear.weight)
    if q.kernel == "native":  # w = q·s + b, both float16
        scales, biases = quantized.native_scale_bias(scales, offsets).float().unbind(1)
        return (codes.float().view(codes.shape[0], -1, 32) * scales[..., None] + biases[..., None]).view(codes.shape)
    dtype = q.scales_offsets.dtype
    return dequantize_int4(codes, scales.to(dtype).float(), offsets.to(dtype).float())


def _reference(q: QuantizedLinear, linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What `q(x)` computes, float32, from the quantization functions and plain products: torch's kernels
    multiply the activations as they are; the native ones multiply their 16-bit codes
    (`native_kernels.quantized_activations`) with the weights' codes, and the 4-bit biases with the
    activations as they are."""
    rows = x.reshape(-1, x.shape[-1])
    if q.kernel == "torch":
        out = rows.double() @ _dequantized(q, linear).double().T
    elif q.weights == "int8":
        codes, scales = quantize_int8(linear.weight)
        out = native_kernels.int8_mm_reference(rows, codes, scales)
    else:
        codes, scales, offsets = quantize_int4(linear.weight)
        out = native_kernels.int4_mm_reference(rows, codes, quantized.native_scale_bias(scales, offsets))
    return (out + linear.bias.detach().double()).float().view(*x.shape[:-1], -1)


@KERNELS
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_product_is_the_product_with_the_dequantized_weight(weights, dtype, kernel):
    linear = _linear(96, 128, seed=1)
    q = QuantizedLinear.of(linear, weights, dtype, kernel)
    assert q.kernel == kernel
    x = torch.randn(5, 3, 128).to(dtype)  # (B, S, K): leading axes kept
    got = q(x)
    assert got.shape == (5, 3, 96) and got.dtype == dtype
    want = _reference(q, linear, x)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # and the codes are close to the weight itself (the quantization error is bounded by half a step)
    error = (_dequantized(q, linear) - linear.weight.detach()).abs().max()
    assert error < (0.2 * 4 / (127 if weights == "int8" else 7.5))


@KERNELS
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_products_of_many_rows_use_the_dense_weight_the_codes_came_from(weights, kernel):
    """From DENSE_FROM_ROWS rows on (prefill, many sessions) the product is the dense one, exactly, with
    no copy of a lone projection's weight; below, the codes'."""
    linear = _linear(64, 128, seed=4)
    q = QuantizedLinear.of(linear, weights, torch.float32, kernel)
    assert q.dense.untyped_storage().data_ptr() == linear.weight.untyped_storage().data_ptr()
    many = torch.randn(quantized.DENSE_FROM_ROWS, 128)
    torch.testing.assert_close(q(many), F.linear(many, linear.weight, linear.bias), rtol=0, atol=0)
    few = many[: quantized.DENSE_FROM_ROWS - 1]
    torch.testing.assert_close(q(few), _reference(q, linear, few), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(q(few), F.linear(few, linear.weight, linear.bias), rtol=0, atol=1e-6)


def test_q4_1_weights_get_their_own_codes_back():
    """A weight dequantized from Q4_1 blocks (w = d·q + m, each block spanning codes 0..15, as llama.cpp's
    quantizer makes them) quantizes back to the same codes, scales and offsets."""
    gen = torch.Generator().manual_seed(3)
    n, k = 32, 4 * INT4_GROUP
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    codes[:, ::INT4_GROUP] = 0
    codes[:, 1::INT4_GROUP] = 15
    d = torch.rand(n, k // INT4_GROUP, generator=gen) * 0.05 + 0.01
    m = torch.randn(n, k // INT4_GROUP, generator=gen) * 0.1
    weight = (codes.view(n, -1, INT4_GROUP).float() * d[..., None] + m[..., None]).view(n, k)
    got_codes, scales, offsets = quantize_int4(weight)
    assert torch.equal(got_codes, codes)
    torch.testing.assert_close(scales, d, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(offsets, m + 8 * d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dequantize_int4(got_codes, scales, offsets), weight, rtol=0, atol=1e-6)


def _tiny_llama(hidden: int, heads: int, kv_heads: int, seed: int = 5) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=160, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@DEFAULT_KERNELS
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("hidden,kv_heads", [(128, 4), (64, 2)])
def test_siblings_are_the_rows_of_one_matrix(weights, hidden, kv_heads, default_kernel):
    """Query/key/value (and gate/up) become rows of one quantized matrix: views of its codes where the
    packed layout splits at their rows, copies elsewhere; either way each sibling's product is its
    slice of the whole one, and the model's forward is unchanged by building the fast decoder."""
    model = _tiny_llama(hidden, 4, kv_heads)
    quantize_model(model, weights)
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    whole = fused_projection(parts)
    assert whole is not None and whole.out_features == sum(p.out_features for p in parts)
    x = torch.randn(3, hidden)
    torch.testing.assert_close(torch.cat([p(x) for p in parts], -1), whole(x), rtol=1e-5, atol=1e-5)
    bounds = [p.fused_rows for p in parts]
    views = [weights == "int8" or default_kernel == "native"  # the native layout splits at any row
             or (a % int4_row_block() == 0 and b % int4_row_block() == 0) for a, b in bounds]
    codes = "nibbles" if weights == "int4" and default_kernel == "native" else "codes"
    shares = [getattr(p, codes).untyped_storage().data_ptr() == getattr(whole, codes).untyped_storage().data_ptr()
              for p in parts]
    assert shares == views
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids).logits
        decoder = FastDecoder(model)
        after = model(ids).logits
    assert decoder.qkv[0] is whole
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert 0 < quantized_bytes(model) < sum(p.numel() * p.element_size() for p in _tiny_llama(hidden, 4, kv_heads).parameters())


def _expert(path, weights: str, decode: str = "fast") -> LocalExpert:
    config = parse_config({"experts": [{"name": "x", "model": str(path), "dtype": "float32", "decode": decode,
                                        "weights": weights}]})
    return LocalExpert.load(config.experts[0])


@DEFAULT_KERNELS
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_fast_decode_equals_the_quantized_models_forward(tiny_dir, monkeypatch, weights, default_kernel):
    """The fast decode step over quantized projections, batched and alone, through buffer growths, gives
    the logits of the same model's uncached forward (transformers' own, through the same projections;
    every product from the codes, however many rows)."""
    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 2)
    monkeypatch.setattr(quantized, "DENSE_FROM_ROWS", 10**9)
    expert = _expert(tiny_dir / "c", weights)
    assert isinstance(expert.model.lm_head, QuantizedLinear) and expert.model.lm_head.weights == "int8"
    assert isinstance(expert.model.model.layers[1].mlp.down_proj, QuantizedLinear)
    assert expert.model.model.layers[1].mlp.down_proj.kernel == default_kernel
    assert expert.info.vocab_size == expert.model.lm_head.out_features
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 55)), "s3": [8, 9]}
    # The native kernels' activation codes are a row's max / 32767 (int8) or a group's max / 16256 (int4,
    # kept so by `coarse_spread(0)`; at one byte a code, 127 steps) apart: inputs that differ in their last
    # float bits (the cached step against the uncached forward) can round to neighbouring codes.
    tol = 1e-4 if default_kernel == "torch" else 1e-3

    def step(names):
        with native_kernels.coarse_spread(0):
            got = expert.step([StepRequest(s, histories[s]) for s in names])
        with torch.no_grad(), native_kernels.coarse_spread(0):
            want = torch.stack([expert.model(torch.tensor([histories[s]])).logits[0, -1] for s in names])
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]

    for _ in range(6):
        step(["s1", "s2", "s3"])
    for _ in range(2):
        step(["s2"])
    assert expert.fast_decode_steps >= 7  # all but the first (the prefill)


@DEFAULT_KERNELS
def test_quantized_logits_stay_close_to_the_dense_ones(tiny_dir, default_kernel):
    """Quantization moves the next-token distribution a little, int8 less than int4 (KL per position),
    every product from the codes (`codes_only`); without it, a long text takes the dense weight."""
    dense = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        reference = F.log_softmax(dense(ids).logits[0], -1)
    kl = {}
    for weights in ("int8", "int4"):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32).eval()
        quantize_model(model, weights)
        with torch.no_grad(), quantized.codes_only():
            got = F.log_softmax(model(ids).logits[0], -1)
        kl[weights] = float((reference.exp() * (reference - got)).sum(-1).mean())
        with torch.no_grad():
            torch.testing.assert_close(F.log_softmax(model(ids).logits[0], -1), reference, rtol=1e-5, atol=1e-5)
    assert 0 < kl["int8"] < kl["int4"] < 0.05, kl


@DEFAULT_KERNELS
def test_shared_base_with_quantized_weights_runs_adapters_on_both_paths(tiny_dir, tmp_path, monkeypatch, default_kernel):
    """Adapters over a quantized base: the fast joint step equals transformers' forward through the
    adapted quantized projections (the reference for that base)."""
    monkeypatch.setattr(quantized, "DENSE_FROM_ROWS", 10**9)
    from tests.test_shared_base import histories, save_adapter

    adapter = save_adapter(tiny_dir, tmp_path / "one", seed=11)

    def group(decode):
        data = tiny_config_dict(tiny_dir, names=("a",))
        base = {**data["experts"][0], "weights": "int4", "decode": decode}
        data["experts"] = [{**base, "name": "plain"}, {**base, "name": "one", "adapter": str(adapter)}]
        return load_local_experts(parse_config(data).experts, str)

    fast, plain = group("fast"), group("transformers")
    assert fast[0].shared_base._fast_step is not None and plain[0].shared_base._fast_step is None
    assert isinstance(fast[0].shared_base.model.model.layers[0].self_attn.q_proj.base, QuantizedLinear)
    prompts = histories(4, seed=2)
    for step in range(4):
        parts = [(m, [StepRequest(f"s{k}", prompts[k]) for k in range(4) if k % 2 == i]) for i, m in enumerate(fast)]
        got = fast[0].shared_base.step_members(parts)
        want = plain[0].shared_base.step_members(
            [(plain[i], requests) for i, (_, requests) in enumerate(parts)])
        for g, w in zip(got, want):
            if default_kernel == "torch":
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            else:
                # The native kernels round activations to 16-bit codes: where the two paths' float sums
                # differ in the last bit, an activation on a rounding boundary takes the neighbouring
                # code, and later layers carry the difference on (the kernels themselves are tested
                # against their exact reference in test_native_kernels.py).
                assert (g - w).abs().max() <= 0.01 * w.abs().max()
                assert torch.equal(g.argmax(-1), w.argmax(-1))
        prompts = [p + [(5 * step + k) % 40 + 3] for k, p in enumerate(prompts)]
    assert fast[0].shared_base.fast_decode_steps > 0


def test_bad_weights_are_config_errors_naming_the_field(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="weights"):
        parse_config({"experts": [{"name": "x", "model": str(tiny_dir / "a"), "weights": "int3"}]})
    # a width the 4-bit groups do not divide: refused at load, naming the expert's field and why
    from transformers import AutoTokenizer

    model = _tiny_llama(48, 4, 2)
    model.save_pretrained(tmp_path / "narrow")
    AutoTokenizer.from_pretrained(tiny_dir / "tok").save_pretrained(tmp_path / "narrow")
    with pytest.raises(ConfigError, match=r"experts\.x\.weights: int4 .*multiple of the 4-bit group"):
        _expert(tmp_path / "narrow", "int4")
    assert _expert(tmp_path / "narrow", "int8").model.lm_head.weights == "int8"


@DEFAULT_KERNELS
@pytest.mark.parametrize("hidden,kv_heads", [(128, 4), (64, 2)])
def test_codes_come_back_from_the_cache_file_as_they_were_made(tmp_path, hidden, kv_heads, default_kernel):
    """A second quantization of the same model reads the codes the first wrote (views and copies alike)
    and computes the same logits; a damaged file is made again."""
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    path = tmp_path / "codes.safetensors"
    logits = []
    for _ in range(2):
        model = _tiny_llama(hidden, 4, kv_heads)
        quantize_model(model, "int4", path)
        with torch.no_grad():
            logits.append(model(ids).logits)
        assert fused_projection([model.model.layers[1].mlp.gate_proj, model.model.layers[1].mlp.up_proj]) is not None
    assert path.exists()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    # read back as the kernels need them: every buffer aligned for vector loads
    assert all(b.data_ptr() % 64 == 0 for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers())
    path.write_bytes(b"not a safetensors file")
    model = _tiny_llama(hidden, 4, kv_heads)
    quantize_model(model, "int4", path)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits[0], rtol=0, atol=0)


def test_an_experts_codes_are_kept_under_the_cache_and_named_by_what_made_them(tiny_dir, tmp_path):
    from fusion.forward.quantized import packed_cache_file

    config = parse_config({"experts": [{"name": "x", "model": str(tiny_dir / "a"), "dtype": "float32",
                                        "weights": "int8"}]}).experts[0]
    first = LocalExpert.load(config, compile_cache_dir=tmp_path / "compiled")
    files = list((tmp_path / "compiled" / "weights").glob("*.safetensors"))
    assert [f.name for f in files] == [packed_cache_file(tmp_path / "compiled" / "weights", str(tiny_dir / "a"),
                                                         "int8", "float32").name]
    assert packed_cache_file(tmp_path, str(tiny_dir / "a"), "int4", "float32") != files[0]
    assert len({packed_cache_file(tmp_path, str(tiny_dir / "a"), "int8", "float32", kernel=k).name
                for k in quantized.KERNELS}) == 2
    assert packed_cache_file(tmp_path, str(tiny_dir / "b"), "int8", "float32").name != files[0].name
    second = LocalExpert.load(config, compile_cache_dir=tmp_path / "compiled")
    ids = [5, 17, 42, 9]
    torch.testing.assert_close(second.step([StepRequest("s", ids)]), first.step([StepRequest("s", ids)]),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bf16_instructions", [True, False])
def test_native_bfloat16_projections_keep_the_dense_weight_only_where_it_is_fast(monkeypatch, bf16_instructions):
    """Without AVX-512 bfloat16 instructions the native codes serve every product of a bfloat16 model (its
    dense product is the slow one there) and the dense weight is dropped; with them, or in float32, or
    with torch's kernel, many rows still take the dense weight."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_instructions)
    linear = _linear(64, 128, seed=4).to(torch.bfloat16)
    native = QuantizedLinear.of(linear, "int4", torch.bfloat16, "native")
    assert (native.dense is not None) == bf16_instructions
    many = torch.randn(quantized.DENSE_FROM_ROWS + 8, 128, dtype=torch.bfloat16)
    dense_product = F.linear(many, linear.weight, linear.bias)
    assert torch.equal(native(many), dense_product) == bf16_instructions
    assert QuantizedLinear.of(linear, "int4", torch.bfloat16, "torch").dense is not None
    assert QuantizedLinear.of(_linear(64, 128, seed=4), "int4", torch.float32, "native").dense is not None
