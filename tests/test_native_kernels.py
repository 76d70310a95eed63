"""`fusion/forward/native_kernels.py`: the project's own quantized products against their plain references (the
weights' codes times the activations' integer codes, in float64), their build and its cache, the switch that
turns them off, and the custom operators a compiled step calls."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusion.forward.quantized as quantized
from fusion.forward import native_kernels
from fusion.forward.quantized import QuantizedLinear, quantize_int4, quantize_int8


@contextlib.contextmanager
def _other_build(tmp_path, flags):
    """Within the block, the kernels are the library built with `flags` (in a cache of its own); after it, the
    usual build again."""
    flags = tuple(flags)  # read before FLAGS is replaced (`flags` may be made from it)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_kernels, "_cache_dir", lambda: tmp_path)
        patch.setattr(native_kernels, "FLAGS", flags)
        native_kernels.library.cache_clear()
        try:
            yield
        finally:
            native_kernels.library.cache_clear()


def _int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (N, K) in [0, 15] and their scales and biases (N, 2, K/32) float16 of a random weight."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    codes, scales, offsets = quantize_int4(weight)
    return codes, quantized.native_scale_bias(scales, offsets)


def _packed(codes: torch.Tensor, scale_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layouts of `_int4`'s codes and scales and biases."""
    return native_kernels.pack_nibbles(codes), native_kernels.pack_scale_bias(scale_bias)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_product_is_its_reference(rows, dtype):
    codes, scale_bias = _int4(80, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, :32] = 0  # an all-zero group: its codes are all 0
    x[-1, 64] = 40.0  # an outlier: its group keeps two bytes a code, the others one
    got = native_kernels.int4_mm(x, *_packed(codes, scale_bias))
    assert got.shape == (rows, 80) and got.dtype == dtype
    want = native_kernels.int4_mm_reference(x, codes, scale_bias)
    # float32 sums; the output rounded once to the activations' dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_int8_product_is_its_reference(rows):
    weight = torch.randn(72, 96, generator=torch.Generator().manual_seed(rows))
    codes, scales = quantize_int8(weight)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2)) * 3
    got = native_kernels.int8_mm(x, codes, scales)
    torch.testing.assert_close(got.double(), native_kernels.int8_mm_reference(x, codes, scales), rtol=1e-5, atol=1e-4)


def test_rows_are_computed_alone():
    """A row's product does not depend on the rows beside it (a batched step equals steps alone)."""
    codes, scale_bias = _int4(48, 64, seed=3)
    nibbles, scale_bias = _packed(codes, scale_bias)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    together = native_kernels.int4_mm(x, nibbles, scale_bias)
    alone = torch.cat([native_kernels.int4_mm(x[i:i + 1], nibbles, scale_bias) for i in range(7)])
    assert torch.equal(together, alone)


def test_the_int8_weights_activations_reference_rounds_each_row_to_16_bit_codes():
    x = torch.tensor([[2.0, 1.0, -0.5, 0.25] + [0.0] * 60, [0.0] * 63 + [-3.0]])
    got = native_kernels.quantized_activations(x)  # (2, 64)
    step = 2.0 / 32767  # the first row's max over the largest code
    assert got[0, 0] == pytest.approx(2.0) and got[1, 63] == pytest.approx(-3.0)
    assert got[0, 1] == pytest.approx(16384 * step)  # 16383.5 rounds away from zero
    assert got[0, 2] == pytest.approx(-8192 * step)  # -8191.75
    assert got[0, 3] == pytest.approx(4096 * step)  # 4095.875
    assert torch.count_nonzero(got[1]) == 1


