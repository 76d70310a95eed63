"""In-place key/value caches against transformers' own concatenating ones."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

import fusion.forward.kv_cache as kv_cache
from fusion.config import parse_config
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward.kv_cache import GrowingLayer, cache_holding, new_cache


def test_growing_layer_equals_dynamic_layer_through_appends_and_crops():
    torch.manual_seed(0)
    growing, plain = GrowingLayer(spare=2), DynamicLayer()
    reallocations, capacity = 0, 0
    for step, (op, n) in enumerate([("add", 5)] + [("add", 1)] * 40 + [("crop", -7), ("add", 3), ("crop", -1)]
                                   + [("add", 1)] * 30):
        if op == "add":
            keys, values = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 5)  # (B, H, n, D); D differs for V
            got, expected = growing.update(keys, values), plain.update(keys, values)
            assert all(torch.equal(g, e) for g, e in zip(got, expected)), step
        else:
            growing.crop(n)
            plain.crop(n)
        assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values), step
        assert growing.get_seq_length() == plain.get_seq_length()
        reallocations += growing.capacity != capacity
        capacity = growing.capacity
    assert growing.get_seq_length() == 5 + 40 - 7 + 3 - 1 + 30
    assert reallocations <= 8  # grows geometrically, not once per append
    with pytest.raises(ValueError, match="negative"):
        growing.crop(3)


def test_holding_copies_and_batch_selection():
    keys, values = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)
    layer = GrowingLayer.holding(keys, values, spare=1)
    keys.zero_()  # the layer holds its own copy
    assert layer.keys.abs().sum() > 0 and layer.capacity == 5
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.values, values[[2, 0]])
    layer.update(torch.ones(2, 2, 3, 8), torch.ones(2, 2, 3, 8))  # past the capacity: regrows
    assert layer.get_seq_length() == 7 and torch.equal(layer.values[:, :, :4], values[[2, 0]])


def _greedy_logits(model, cache, prompt, steps):
    """Logits of a greedy decode through `cache`: (steps, V)."""
    rows, ids = [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
            rows.append(logits)
            ids = logits.argmax().view(1, 1)
    return torch.stack(rows)


def test_model_decodes_the_same_through_growing_and_dynamic_caches(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32).eval()
    prompt = [5, 17, 42, 99, 7]
    expected = _greedy_logits(model, DynamicCache(config=model.config), prompt, 40)
    got = _greedy_logits(model, new_cache(model.config, spare=3), prompt, 40)  # regrows several times
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cache_holding_continues_a_prefill(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "b", dtype=torch.float32).eval()
    prompt = list(range(20, 36))
    prefilled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt[:-1]]), cache=prefilled, use_cache=True)
    copied = cache_holding([(layer.keys, layer.values) for layer in prefilled.layers], spare=0)
    expected = _greedy_logits(model, prefilled, prompt[-1:], 6)
    got = _greedy_logits(model, copied, prompt[-1:], 6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompts", [
    {"s1": [5, 17, 42], "s2": list(range(30, 60)), "s3": [8, 9]},
    {"s1": [5, 17, 42], "s2": [30, 31, 32]},  # equal lengths: no padding, the mask is all ones
    {"s1": [5, 17, 42]},  # one session: the unbatched decode path
])
def test_decode_past_buffer_growth_equals_plain_forwards(tiny_dir, monkeypatch, prompts):
    """Sessions decoded step by step (batched when several), with buffers small enough to regrow
    many times, give the logits of a plain uncached forward over each whole history."""
    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 2)
    config = parse_config({"experts": [{"name": "a", "model": str(tiny_dir / "a"), "dtype": "float32"}]})
    expert = LocalExpert.load(config.experts[0])
    assert expert._ready_made_decode_mask  # CPU + SDPA: decode steps pass their own 4D mask
    histories = {s: list(p) for s, p in prompts.items()}
    for step in range(24):
        requests = [StepRequest(s, h) for s, h in histories.items()]
        got = expert.step(requests)
        if step % 6 == 5:
            with torch.no_grad():
                expected = torch.stack([expert.model(torch.tensor([h])).logits[0, -1] for h in histories.values()])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for s, row in zip(histories, got):
            histories[s] = histories[s] + [int(row[:300].argmax())]
    assert all(isinstance(layer, GrowingLayer) for layer in expert.cache.get("s1").kv.layers)


def _plain_last_logits(model, histories):
    with torch.no_grad():
        return torch.stack([model(torch.tensor([h])).logits[0, -1] for h in histories])


def test_cohort_steps_in_place_and_rebuilds_when_its_sessions_change(tiny_dir, monkeypatch):
    """A batched step of the same sessions reuses the batch buffers (in any request order); sessions
    joining, leaving, diverging, scored alone or outgrowing the buffers make it rebuild. Every step's
    logits equal a plain uncached forward of each whole history."""
    import fusion.experts.batching as batching_module

    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 3)  # the batch outgrows its buffers every few steps
    built = []

    class CountingCohort(kv_cache.Cohort):
        def __init__(self, caches, spare=None):
            built.append(len(caches))
            super().__init__(caches, spare)

    monkeypatch.setattr(batching_module, "Cohort", CountingCohort)
    config = parse_config({"experts": [{"name": "a", "model": str(tiny_dir / "a"), "dtype": "float32"}]})
    expert = LocalExpert.load(config.experts[0])
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 50)), "s3": [8, 9, 10, 11]}

    def step(names):
        requests = [StepRequest(s, histories[s]) for s in names]
        got = expert.step(requests)
        torch.testing.assert_close(got, _plain_last_logits(expert.model, [histories[s] for s in names]),
                                   rtol=1e-4, atol=1e-4)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:300].argmax())]

    step(["s1", "s2", "s3"])  # batched prefill
    step(["s1", "s2", "s3"])  # first batched decode: builds the cohort
    assert built == [3]
    for names in (["s1", "s2", "s3"], ["s3", "s1", "s2"], ["s2", "s3", "s1"]) * 2:
        step(names)  # same sessions, any order: in place (through several buffer growths)
    assert built == [3]
    first = expert._cohort
    row_of_s3 = first.members.index(expert.cache.get("s3").kv)
    assert all(own.is_row_view(batch, row_of_s3, first.starts[row_of_s3])
               for own, batch in zip(expert.cache.get("s3").kv.layers, first.layers))
    step(["s1", "s2"])  # s3 sits out: rebuilt without it, s3 copied out of the old rows
    assert built == [3, 2]
    for own, batch in zip(expert.cache.get("s3").kv.layers, first.layers):
        assert not own.is_row_view(batch, row_of_s3, first.starts[row_of_s3]) and own.keys._base is not batch.keys._base
    step(["s1", "s2", "s3"])
    assert built == [3, 2, 3]
    histories["s2"] = histories["s2"][:-2] + [7, 7]  # s2 diverges: cropped and extended alone,
    step(["s1", "s2", "s3"])  # while s1 and s3 step as a batch of two
    step(["s1", "s2", "s3"])
    assert built == [3, 2, 3, 2, 3]
    logits = expert.score("s1", histories["s1"] + [4], 2)  # scored on its own between steps
    torch.testing.assert_close(logits[-1], _plain_last_logits(expert.model, [histories["s1"]])[0],
                               rtol=1e-4, atol=1e-4)  # the last row predicts the 4 after the history
    step(["s1", "s2", "s3"])
    assert expert._cohort is not None
    stats = expert.cache_stats()  # what the expert server's metrics report
    assert stats["decode_batches_rebuilt"] == len(built)
    assert stats["decode_batches_in_place"] == 6  # the six steps of the same sessions in any order
    expert.release(["s1", "s2", "s3"])
    assert expert._cohort is None  # no session left: the batch buffers are freed
