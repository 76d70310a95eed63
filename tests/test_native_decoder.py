"""The decode step's layers in the project's C step (fusion/forward/native_step.py) against the same
`FastDecoder` run as torch operators, on the same inputs: batched rows of different lengths (masked),
one shared history for every row, adapters per row, query/key/value biases, float32 and bfloat16."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fusion.forward import native_kernels
from fusion.forward.llama import DecodeStep, FastDecoder, decode_on_layers, prefill_on_layers
from fusion.forward.kv_cache import new_cache
from fusion.experts.multi_lora import LoraPair, MultiAdapter
from fusion.forward.native_step import NativeLayers, adapter_ranges, exactly_narrowed, output_spans
from fusion.forward.quantized import quantize_model


HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 3
HEAD_DIM = HIDDEN // HEADS


def _model(kind: str, dtype: torch.dtype, kernel: str = "native", weights: str = "int4", values_of=None):
    """`values_of`: a dtype the weights are rounded to first (the same model in a wider dtype)."""
    torch.manual_seed(3)
    common = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                  tie_word_embeddings=False)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))).eval()
    with torch.no_grad():  # biases away from zero, so that a missing one shows
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                bias = getattr(layer.self_attn, name).bias
                if bias is not None:
                    bias.normal_(0, 0.5)
    model = model.to(values_of or dtype).to(dtype)
    quantize_model(model, weights, kernel=kernel)
    return model


def _adapters(model, count: int = 2, dtype: torch.dtype = torch.float32) -> MultiAdapter:
    """`count` random LoRA adapters over every projection but o_proj (so one fused projection has none), their
    values `dtype`'s (bfloat16: as adapters saved in bfloat16 are)."""
    generator = torch.Generator().manual_seed(7)
    real_randn = torch.randn

    def randn(*shape, generator):  # N(0, 0.3²), rounded to `dtype`
        return (real_randn(*shape, generator=generator) * 0.3).to(dtype).float()

    adapters = []
    for _ in range(count):
        pairs = {}
        for index, layer in enumerate(model.model.layers):
            for path, linear in ((f"model.layers.{index}.self_attn.{n}", getattr(layer.self_attn, n))
                                 for n in ("q_proj", "k_proj", "v_proj")):
                pairs[path] = LoraPair(randn(4, linear.in_features, generator=generator),
                                       randn(linear.out_features, 4, generator=generator), 2.0)
            for name in ("gate_proj", "up_proj", "down_proj"):
                linear = getattr(layer.mlp, name)
                pairs[f"model.layers.{index}.mlp.{name}"] = LoraPair(
                    randn(4, linear.in_features, generator=generator),
                    randn(linear.out_features, 4, generator=generator), 2.0)
        adapters.append(pairs)
    return MultiAdapter(model, adapters, [f"adapter{k}" for k in range(count)])


def _inputs(dtype: torch.dtype, rows: int, cache_rows: int, width: int = 11):
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (rows,), generator=generator)
    lengths = torch.tensor([width, width - 4, 3][:rows]) if cache_rows == rows else torch.full((rows,), width)
    columns = torch.arange(width)
    mask = (columns[None, :] >= width - lengths[:, None])[:cache_rows if cache_rows == 1 else rows]
    # Buffers wider than the columns read, as a cache's spare capacity is: the strides are the buffers'.
    keys = [torch.randn(cache_rows, KV_HEADS, width + 5, HEAD_DIM, generator=generator).to(dtype)[:, :, :width]
            for _ in range(LAYERS)]
    values = [torch.randn(cache_rows, KV_HEADS, width + 5, HEAD_DIM, generator=generator).to(dtype)[:, :, :width]
              for _ in range(LAYERS)]
    return ids, lengths, keys, values, mask.view(mask.shape[0], 1, 1, width)