def test_the_int4_weights_activations_reference_rounds_each_group_to_its_own_codes():
    """A code per activation, 128 · 127 of them to a group's max|x|, a scale a group."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([2.0, 1.0, -0.5, 0.0])  # group 0: its max is 2.0
    x[0, 32] = -16256 / 16384  # group 1: its own scale, 1/16384 a code, whatever group 0 holds
    x[0, 33] = 0.5 / 16384  # exactly half a code: a tie, rounded to even (0)
    x[0, 34] = 1.5 / 16384  # one and a half codes: to even (2)
    got = native_kernels.grouped_activations(x)[0]  # (64,)
    step = 2.0 / 16256
    assert got[0] == pytest.approx(2.0) and got[32] == pytest.approx(-16256 / 16384)
    assert got[1] == pytest.approx(8128 * step)
    assert got[2] == pytest.approx(-4064 * step)
    assert got[33] == 0 and got[34] == pytest.approx(2 / 16384)


def test_a_group_without_outliers_keeps_one_byte_a_code():
    """A group whose max|x| is at most COARSE_SPREAD times its mean |x| rounds to 127 steps (codes of 128,
    halves up); one with an outlier keeps 128 · 127; `coarse_spread(0)` keeps every group's two bytes. The
    kernel takes the same codes (the products equal their reference with either)."""
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1.0, 1.0, 32)  # spread 2: one byte a code
    x[0, 32:] = 0.01
    x[0, 32] = 1.0  # spread 1 / ((1 + 31 · 0.01) / 32) ≈ 24: two bytes
    got = native_kernels.grouped_activations(x)[0]
    coarse = torch.floor(x[0, :32] * 127 + 0.5) / 127  # whole steps of max|x| / 127
    torch.testing.assert_close(got[:32], coarse.double(), rtol=0, atol=1e-7)
    assert got[33] == pytest.approx(round(0.01 * 16256) / 16256)  # 162.56 codes: not a multiple of 128
    with native_kernels.coarse_spread(0):
        fine = native_kernels.grouped_activations(x)[0]
    torch.testing.assert_close(fine[:32], (torch.round(x[0, :32] * 16256) / 16256).double(), rtol=0, atol=1e-7)
    assert (fine[:32] - x[0, :32].double()).abs().max() < (got[:32] - x[0, :32].double()).abs().max()
    codes, scale_bias = _int4(16, 64, seed=5)
    for spread in (native_kernels.COARSE_SPREAD, 0):
        with native_kernels.coarse_spread(spread):
            want = native_kernels.int4_mm_reference(x, codes, scale_bias)
            got = native_kernels.int4_mm(x, *_packed(codes, scale_bias)).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_spread_setting_comes_from_the_environment(monkeypatch):
    """FUSION_INT4_COARSE_SPREAD sets the spread (unset: 4); anything but a whole number is refused by name.
    In a fresh process the setting reaches the loaded kernels: a group without outliers then keeps two bytes."""
    import subprocess
    import sys

    monkeypatch.delenv("FUSION_INT4_COARSE_SPREAD", raising=False)
    assert native_kernels._spread_setting() == 4
    monkeypatch.setenv("FUSION_INT4_COARSE_SPREAD", "6")
    assert native_kernels._spread_setting() == 6
    for bad in ("abc", "-1", "2.5", ""):
        monkeypatch.setenv("FUSION_INT4_COARSE_SPREAD", bad)
        with pytest.raises(ValueError, match="FUSION_INT4_COARSE_SPREAD"):
            native_kernels._spread_setting()
    probe = ("import torch; from fusion.forward import native_kernels as nk; x = torch.linspace(-1.0, 1.0, 32)[None]; "
             "print(nk.COARSE_SPREAD, nk.available(), nk._coarse_spread, "
             "float(((y := nk.grouped_activations(x)[0] * 16256 / 128) - y.round()).abs().max()))")
    env = {**os.environ, "FUSION_INT4_COARSE_SPREAD": "0"}
    spread, available, loaded, off_grid = subprocess.run([sys.executable, "-c", probe], env=env, check=True,
                                                         capture_output=True, text=True).stdout.split()
    assert (spread, available, loaded) == ("0", "True", "0")
    assert float(off_grid) > 0.1  # codes between whole steps of 128: two bytes a code


def test_nibbles_pack_eight_outputs_a_block_two_codes_a_byte():
    codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0))
    packed = native_kernels.pack_nibbles(codes)
    assert packed.shape == (2, 256) and packed.dtype == torch.uint8
    # block 1, group 1, quad t = 2, output o = 3, input i = 1: byte 128 + 32·2 + 4·3 + 1
    byte = int(packed[1, 128 + 64 + 12 + 1])
    assert byte & 0x0F == codes[8 + 3, 32 + 16 + 1] and byte >> 4 == codes[8 + 3, 32 + 16 + 4 + 1]
    scale_bias = torch.randn(16, 2, 2).half()
    params = native_kernels.pack_scale_bias(scale_bias)
    assert params.shape == (2, 2, 2, 8) and params[1, 1, 0, 3] == scale_bias[11, 0, 1]
    assert params[0, 0, 1, 7] == scale_bias[7, 1, 0]


def test_the_library_is_built_once_and_kept_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(native_kernels, "_cache_dir", lambda: tmp_path)
    native_kernels.library.cache_clear()
    try:
        assert native_kernels.library() is not None
        built = list(tmp_path.glob("kernels-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        native_kernels.library.cache_clear()
        assert native_kernels.library() is not None
        assert [p.stat().st_mtime_ns for p in tmp_path.glob("kernels-*.so")] == [stamp]
    finally:
        native_kernels.library.cache_clear()


def test_without_the_kernels_projections_use_torchs(tmp_path, monkeypatch, caplog):
    """Switched off, or with a compiler that fails, the library is None and a quantized projection takes
    torch's kernel, with the same codes."""
    monkeypatch.setattr(native_kernels, "_cache_dir", lambda: tmp_path)
    linear = torch.nn.Linear(64, 32)
    try:
        monkeypatch.setenv(native_kernels.ENV_SWITCH, "0")
        native_kernels.library.cache_clear()
        assert native_kernels.library() is None
        assert QuantizedLinear.of(linear, "int4", torch.float32).kernel == "torch"
        monkeypatch.delenv(native_kernels.ENV_SWITCH)
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        native_kernels.library.cache_clear()
        with caplog.at_level("WARNING"):
            assert native_kernels.library() is None
        assert "false failed" in caplog.text
        assert quantized.default_kernel() == "torch"
    finally:
        monkeypatch.delenv("CC", raising=False)
        native_kernels.library.cache_clear()
    assert QuantizedLinear.of(linear, "int4", torch.float32).kernel == "native"
    # inputs not in whole groups of 32 keep torch's kernel
    assert QuantizedLinear.of(torch.nn.Linear(48, 32), "int8", torch.float32).kernel == "torch"


