"""The fusion step's shared passes against plain reference computations: rules over log-probabilities
hand the engine each expert's log-normalizer (logsumexp over the vocabulary), which the engine's
attribution reuses instead of a second pass over the (E, B, V) logits."""

from __future__ import annotations

import pytest
import torch

from fusion.config import SamplingParams
from fusion.engine.types import GenerationRequest
from fusion.fuse.router import Route, Router, RouterShape
from fusion.fuse.registry import make_rule
from fusion.fuse.rules import CONTEXT_TOKENS


def _logits(vocab: int = 300) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, vocab, generator=generator) * 4  # (E, B, V)
    logits[:, :, -5:] = float("-inf")  # masked ids (padded rows, banned ids)
    return logits


@pytest.mark.parametrize("rule_name,params", [
    ("mixture", {}), ("logit_arithmetic", {"alpha": 0.1}), ("confidence", {"combine": "mixture"}),
    ("confidence", {"combine": "weighted_logits"}),
])
def test_rules_over_log_probabilities_match_the_reference(rule_name, params):
    logits = _logits()
    weights = torch.tensor([[0.5, 0.2, 1.0, 0.0], [0.3, 0.3, 0.0, 1.0], [0.2, 0.5, 0.0, 0.5]])  # (E, B)
    rule = make_rule(rule_name, params, ["a", "b", "c"])
    result = rule.fuse(logits, weights)
    torch.testing.assert_close(result.log_normalizers, torch.logsumexp(logits, dim=-1))
    log_probs = torch.log_softmax(logits, dim=-1)  # the reference: log_softmax in one call
    if rule_name == "mixture":
        w = weights / weights.sum(0, keepdim=True)
        expected = torch.logsumexp(torch.log(w)[..., None] + log_probs, dim=0)
        torch.testing.assert_close(result.logits, expected)


def test_route_hands_its_normalizers_and_matches_the_reference():
    torch.manual_seed(0)
    router = Router(RouterShape(num_experts=3, vocab_size=300)).eval()
    with torch.no_grad():
        router.comp.weight.normal_(0, 0.1)
    logits = _logits()
    context = torch.randint(-1, 300, (4, CONTEXT_TOKENS))
    with torch.no_grad():
        result = Route(["a", "b", "c"], router=router).fuse(logits, torch.ones(3, 4), context)
        log_probs = torch.log_softmax(logits, dim=-1)
        _, weights, comp = router(log_probs, context, torch.ones(3, 4, dtype=torch.bool))
        expected = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0) + comp
    torch.testing.assert_close(result.log_normalizers, torch.logsumexp(logits, dim=-1))
    torch.testing.assert_close(result.logits, expected)


@pytest.mark.parametrize("rule_name", ["weighted_logits", "mixture"])
def test_attribution_is_each_experts_own_probability_of_the_token(tiny_service, rule_name):
    """With or without the rule's normalizers, the attributed probability is softmax(z_e)[token]."""
    engine = tiny_service.engine
    rule = make_rule(rule_name, {}, engine.names)
    batch = engine.new_batch()
    for prompt in ([5, 17, 42], [9, 8, 7, 6]):
        batch.add(engine.admit(GenerationRequest([prompt] * 3, SamplingParams(max_tokens=3, temperature=0.0), rule,
                                                 [0.5, 0.3, 0.2])))
    try:
        for _ in range(3):
            step = batch.fused_logits()
            assert (step.log_normalizers is not None) == (rule_name == "mixture")
            probs = torch.softmax(step.logits, dim=-1)  # (E, B, V) reference
            events = batch.emit_tokens(step)
            for b, event in enumerate(events):
                for e, attribution in enumerate(event.attribution):
                    assert attribution.prob == pytest.approx(float(probs[e, b, event.token_id]), rel=1e-4, abs=1e-6)
    finally:
        batch.cancel_all()