def _both(decoder: FastDecoder, *inputs, spread: int = 0):
    """The C step and the torch step on the same inputs. Their float sums differ in the last bits, which
    at one byte a code can round an activation a whole step apart: by default both steps' 4-bit products
    keep two bytes a code (`spread` 0), so that they compare closely."""
    with torch.no_grad(), native_kernels.coarse_spread(spread):
        decoder.native_layers = True
        native = decoder(*inputs)
        assert isinstance(decoder._native, NativeLayers)  # the C step ran
        decoder.native_layers = False
        reference = decoder(*inputs)
    return native, reference


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("cache_rows", [3, 1])
@pytest.mark.parametrize("with_adapters", [False, True])
def test_the_c_step_equals_the_torch_step_in_float32(kind, cache_rows, with_adapters, weights):
    """Three rows (their own masked histories, or one history for all), with and without a row per
    adapter: logits and new keys and values as the torch operators compute them. The products' integer
    activation codes are why not bit for bit: inputs that differ in their last float bits (the two steps
    sum in other orders) may round to neighbouring codes."""
    model = _model(kind, torch.float32, weights=weights)
    decoder = FastDecoder(model)
    rows = None
    if with_adapters:
        decoder.adapters = _adapters(model)
        rows = torch.tensor([-1, 0, 1])
    ids, lengths, keys, values, mask = _inputs(torch.float32, 3, cache_rows)
    (logits, new_keys, new_values), (want_logits, want_keys, want_values) = _both(
        decoder, ids, lengths, keys, values, mask, *(() if rows is None else (rows,)))
    assert (decoder.qkv[0].bias is not None) == (kind == "qwen2")
    tol = 1e-3
    torch.testing.assert_close(logits, want_logits, rtol=tol, atol=tol * float(want_logits.abs().max()))
    torch.testing.assert_close(new_keys, want_keys, rtol=tol, atol=tol * float(want_keys.abs().max()))
    torch.testing.assert_close(new_values, want_values, rtol=tol, atol=tol * float(want_values.abs().max()))
    if with_adapters:  # the adapters change the rows they run on
        decoder.adapters = None
        (plain, _, _), _ = _both(decoder, ids, lengths, keys, values, mask)
        assert (plain[1:] - logits[1:]).abs().max() > 0.1 * float(want_logits.abs().max())
        torch.testing.assert_close(plain[0], logits[0], rtol=tol, atol=tol * float(want_logits.abs().max()))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_row_of_the_c_step_does_not_depend_on_the_other_rows(weights):
    """Each row of an eight-row C step (past the 4-bit kernel's switch to two blocks a vector where AVX-512
    has it; adapters on some rows, histories of three lengths) is bit for bit that row's step alone: the
    products quantize each row on its own, attention reads the row's own columns, and no sum runs across
    rows. An exact replay of a session elsewhere would rest on this."""
    model = _model("qwen2", torch.float32, weights=weights)
    decoder = FastDecoder(model)
    decoder.adapters = _adapters(model)
    _, lengths, keys, values, mask = _inputs(torch.bfloat16, 3, 3)
    pick = torch.tensor([0, 1, 2, 2, 1, 0, 1, 2])
    ids = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(9))
    lengths, mask = lengths[pick], mask[pick]
    keys, values = [k[pick] for k in keys], [v[pick] for v in values]
    rows = torch.tensor([-1, 0, 1, -1, 1, 0, 0, -1])
    with torch.no_grad():
        together = decoder(ids, lengths, keys, values, mask, rows)
        assert isinstance(decoder._native, NativeLayers)  # the C step ran
        for b in range(8):
            alone = decoder(ids[b:b + 1], lengths[b:b + 1], [k[b:b + 1] for k in keys], [v[b:b + 1] for v in values],
                            mask[b:b + 1], rows[b:b + 1])
            assert torch.equal(together[0][b:b + 1], alone[0])  # logits (B, V)
            for both, one in zip(together[1:], alone[1:]):  # new keys and values (layers, B, H_kv, D)
                assert torch.equal(both[:, b:b + 1], one)