def test_the_build_without_avx512_gives_the_same_bits(tmp_path):
    """Where the machine has AVX-512's byte dot products (VNNI), the 4-bit products use them, sixteen outputs
    a vector; built without AVX-512 they use AVX2's multiply-adds. The integer sums are exact and each
    output's float operations the same, in the same order, so both builds give the same bits: products of
    several row counts, with an odd number of output blocks, and the C decode step. (On a machine without
    AVX-512 both builds are the AVX2 one.)"""
    from tests.test_native_decoder import _both, _inputs, _model
    from fusion.forward.llama import FastDecoder

    cases = [(24, 160, 7), (80, 160, 3), (96, 64, 1), (128, 96, 9)]  # (outputs, inputs, rows)
    data = []
    for n, k, rows in cases:
        codes, scale_bias = _int4(n, k, seed=rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
        x[-1, 40] = 30.0  # an outlier: its group keeps two bytes a code, the others one
        data.append((x, *_packed(codes, scale_bias)))
    model = _model("qwen2", torch.float32)
    inputs = _inputs(torch.bfloat16, 3, 3)

    def outputs():
        products = [native_kernels.int4_mm(*args) for args in data]
        step, _ = _both(FastDecoder(model), *inputs, spread=native_kernels.COARSE_SPREAD)
        return products, step

    native = outputs()
    with _other_build(tmp_path, (*native_kernels.FLAGS, "-mno-avx512f")):
        without = outputs()
    for got, want in zip(without[0] + list(without[1]), native[0] + list(native[1])):
        assert torch.equal(got, want)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="baseline x86-64 flags")
