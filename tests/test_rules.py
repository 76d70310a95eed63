"""The training-free fusion rules (`fusion.fuse.rules`) and the registry that builds them by name
(`fusion.fuse.registry`), each against the rule written out plainly: a loop over rows and experts in
float64, from probabilities where the docstring speaks of probabilities. Bad parameters and weights
raise the documented error naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from fusion.errors import ConfigError, InvalidArgumentError
from fusion.fuse.router import Route
from fusion.fuse.registry import RULES, known_rules, make_rule
from fusion.fuse.rules import (
    BUILTIN_RULES,
    LOGPROB_FLOOR,
    Confidence,
    LogitArithmetic,
    Mixture,
    Single,
    WeightedLogits,
    context_rows,
    log_softmax_and_normalizer,
    row_argmax,
    teacher_forced_context,
)

NAMES = ["a", "b", "c"]
E, B, V = 3, 4, 40


def random_logits(seed: int = 0, masked: int = 3) -> torch.Tensor:
    """(E, B, V) float32 logits of a visible spread, the last `masked` ids of expert 1 impossible (-inf),
    as padded rows or banned ids leave them."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(E, B, V, generator=generator) * 3
    if masked:
        logits[1, :, -masked:] = float("-inf")
    return logits


def random_weights(seed: int = 1) -> torch.Tensor:
    """(E, B) positive weights, a different set per row, one of them zero."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(E, B, generator=generator) + 0.1
    weights[2, 1] = 0.0
    return weights


def softmax_row(z: torch.Tensor) -> torch.Tensor:
    """exp(z) / Σ exp(z) over one float64 row, written out (the max subtracted; -inf gives 0)."""
    z = z.double()
    e = torch.exp(z - z.max())
    return e / e.sum()


def assert_same_scores(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal where finite, and -inf at exactly the same ids."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected)), "impossible ids differ"
    assert not torch.isnan(got).any() and not torch.isposinf(got).any()
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite].double(), expected[finite].double(), rtol=1e-5, atol=1e-5)


# -- the rules against their plain definitions ----------------------------------------------------
def test_weighted_logits_is_the_normalised_weighted_sum_of_logits():
    logits = random_logits(masked=0)
    weights = random_weights()
    result = WeightedLogits(NAMES).fuse(logits, weights)
    expected = torch.empty(B, V, dtype=torch.float64)
    used = torch.empty(E, B, dtype=torch.float64)
    for b in range(B):
        total = sum(float(weights[e, b]) for e in range(E))
        expected[b] = sum(float(weights[e, b]) / total * logits[e, b].double() for e in range(E))
        for e in range(E):
            used[e, b] = float(weights[e, b]) / total
    assert_same_scores(result.logits, expected)
    torch.testing.assert_close(result.weights.double(), used)
    assert result.log_normalizers is None  # it never takes a logsumexp


def test_weighted_logits_leaves_out_an_impossible_token_of_a_zero_weight_expert():
    """0 · -inf would be NaN: an expert with weight 0 contributes nothing, even where its logit is -inf."""
    logits = random_logits(masked=3)
    weights = torch.tensor([[1.0] * B, [0.0] * B, [3.0] * B])  # expert 1, the one with -inf, is left out
    result = WeightedLogits(NAMES).fuse(logits, weights)
    expected = 0.25 * logits[0].double() + 0.75 * logits[2].double()
    assert_same_scores(result.logits, expected)


def test_mixture_is_the_log_of_the_weighted_sum_of_probabilities():
    logits = random_logits()
    weights = random_weights()
    result = Mixture(NAMES).fuse(logits, weights)
    expected = torch.empty(B, V, dtype=torch.float64)
    for b in range(B):
        total = sum(float(weights[e, b]) for e in range(E))
        probs = sum(float(weights[e, b]) / total * softmax_row(logits[e, b]) for e in range(E))
        expected[b] = torch.log(probs)
    assert_same_scores(result.logits, expected)
    torch.testing.assert_close(result.weights, weights / weights.sum(0, keepdim=True))
    reference_normalizers = torch.tensor([[math.log(sum(math.exp(float(x)) for x in logits[e, b]))
                                           for b in range(B)] for e in range(E)])
    torch.testing.assert_close(result.log_normalizers.double(), reference_normalizers.double())


def test_mixture_gives_an_id_impossible_for_every_weighted_expert_minus_infinity():
    logits = random_logits(masked=0)
    logits[:, :, 5] = float("-inf")  # impossible for all
    logits[0, :, 6] = float("-inf")  # impossible for one: the others still give it mass
    result = Mixture(NAMES).fuse(logits, torch.ones(E, B))
    assert torch.isneginf(result.logits[:, 5]).all() and torch.isfinite(result.logits[:, 6]).all()


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("lead", [0, "b"])
def test_logit_arithmetic_is_the_signed_sum_of_log_probabilities_over_plausible_tokens(alpha, lead):
    logits = random_logits()
    weights = torch.tensor([[1.5] * B, [-0.5] * B, [1.0] * B])  # a negative weight on the expert with -inf
    if lead == "b":
        weights = torch.tensor([[-0.5] * B, [1.5] * B, [1.0] * B])
    lead_index = 0 if lead == 0 else 1
    result = LogitArithmetic(NAMES, alpha=alpha, lead=lead).fuse(logits, weights)
    expected = torch.empty(B, V, dtype=torch.float64)
    for b in range(B):
        # log p_i floored at the documented LOGPROB_FLOOR, so that -inf times a negative weight stays out
        log_probs = [torch.log(softmax_row(logits[e, b])).clamp(min=LOGPROB_FLOOR) for e in range(E)]
        combined = sum(float(weights[e, b]) * log_probs[e] for e in range(E))
        lead_probs = softmax_row(logits[lead_index, b])
        plausible = lead_probs >= alpha * lead_probs.max()
        expected[b] = torch.where(plausible, combined, torch.tensor(float("-inf"), dtype=torch.float64))
    assert_same_scores(result.logits, expected)
    assert torch.equal(result.weights, weights)  # signed weights used as given, not normalised
    torch.testing.assert_close(result.log_normalizers, torch.logsumexp(logits, dim=-1))
    if alpha == 0.0:
        assert torch.isfinite(result.logits).all()  # nothing masked, the floor keeps impossible ids finite
    if alpha == 1.0:
        assert (torch.isfinite(result.logits).sum(-1) >= 1).all()  # the lead's top token is always kept


@pytest.mark.parametrize("combine", ["mixture", "weighted_logits"])
@pytest.mark.parametrize("tau", [0.3, 1.0, 5.0])
def test_confidence_weights_each_expert_by_prior_times_exp_of_minus_entropy_over_tau(combine, tau):
    logits = random_logits()
    logits[2, 0] *= 0.1  # a flat, uncertain expert on row 0
    logits[2, 2] *= 10.0  # a sharp, confident one on row 2
    prior = random_weights()
    result = Confidence(NAMES, tau=tau, combine=combine).fuse(logits, prior)
    expected = torch.empty(B, V, dtype=torch.float64)
    used = torch.empty(E, B, dtype=torch.float64)
    for b in range(B):
        probs = [softmax_row(logits[e, b]) for e in range(E)]
        # H = -Σ p log p, with 0 · log 0 = 0 for impossible ids
        entropy = [-sum(float(p) * math.log(float(p)) for p in probs[e] if p > 0) for e in range(E)]
        raw = [float(prior[e, b]) * math.exp(-entropy[e] / tau) for e in range(E)]
        w = [r / sum(raw) for r in raw]
        used[:, b] = torch.tensor(w, dtype=torch.float64)
        if combine == "mixture":
            expected[b] = torch.log(sum(w[e] * probs[e] for e in range(E)))
        else:
            expected[b] = sum(w[e] * logits[e, b].double() for e in range(E) if w[e] != 0)
    assert_same_scores(result.logits, expected)
    torch.testing.assert_close(result.weights.double(), used, rtol=1e-5, atol=1e-7)
    assert float(result.weights[2, 1]) == 0.0  # a zero prior stays zero
    torch.testing.assert_close(result.log_normalizers, torch.logsumexp(logits, dim=-1))


def test_confidence_prefers_the_confident_expert():
    """Of two experts with equal priors, the one with the lower entropy gets the larger weight."""
    logits = torch.zeros(2, 1, V)
    logits[0, 0, 3] = 8.0  # sharp
    logits[1, 0, :] = torch.linspace(0, 0.5, V)  # nearly flat
    w = Confidence(["a", "b"], tau=1.0).fuse(logits, torch.ones(2, 1)).weights
    assert float(w[0, 0]) > 0.9 > 0.1 > float(w[1, 0])


@pytest.mark.parametrize("expert", [2, "b"])
def test_single_is_one_experts_logits_unchanged(expert):
    logits = random_logits()
    index = 2 if expert == 2 else 1
    rule = Single(NAMES, expert=expert)
    result = rule.fuse(logits, random_weights())
    assert torch.equal(result.logits, logits[index])
    expected_weights = torch.zeros(E, B)
    expected_weights[index] = 1.0
    assert torch.equal(result.weights, expected_weights)
    assert [rule.uses_expert(i, [1.0, 1.0, 1.0]) for i in range(E)] == [i == index for i in range(E)]
    rule.check_weights([0.0, -2.0, 0.0])  # any finite weights: they are ignored


def test_averaging_rules_read_only_experts_with_a_nonzero_weight():
    for rule in (WeightedLogits(NAMES), Mixture(NAMES), Confidence(NAMES), LogitArithmetic(NAMES)):
        assert [rule.uses_expert(i, [0.5, 0.0, -1.0]) for i in range(E)] == [True, False, True]


def test_log_softmax_and_normalizer_equal_torch_log_softmax_and_logsumexp():
    logits = random_logits()
    log_probs, normalizer = log_softmax_and_normalizer(logits)
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, dim=-1))
    torch.testing.assert_close(normalizer, torch.logsumexp(logits, dim=-1))


# -- parameters and weights: the documented errors ------------------------------------------------
@pytest.mark.parametrize("build,match", [
    (lambda: WeightedLogits(NAMES, temperature=1.0), r"rule 'weighted_logits' has no parameter\(s\) \['temperature'\]"),
    (lambda: Mixture(NAMES, alpha=0.1), r"rule 'mixture' has no parameter\(s\) \['alpha'\]"),
    (lambda: LogitArithmetic(NAMES, alpha=1.5), r"alpha must be in \[0, 1\], got 1.5"),
    (lambda: LogitArithmetic(NAMES, alpha=-0.1), "alpha must be in"),
    (lambda: LogitArithmetic(NAMES, alpha="0.1"), "alpha must be in"),
    (lambda: LogitArithmetic(NAMES, lead="z"), r"lead must name an expert of \['a', 'b', 'c'\], got 'z'"),
    (lambda: LogitArithmetic(NAMES, lead=3), "lead must name an expert"),
    (lambda: LogitArithmetic(NAMES, lead=True), "lead must name an expert"),  # a bool is not an index
    (lambda: Confidence(NAMES, tau=0), "tau must be a finite number > 0, got 0"),
    (lambda: Confidence(NAMES, tau=math.inf), "tau must be a finite number > 0"),
    (lambda: Confidence(NAMES, combine="product"), "combine must be 'mixture' or 'weighted_logits', got 'product'"),
    (lambda: Single(NAMES, expert="d"), "expert must name an expert"),
    (lambda: Single(NAMES, expert=-1), "expert must name an expert"),
])
def test_bad_parameters_raise_a_value_error_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("rule,weights,match", [
    (Mixture(NAMES), [1.0, 1.0], r"needs 3 weights \(one per expert \['a', 'b', 'c'\]\), got 2"),
    (Mixture(NAMES), [1.0, 1.0, -1.0], "needs finite weights >= 0; expert 'c' has -1.0"),
    (WeightedLogits(NAMES), [1.0, math.nan, 1.0], "needs finite weights >= 0; expert 'b' has nan"),
    (Confidence(NAMES), [0.0, 0.0, 0.0], "needs a positive weight sum"),
    (Mixture(NAMES), [1.0, 1e-300, 1.0], "expert 'b''s weight 1e-300 is outside float32's range"),
    (Mixture(NAMES), [1e300, 1.0, 1.0], "expert 'a''s weight 1e\\+300 is outside float32's range"),
    (Mixture(NAMES), [3e38, 3e38, 1.0], "sum of magnitudes exceeds float32's range"),
    (LogitArithmetic(NAMES), [1.0, math.inf, 1.0], "needs finite weights; expert 'b' has inf"),
    (LogitArithmetic(NAMES), [-1.0, 1.0, 1.0], "the lead expert 'a' needs a positive weight, got -1.0"),
    (LogitArithmetic(NAMES, lead="c"), [1.0, 1.0, 0.0], "the lead expert 'c' needs a positive weight"),
    (Single(NAMES), [1.0], "needs 3 weights"),
])
def test_bad_weights_raise_a_value_error_naming_the_expert(rule, weights, match):
    with pytest.raises(ValueError, match=match):
        rule.check_weights(weights)


@pytest.mark.parametrize("rule,weights", [
    (Mixture(NAMES), [1.0, 0.0, 2.0]),  # zeros are fine while the sum is positive
    (LogitArithmetic(NAMES), [1.0, -0.5, 0.0]),  # signed weights, a positive lead
    (Confidence(NAMES), [1e-30, 1.0, 1e30]),  # magnitudes float32 can hold
    (WeightedLogits(NAMES), [3e38, 1.0, 1.0]),
])
def test_accepted_weights_fuse_to_scores_without_nan(rule, weights):
    """What `check_weights` lets through is what the float32 step can compute: no NaN, no +inf, and
    every row keeps a finite score."""
    rule.check_weights(weights)
    fused = rule.fuse(random_logits(), torch.tensor(weights)[:, None].expand(E, B).contiguous()).logits
    assert not torch.isnan(fused).any() and not torch.isposinf(fused).any()
    assert torch.isfinite(fused).any(dim=-1).all()


# -- the registry ----------------------------------------------------------------------------------
def test_the_registry_holds_every_builtin_rule_and_route():
    rules = known_rules()
    assert rules == {**BUILTIN_RULES, "route": Route}
    assert set(rules) == {"weighted_logits", "mixture", "logit_arithmetic", "confidence", "single", "route"}
    rules.pop("mixture")  # a copy: the registry itself is unchanged
    assert "mixture" in RULES


def test_make_rule_builds_the_named_rule_with_its_parameters():
    rule = make_rule("logit_arithmetic", {"alpha": 0.25, "lead": "c"}, NAMES)
    assert isinstance(rule, LogitArithmetic) and rule.alpha == 0.25 and rule.lead == 2
    assert rule.expert_names == NAMES
    confidence = make_rule("confidence", {"tau": 2, "combine": "weighted_logits"}, NAMES)
    assert isinstance(confidence, Confidence) and (confidence.tau, confidence.combine) == (2.0, "weighted_logits")
    assert isinstance(make_rule("mixture", {}, ["x"]), Mixture)


@pytest.mark.parametrize("name,params,experts,match", [
    ("mixture", {}, [], "experts: at least one expert is required"),
    ("nope", {}, NAMES, r"rule: unknown fusion rule 'nope'; known: \['confidence', 'logit_arithmetic', "),
    ("mixture", {"temperature": 1}, NAMES, r"fusion.params: rule 'mixture' has no parameter\(s\) \['temperature'\]"),
    ("logit_arithmetic", {"beta": 1}, NAMES, "fusion.params: .*beta"),  # a TypeError from the signature
    ("logit_arithmetic", {"alpha": 3}, NAMES, "fusion.params: rule 'logit_arithmetic': alpha must be in"),
    ("single", {"expert": "z"}, NAMES, "fusion.params: rule 'single': expert must name an expert"),
    ("route", {}, NAMES, "fusion.params.router: rule 'route' needs a router"),
    ("route", {"tau": 0, "path": "unread.pt"}, NAMES,
     "fusion.params.tau: rule 'route': tau must be a finite number > 0"),
    ("route", {"tau": True, "path": "unread.pt"}, NAMES, "fusion.params.tau: rule 'route': tau must be"),
    ("route", {"tau": "1", "path": "unread.pt"}, NAMES, "fusion.params.tau: rule 'route': tau must be"),
])
def test_make_rule_refusals_are_invalid_argument_errors_naming_the_field(name, params, experts, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_rule(name, params, experts)


def test_an_unreadable_router_checkpoint_stays_a_config_error(tmp_path):
    """The caller decides what to reveal of a checkpoint path, so it is not turned into a request error."""
    missing = tmp_path / "missing.pt"
    with pytest.raises(ConfigError, match="router checkpoint not found") as caught:
        make_rule("route", {"path": str(missing)}, NAMES)
    assert not isinstance(caught.value, InvalidArgumentError)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="is not readable"):
        make_rule("route", {"path": str(garbage)}, NAMES)


# -- helpers the rules share -----------------------------------------------------------------------
def test_row_argmax_is_the_first_maximum():
    generator = torch.Generator().manual_seed(0)
    for shape in [(3, 2, 1024), (5, 4096), (2, 512), (7, 300), (1, 49152)]:
        values = torch.randint(0, 50, shape, generator=generator).float()  # many ties
        assert torch.equal(row_argmax(values), values.argmax(-1))
    strided = torch.randn(4, 2048, generator=generator)[:, ::2]  # not contiguous
    assert torch.equal(row_argmax(strided), strided.argmax(-1))


def test_context_rows_and_teacher_forced_context_agree():
    prefix, continuation = [7, 8, 9], [10, 11, 12, 13]
    forced = teacher_forced_context(prefix, continuation, k=5)
    expected = context_rows([prefix + continuation[:j] for j in range(len(continuation))], k=5)
    assert torch.equal(forced, expected)
    assert forced[0].tolist() == [-1, -1, 7, 8, 9] and forced[3].tolist() == [8, 9, 10, 11, 12]
    long = list(range(100))
    assert context_rows([long]).tolist() == [long[-64:]]