def test_the_c_step_over_a_bfloat16_cache_stays_close_to_the_torch_step():
    """A bfloat16 model: the C step keeps its activations in float32 where the torch step rounds each
    operator's result to bfloat16. Against the torch step run in float32 over the same codes and cache, the
    C step errs no more than the bfloat16 torch step does (give or take the float32 step's tolerance above)."""
    model = _model("llama", torch.bfloat16)
    decoder = FastDecoder(model)
    decoder.adapters = _adapters(model)
    rows = torch.tensor([1, -1, 0])
    ids, lengths, keys, values, mask = _inputs(torch.bfloat16, 3, 3)
    (logits, new_keys, _), (bf16_logits, bf16_keys, _) = _both(decoder, ids, lengths, keys, values, mask, rows)
    assert new_keys.dtype == torch.bfloat16
    wide = _model("llama", torch.float32, values_of=torch.bfloat16)  # the same weights, in float32
    decoder = FastDecoder(wide)
    decoder.adapters = _adapters(wide)
    decoder.native_layers = False
    with torch.no_grad(), native_kernels.coarse_spread(0):  # as `_both`'s steps
        truth, true_keys, _ = decoder(ids, lengths, [k.float() for k in keys], [v.float() for v in values], mask, rows)
    largest = float(truth.abs().max())
    assert (logits - truth).abs().max() <= (bf16_logits - truth).abs().max() + 1e-3 * largest
    assert (new_keys.float() - true_keys).abs().max() <= ((bf16_keys.float() - true_keys).abs().max()
                                                          + 1e-3 * float(true_keys.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_appending_writes_the_new_keys_and_values_after_the_columns_read(dtype):
    """With `append`, the C step writes each row's new key and value into the column after the views (the
    buffers' spare room), exactly what it returns without, and touches no other column."""
    model = _model("llama", dtype)
    decoder = FastDecoder(model)
    decoder.adapters = _adapters(model)
    ids, lengths, keys, values, mask = _inputs(dtype, 3, 3)
    width = keys[0].shape[2]
    rows = torch.tensor([1, -1, 0])
    before = [(k._base.clone(), v._base.clone()) for k, v in zip(keys, values)]
    with torch.no_grad():
        logits, want_keys, want_values = decoder(ids, lengths, keys, values, mask, rows)
        appended, none_keys, none_values = decoder(ids, lengths, keys, values, mask, rows, append=True)
    assert none_keys is None and none_values is None
    torch.testing.assert_close(appended, logits, rtol=0, atol=0)
    for layer, (k, v) in enumerate(zip(keys, values)):
        for buffer, old, want in ((k._base, before[layer][0], want_keys), (v._base, before[layer][1], want_values)):
            assert torch.equal(buffer[:, :, width], want[layer])
            others = torch.ones(buffer.shape[2], dtype=torch.bool)
            others[width] = False
            assert torch.equal(buffer[:, :, others], old[:, :, others])


def test_a_shared_history_is_never_appended_to():
    """One cached row for three: `append` is ignored and the new keys come back."""
    model = _model("llama", torch.float32)
    decoder = FastDecoder(model)
    ids, lengths, keys, values, mask = _inputs(torch.float32, 3, 1)
    with torch.no_grad():
        _, new_keys, _ = decoder(ids, lengths, keys, values, mask, append=True)
    assert new_keys.shape == (LAYERS, 3, KV_HEADS, HEAD_DIM)


def test_layers_the_c_step_cannot_run_stay_torch_operators():
    """Projections in torch's kernel layout: no table, and the torch step runs."""
    decoder = FastDecoder(_model("llama", torch.float32, kernel="torch"))
    assert NativeLayers.of(decoder) is None
    ids, lengths, keys, values, mask = _inputs(torch.float32, 3, 3)
    with torch.no_grad():
        logits, _, _ = decoder(ids, lengths, keys, values, mask)
    assert decoder._native is False and logits.shape == (3, 96)


def test_adapter_columns_must_each_be_one_run():
    assert adapter_ranges(torch.tensor([0, 0, 1, 1, 1]), 3).tolist() == [[0, 2], [2, 5], [0, 0]]
    assert adapter_ranges(torch.tensor([0, 1, 0]), 2) is None


def test_adapters_saved_in_bfloat16_are_read_as_such_and_give_the_same_step():
    """Adapters whose values bfloat16 holds exactly (scaled by a power of two) are read as bfloat16 by the C
    step: the same products, from half the bytes; others stay float32."""
    model = _model("llama", torch.float32)
    decoder = FastDecoder(model)
    decoder.adapters = _adapters(model, dtype=torch.bfloat16)
    ids, lengths, keys, values, mask = _inputs(torch.float32, 3, 3)
    (logits, _, _), (want, _, _) = _both(decoder, ids, lengths, keys, values, mask, torch.tensor([-1, 0, 1]))
    assert decoder._native.table[0].lora[0].is_bf16 == 1  # qkv's stack
    torch.testing.assert_close(logits, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    exact, inexact = torch.tensor([0.5, -0.375]), torch.tensor([0.1, 1.0])
    assert exactly_narrowed(exact).dtype == torch.bfloat16 and exactly_narrowed(inexact).dtype == torch.float32


def test_output_spans_bound_each_up_row_nonzeros():
    up = torch.zeros(3, 6)
    up[0, 1:3] = 1.0
    up[1, 4] = -2.0
    assert output_spans(up).tolist() == [[1, 3], [4, 5], [0, 0]]


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_by_row_is_bit_for_bit_its_ids_stepped_one_at_a_time(dtype, weights):
    """`prefill_on_layers` over 40 ids (past the 4-bit kernel's switch to two blocks a vector and the head's
    switch to its dense weight), in one call or in chunks of 7, 20 and 13, gives the logits, keys and values
    of stepping the ids one at a time: each row attends the columns before its own, packed, as a decode
    step attends the history it follows. A failed-over stream's history replayed this way continues bit
    for bit."""
    model = _model("qwen2", dtype, weights=weights)
    step = DecodeStep(model)
    step.decoder.adapters = _adapters(model)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    adapter = torch.tensor([1])
    with torch.no_grad():
        whole = new_cache(model.config).layers
        at_once = prefill_on_layers(step, whole, ids, adapter, num_logits=40)  # (40, V)
        assert isinstance(step.decoder._native, NativeLayers)
        chunked = new_cache(model.config).layers
        in_chunks = torch.cat([prefill_on_layers(step, chunked, ids[a:b], adapter, num_logits=b - a)
                               for a, b in ((0, 7), (7, 27), (27, 40))])
        stepped = new_cache(model.config).layers
        one_by_one = [prefill_on_layers(step, stepped, ids[:1], adapter)]
        for n in range(1, 40):
            one_by_one.append(decode_on_layers(step, stepped, ids[n:n + 1], [n], adapter))
    assert torch.equal(at_once, in_chunks)
    assert torch.equal(at_once, torch.cat(one_by_one))
    for a, b, c in zip(whole, chunked, stepped):
        assert a.get_seq_length() == b.get_seq_length() == c.get_seq_length() == 40
        assert torch.equal(a.keys, b.keys) and torch.equal(a.keys, c.keys)
        assert torch.equal(a.values, b.values) and torch.equal(a.values, c.values)
    # and the adapter's rows are its own: the base's differ
    with torch.no_grad():
        plain = prefill_on_layers(step, new_cache(model.config).layers, ids, None)
    assert not torch.equal(plain, at_once[-1:])


def test_a_row_attends_its_history_the_same_wherever_it_sits_in_the_batch():
    """Histories of 6 and 21 ids stepped alone and as rows of a batch whose other history is 30 ids long
    (left-padded by 24 and 9 columns): the attended columns' scores are packed before the softmax, so each
    row's logits and new keys are bit for bit the same (summed where they sit, the vector lanes would
    group other columns)."""
    model = _model("llama", torch.bfloat16)
    decoder = FastDecoder(model)
    generator = torch.Generator().manual_seed(4)
    width = 30
    keys = [torch.randn(3, KV_HEADS, width, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn(3, KV_HEADS, width, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]
    ids, lengths = torch.tensor([5, 17, 40]), torch.tensor([width, 6, 21])
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).view(3, 1, 1, width)
    with torch.no_grad():
        batch = decoder(ids, lengths, keys, values, mask)
        assert isinstance(decoder._native, NativeLayers)
        for row in (1, 2):
            pad = width - int(lengths[row])
            alone = decoder(ids[row:row + 1], lengths[row:row + 1], [k[row:row + 1, :, pad:] for k in keys],
                            [v[row:row + 1, :, pad:] for v in values],
                            torch.ones(1, 1, 1, width - pad, dtype=torch.bool))
            assert torch.equal(batch[0][row:row + 1], alone[0])
            assert torch.equal(batch[1][:, row:row + 1], alone[1]) and torch.equal(batch[2][:, row:row + 1], alone[2])


def test_rows_of_one_history_name_their_columns_within_those_given():
    model = _model("llama", torch.float32)
    decoder = FastDecoder(model)
    native = NativeLayers.of(decoder)
    keys = [torch.zeros(1, KV_HEADS, 4, HEAD_DIM) for _ in range(LAYERS)]
    x, cos, sin = torch.zeros(2, HIDDEN), torch.ones(2, HEAD_DIM), torch.zeros(2, HEAD_DIM)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="within the 4 columns"):
        native.run(x, cos, sin, keys, keys, mask, None, append=True, columns=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="one column a row of one history"):
        native.run(x, cos, sin, keys, keys, mask, None, append=False, columns=torch.tensor([2, 3]))


def test_the_c_step_refuses_caches_it_cannot_read_or_write_naming_them():
    native = NativeLayers.of(FastDecoder(_model("llama", torch.float32)))
    x, cos, sin = torch.zeros(2, HIDDEN), torch.ones(2, HEAD_DIM), torch.zeros(2, HEAD_DIM)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)

    def cache(width=4, heads=KV_HEADS, dtype=torch.float32, layers=LAYERS):
        return [torch.zeros(2, heads, width, HEAD_DIM, dtype=dtype) for _ in range(layers)]

    def refused(words, keys=None, values=None, **changes):
        keys = cache() if keys is None else keys
        args = {"x": x, "cos": cos, "sin": sin, "keys": keys, "values": cache() if values is None else values,
                "mask": mask, "adapter_rows": None, **changes}
        with pytest.raises(ValueError, match=re.escape(words)):
            native.run(**args)

    refused("one tensor a layer (3), got 2 and 3", keys=cache(layers=2))
    refused("keys[0] must have shape (*, 2, *, 16)", keys=cache(heads=1), values=cache(heads=1))
    refused("values[1] must be like keys[0]", values=cache()[:1] + cache(dtype=torch.bfloat16)[1:])
    refused("values[0] must be like keys[0]", values=[torch.zeros(2, KV_HEADS, 5, HEAD_DIM)] + cache()[1:])
    refused("mask must have shape (*, 4)", mask=torch.ones(2, 1, 1, 3, dtype=torch.bool))
    refused("x must have shape (*, 64)", x=torch.zeros(2, HIDDEN - 1))
    refused("cos must hold 16 or 2 x 16 values", cos=torch.ones(3, HEAD_DIM))
    refused("adapter_rows must lie in [-1, 0)", adapter_rows=torch.tensor([0, 1]))
    # appended keys go into the column past the view: a view over a buffer with no more columns is refused,
    # one over a buffer with room is taken
    refused("keys[0] has no room for the column appended at 4", append=True)
    # one row of a buffer with no spare column: its next column is the next head's first, within the storage
    full = [torch.zeros(2, KV_HEADS, 4, HEAD_DIM)[:1] for _ in range(LAYERS)]
    refused("keys[0]'s column 4 would overwrite another row's or head's columns", keys=full, values=full,
            append=True, x=torch.zeros(1, HIDDEN), cos=torch.ones(1, HEAD_DIM), sin=torch.zeros(1, HEAD_DIM))
    roomy = [torch.zeros(2, KV_HEADS, 5, HEAD_DIM)[:, :, :4] for _ in range(LAYERS)]
    out, _, _ = native.run(x, cos, sin, roomy, [torch.zeros(2, KV_HEADS, 5, HEAD_DIM)[:, :, :4] for _ in range(LAYERS)],
                           mask, None, append=True)
    assert out.shape == (2, HIDDEN) and bool(roomy[0][:, :, :4].eq(0).all())