def test_the_plain_c_loops_compute_what_the_vector_ones_do(tmp_path):
    """Built for the baseline x86-64 (no AVX2, no F16C: the plain C loops and the portable float16
    conversion), the products are their references, and the decode step's layers in C give what the
    vectorised build gives."""
    from tests.test_native_decoder import _both, _inputs, _model
    from fusion.forward.llama import FastDecoder

    vector = {}
    model = _model("qwen2", torch.float32)
    inputs = _inputs(torch.bfloat16, 3, 3)
    vector["step"], _ = _both(FastDecoder(model), *inputs)
    with _other_build(tmp_path, ("-march=x86-64" if f == "-march=native" else f for f in native_kernels.FLAGS)):
        codes, scale_bias = _int4(80, 160, seed=2)
        x = torch.randn(5, 160)
        want = native_kernels.int4_mm_reference(x, codes, scale_bias)
        torch.testing.assert_close(native_kernels.int4_mm(x, *_packed(codes, scale_bias)).double(),
                                   want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        int8_codes, scales = quantize_int8(torch.randn(48, 160) * 0.1)
        want = native_kernels.int8_mm_reference(x, int8_codes, scales)
        torch.testing.assert_close(native_kernels.int8_mm(x, int8_codes, scales).double(), want, rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())
        from tests.test_logit_rows import _logits  # the route rule's passes: plain loops against torch

        z = _logits(1003)
        _, best, _, log_total, _ = native_kernels.logit_statistics(z.reshape(6, -1), -1e4)
        torch.testing.assert_close(best + log_total, torch.logsumexp(z, -1).reshape(6), rtol=1e-6, atol=1e-5)
        weights = torch.tensor([[0.5, 0.0], [0.0, 0.3], [0.5, 0.7]])
        normalizer = torch.logsumexp(z, -1)
        comp, weight, bias, scale = torch.randn(2, 3), torch.randn(3, 1003), torch.randn(1003), torch.tensor([1.0, 0.5])
        torch.testing.assert_close(native_kernels.mixture(z, torch.log(weights), normalizer, (comp, weight, bias, scale)),
                                   torch.logsumexp(torch.log(weights)[..., None] + z - normalizer[..., None], 0)
                                   + scale[:, None] * bias + comp @ weight, rtol=1e-5, atol=1e-4)
        plain, _ = _both(FastDecoder(model), *inputs)
        for got, want in zip(plain, vector["step"]):  # logits float32; new keys and values the cache's bf16
            tol = 1e-4 if got.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


def test_the_step_clocks_are_built_only_on_request_and_change_no_result(tmp_path):
    """benchmarks/step_parts.py's build (-DFUSION_STEP_CLOCKS) clocks the C step's phases and computes the
    same bits; the usual build has no clocks."""
    import ctypes

    from tests.test_native_decoder import _both, _inputs, _model
    from fusion.forward.llama import FastDecoder

    model = _model("llama", torch.float32)
    inputs = _inputs(torch.bfloat16, 3, 3)
    plain_step, _ = _both(FastDecoder(model), *inputs)
    assert native_kernels.library().fusion_step_clocks(None, 0) == 0
    with _other_build(tmp_path, (*native_kernels.FLAGS, "-DFUSION_STEP_CLOCKS")):
        library = native_kernels.library()
        phases = library.fusion_step_clocks(None, 0)  # also clears them
        clocked_step, _ = _both(FastDecoder(model), *inputs)
        seconds = (ctypes.c_double * phases)()
        assert library.fusion_step_clocks(seconds, phases) == phases
        again = (ctypes.c_double * phases)()
        library.fusion_step_clocks(again, phases)
    assert phases == 8 and all(s >= 0 for s in seconds) and seconds[1] > 0  # the products took time
    assert not any(again)  # reading cleared them
    for got, want in zip(clocked_step, plain_step):
        assert torch.equal(got, want)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cache_rows", [(1, 1), (3, 3), (3, 1)])
def test_attention_split_over_a_long_history_gives_the_same_bits(tmp_path, cache_dtype, rows, cache_rows):
    """From ATTEND_SPLIT_WIDTH cached columns, where the (row, kv head) tasks are fewer than two a thread,
    attention splits its work finer (decoder_step.c's attend_split: the scores by chunks of columns, the
    softmax by head, the values by eights of outputs). Over 300 columns, one row, or rows of different lengths
    (or one shared history) on four threads, the step is the torch step's, and a build that never splits
    gives the same bits."""
    from tests.test_native_decoder import _inputs, _model

    model = _model("llama", torch.float32)
    inputs = _inputs(cache_dtype, rows, cache_rows, width=300)
    _check_attention_split_or_not(model, inputs, tmp_path)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(3, 1, 64), (8, 2, 40), (8, 1, 16)])
