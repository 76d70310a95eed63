"""The sampler against plain references: truncation sets, seeds, penalties, greedy, logprobs."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fusion.config import SamplingParams
from fusion.fuse import sampler
from fusion.fuse.sampler import SamplingMetadata, apply_penalties, apply_top_k_top_p_min_p, sample, token_bias_row

V = 64


def metadata(params, generators=None):
    return SamplingMetadata.build(params, V, generators or {})


def logits_batch(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 3  # (B, V)


def allowed_set(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Reference: the ids a row may emit under top-k, top-p and min-p, computed plainly."""
    scaled = row / p.temperature
    probs = torch.softmax(scaled, -1)
    order = torch.argsort(scaled, descending=True).tolist()
    keep = set(order)
    if p.min_p > 0:
        keep &= {i for i in range(V) if probs[i] >= p.min_p * probs.max()}
    if p.top_k > 0:
        keep &= set(order[: p.top_k])
    if p.top_p < 1.0:
        # min-p and top-k apply before the nucleus is measured
        kept = [i for i in order if i in keep]
        mass = torch.softmax(scaled[kept], -1).tolist()
        nucleus, total = [], 0.0
        for i, m in zip(kept, mass):
            if total >= p.top_p:
                break
            nucleus.append(i)
            total += m
        keep &= set(nucleus)
    return keep


@pytest.fixture(params=[V, 8], ids=["candidates-all", "candidates-8"])
def candidates(request, monkeypatch):
    """The CPU path ranks CANDIDATES ids per truncating row: all of them, or 8 (so that some rows'
    sets reach past them and take the full sort)."""
    monkeypatch.setattr(sampler, "CANDIDATES", request.param)
    return request.param


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_k=12),
    SamplingParams(temperature=3.0, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
], ids=["top_k", "top_k-past-8", "top_p", "min_p", "all"])
def test_truncation_never_leaves_its_set(params, candidates):
    logits = logits_batch()
    allowed = [allowed_set(logits[b], params) for b in range(4)]
    seen = [set() for _ in range(4)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        md = metadata([params] * 4, {0: gen})
        ids = sample(logits, md).token_ids.tolist()
        for b, t in enumerate(ids):
            assert t in allowed[b]
            seen[b].add(t)
    # The sampler really samples: more than one id of a multi-id set shows up.
    assert any(len(s) > 1 for s in seen)


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.7),
                               SamplingParams(temperature=2.0, top_p=0.7)],
                         ids=["temperature", "top_p-within-8", "top_p-past-8"])
def test_seeded_rows_reproduce_independently_of_batch(p, candidates):
    logits = logits_batch()
    # Row 0 takes the full path (no truncation), row 3 too when its nucleus is wider than 8 ids.
    neighbours = [SamplingParams(temperature=1.0), p, p, SamplingParams(temperature=0.5, top_p=0.99)]

    def run(rows_with_gen, params):
        gens = {b: torch.Generator().manual_seed(42 + b) for b in rows_with_gen}  # each row its own seed
        return [sample(logits, metadata(params, gens)).token_ids.tolist() for _ in range(20)]

    alone = [r[2] for r in run([2], [p] * 4)]
    together = [r[2] for r in run([0, 2, 3], [p] * 4)]
    among_others = [r[2] for r in run([0, 1, 2, 3], neighbours)]  # other rows take other paths
    assert alone == together == among_others
    assert len(set(alone)) > 1


def test_candidate_truncation_equals_the_full_sort(monkeypatch):
    """Rows whose top-k/top-p set lies within their 8 best ids keep exactly the ids the full sort keeps;
    the others are reported as not fitting."""
    monkeypatch.setattr(sampler, "CANDIDATES", 8)
    logits = logits_batch(6, seed=5)
    logits[3] = logits[3] / 20  # nearly flat: its 0.9 nucleus needs far more than 8 ids
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=6, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=30), SamplingParams(temperature=1.0, top_k=8, top_p=0.95)]
    md = metadata(params)
    cand, ids, fits = sampler._candidates(logits, md)
    full = apply_top_k_top_p_min_p(logits, md)
    assert fits.tolist() == [True, True, True, False, False, True]
    for b in range(6):
        if fits[b]:
            assert set(ids[b][cand[b].isfinite()].tolist()) == set(full[b].isfinite().nonzero()[:, 0].tolist())
            assert set(ids[b][cand[b].isfinite()].tolist()) == allowed_set(logits[b], params[b])