@pytest.mark.parametrize("width", [40, 300])
def test_attention_over_head_shapes_is_the_torch_steps_split_or_not(tmp_path, heads, kv_heads, head_dim, width):
    """Attention's vector paths by head shape: SmolLM2's (3 query heads a kv head, 64 dims: four eights of
    outputs a pass over the values, two passes), 4 a kv head of 40 dims (two eights a pass, then one alone)
    and 8 of 16 (one eight a pass), over a short history and a long one (split, on four threads): the C
    step is the torch step's, and a build that never splits gives the same bits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusion.forward.quantized import quantize_model

    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    quantize_model(model, "int4", kernel="native")
    generator = torch.Generator().manual_seed(12)
    lengths = torch.tensor([width, width - 7, 5])
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).view(3, 1, 1, width)
    keys = [torch.randn(3, kv_heads, width + 3, head_dim, generator=generator).to(torch.bfloat16)[:, :, :width]
            for _ in range(2)]
    values = [torch.randn(3, kv_heads, width + 3, head_dim, generator=generator).to(torch.bfloat16)[:, :, :width]
              for _ in range(2)]
    inputs = (torch.tensor([5, 17, 40]), lengths, keys, values, mask)
    _check_attention_split_or_not(model, inputs, tmp_path)


def _check_attention_split_or_not(model, inputs, tmp_path) -> None:
    """The C step on `inputs` (3 rows or fewer, of 1 or 2 kv heads) on a team of four threads, where such rows
    are fewer than two tasks a thread, so that a long history splits: the torch step's, and the bits of a build
    that never splits."""
    from fusion.forward.llama import FastDecoder
    from tests.test_native_decoder import _both

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        step, reference = _both(FastDecoder(model), *inputs)
        for got, want in zip(step, reference):
            tol = 1e-3 if got.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                                       atol=tol * float(want.float().abs().max()))
        with _other_build(tmp_path, (*native_kernels.FLAGS, "-DATTEND_SPLIT_WIDTH=1000000")):
            unsplit, _ = _both(FastDecoder(model), *inputs)
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(unsplit, step):
        assert torch.equal(got, want)


# -- the C boundary -------------------------------------------------------------------------------------
def _bad_calls():
    """(what is wrong, a call into the kernels with it, the words the refusal must hold)."""
    codes, scale_bias = _int4(16, 64, seed=0)
    nibbles, params = _packed(codes, scale_bias)
    int8_codes, scales = quantize_int8(torch.randn(8, 64))
    x = torch.randn(2, 64)
    logits = torch.randn(2, 3, 50)
    return [
        ("int4: rows not whole groups", lambda: native_kernels.int4_mm(torch.randn(2, 48), nibbles, params),
         "multiple of 32"),
        ("int4: nibbles of another width", lambda: native_kernels.int4_mm(torch.randn(2, 96), nibbles, params),
         "nibbles must have shape"),
        ("int4: nibbles not bytes", lambda: native_kernels.int4_mm(x, nibbles.to(torch.int16), params),
         "nibbles must be uint8"),
        ("int4: scale_bias of another block count", lambda: native_kernels.int4_mm(x, nibbles, params[:1].contiguous()),
         "scale_bias must have shape"),
        ("int4: strided nibbles", lambda: native_kernels.int4_mm(x, torch.cat([nibbles, nibbles], 1)[:, ::2], params),
         "nibbles must be contiguous"),
        ("int8: codes of another width", lambda: native_kernels.int8_mm(torch.randn(2, 32), int8_codes, scales),
         "codes must have shape"),
        ("int8: scales too short", lambda: native_kernels.int8_mm(x, int8_codes, scales[:4]), "scales must have shape"),
        ("int8: scales of another dtype", lambda: native_kernels.int8_mm(x, int8_codes, scales.double()),
         "scales must be float32"),
        ("int8: rows on the meta device", lambda: native_kernels.int8_mm(x.to("meta"), int8_codes, scales),
         "rows must be on the CPU"),
        ("statistics: one axis", lambda: native_kernels.logit_statistics(torch.randn(50), -30.0),
         "rows must have shape"),
        ("rms norm: a weight of another width", lambda: native_kernels.rms_norm(x, torch.ones(32), 1e-5),
         "weight must have shape"),
        ("mixture: weights of other experts", lambda: native_kernels.mixture(logits, torch.zeros(3, 3), torch.zeros(2, 3)),
         "log_weights must have shape (2, 3)"),
        ("mixture: a scale of other rows", lambda: native_kernels.mixture(
            logits, torch.zeros(2, 3), torch.zeros(2, 3),
            (torch.zeros(3, 4), torch.zeros(4, 50), torch.zeros(50), torch.ones(5))), "scale must have shape (3,)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[name for name, _, _ in _bad_calls()])
def test_every_entry_point_refuses_what_the_c_cannot_read_naming_it(case):
    _, call, words = _bad_calls()[case]
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",), ("-march=x86-64",), ("-DFUSION_STEP_CLOCKS",)],
                         ids=["native", "no-avx512", "baseline-x86-64", "step-clocks"])
def test_the_kernels_build_without_a_warning(tmp_path, flags):
    """Every build the project and its tests make, with -Wall -Wextra -Werror."""
    base = [f for f in native_kernels.FLAGS if not (f.startswith("-march=") and any(g.startswith("-march=") for g in flags))]
    result = subprocess.run(["gcc", *base, *flags, "-Wall", "-Wextra", "-Werror", str(native_kernels.SOURCE),
                             "-o", str(tmp_path / "kernels.so"), "-lm"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


def test_the_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The kernels' and the C step's tests again, in a process whose kernels are built with ASan and UBSan
    (any bad read, write or undefined operation aborts it), once."""
    runtime = [subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                              check=True).stdout.strip() for name in ("libasan.so", "libubsan.so")]
    env = {**os.environ, "CC": "gcc", "FUSION_CACHE_DIR": str(tmp_path), "LD_PRELOAD": " ".join(runtime),
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1",
           native_kernels.EXTRA_FLAGS_ENV: "-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined "
                                           "-fno-sanitize-recover=all"}
    tests = Path(__file__).parent
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             str(tests / "test_native_kernels.py"), str(tests / "test_native_decoder.py"),
                             "-k", "not sanitizers and not without_a_warning"],
                            env=env, capture_output=True, text=True, timeout=1800, cwd=tests.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert re.search(r"\d+ passed", result.stdout) and "failed" not in result.stdout
    assert list(tmp_path.glob("kernels/kernels-*.so")), "no sanitized build was made"