def test_nucleus_sampling_follows_the_truncated_distribution(monkeypatch):
    """Within the nucleus, draws follow the renormalised probabilities."""
    monkeypatch.setattr(sampler, "CANDIDATES", 8)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0] + [-6.0] * (V - 4)])
    p = SamplingParams(temperature=1.0, top_p=0.8)
    allowed = sorted(allowed_set(logits[0], p))
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(V)
    for _ in range(4000):
        counts[sample(logits, metadata([p], {0: gen})).token_ids[0]] += 1
    assert set(counts.nonzero()[:, 0].tolist()) == set(allowed)
    expected = torch.softmax(logits[0, allowed], -1)
    torch.testing.assert_close(counts[allowed] / 4000, expected, atol=0.03, rtol=0)


def test_greedy_and_mixed_rows():
    logits = logits_batch()
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=2.0)]
    out = sample(logits, metadata(params, {1: torch.Generator().manual_seed(1)}))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    expected_lp = torch.log_softmax(logits, -1).gather(-1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, expected_lp)


def test_sampling_follows_the_distribution():
    """The exponential race samples from softmax(logits / T): frequencies match within noise."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    p = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(V)
    for _ in range(4000):
        counts[sample(logits, metadata([p], {0: gen})).token_ids[0]] += 1
    expected = torch.softmax(logits[0], -1)[:4]
    torch.testing.assert_close(counts[:4] / 4000, expected, atol=0.03, rtol=0)


def test_logit_bias_and_banned_ids():
    logits = logits_batch(1)
    top = int(logits[0].argmax())
    out = sample(logits, metadata([SamplingParams(banned_token_ids=[top])]))
    assert out.token_ids[0] != top
    low = int(logits[0].argmin())
    out = sample(logits, metadata([SamplingParams(logit_bias={low: 100.0})]))
    assert out.token_ids[0] == low


def test_bias_row_matches_a_hand_built_row():
    """The per-request row built once at admission: bias added, banned ids -inf, the rest 0."""
    params = SamplingParams(logit_bias={3: 2.5, 7: -1.0}, banned_token_ids=[5, 9])
    row = token_bias_row(params, V)
    expected = torch.zeros(V)
    expected[3], expected[7], expected[5], expected[9] = 2.5, -1.0, float("-inf"), float("-inf")
    assert torch.equal(row, expected)
    assert token_bias_row(SamplingParams(), V) is None
    logits = logits_batch(2)
    md = metadata([params, SamplingParams()])
    torch.testing.assert_close(sample(logits, md).logprobs,
                               torch.log_softmax(logits + torch.stack([expected, torch.zeros(V)]), -1)
                               .gather(-1, sample(logits, md).token_ids[:, None])[:, 0])


@pytest.mark.parametrize("field,value", [
    ("temperature", 1e39), ("temperature", float("inf")), ("top_p", float("nan")),
    ("presence_penalty", float("inf")), ("repetition_penalty", 0.0),
])
def test_non_finite_float32_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_bias_outside_openai_range_is_refused():
    for bias in (float("inf"), 101.0, -1e39):
        with pytest.raises(ValidationError, match=r"\[-100, 100\]"):
            SamplingParams(logit_bias={1: bias})


def test_tiny_temperatures_are_raised_to_the_floor():
    """logits / 1e-40 overflow float32; like vLLM, positive temperatures below 0.01 become 0.01."""
    assert SamplingParams(temperature=1e-40).temperature == 0.01
    logits = logits_batch(1)
    out = sample(logits, metadata([SamplingParams(temperature=1e-40, seed=1)], {0: torch.Generator().manual_seed(1)}))
    assert torch.isfinite(out.logprobs).all()


def test_penalties_match_reference():
    logits = logits_batch(2)
    counts = torch.zeros(2, V)
    counts[0, 3] = 2
    counts[1, 5] = 1
    seen = counts > 0
    seen[0, 7] = True  # in the prompt only
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)] * 2
    got = apply_penalties(logits, metadata(params), counts, seen)
    expected = logits.clone()
    for b in range(2):
        for t in range(V):
            if seen[b, t]:
                expected[b, t] = expected[b, t] / 1.5 if expected[b, t] > 0 else expected[b, t] * 1.5
            expected[b, t] -= 0.25 * counts[b, t] + (0.5 if counts[b, t] > 0 else 0.0)
    torch.testing.assert_close(got, expected)


def test_top_logprobs():
    logits = logits_batch(2)
    out = sample(logits, metadata([SamplingParams(logprobs=3), SamplingParams(logprobs=1)]))
    ref_lp, ref_ids = torch.log_softmax(logits, -1).topk(3, dim=-1)
    assert torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs, ref_lp)
