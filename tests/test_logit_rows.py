"""The route rule's vocabulary passes in C (fusion/forward/kernels/logit_rows.c) against torch's operators: each
expert's statistics (best id, runner-up, normalizer, entropy) and the experts' mixture; and the rule's
fused scores through either."""

from __future__ import annotations

import pytest
import torch

from fusion.forward import native_kernels
from fusion.fuse.router import Route, Router, RouterShape, _softmax_parts, _statistics
from fusion.fuse.rules import LOGPROB_FLOOR, row_argmax


def _logits(width: int, seed: int = 0) -> torch.Tensor:
    z = torch.randn(3, 2, width, generator=torch.Generator().manual_seed(seed)) * 4  # (E, B, V)
    z[1, 0, 7] = z[1, 0].max() + 1  # a tied maximum: the first id is the best, the margin 0
    z[1, 0, width - 2] = z[1, 0, 7]
    z[2, 1, 3] = -1e6  # below the floor: weight 0 in the entropy
    z[:, 1, 5] = float("-inf")  # an id every expert rules out (the mixture keeps it -inf)
    z[0, 0, 9] = float("-inf")  # an id one expert rules out
    return z


@pytest.mark.parametrize("width", [96, 1003, 49152])
def test_statistics_are_torchs(width):
    z = _logits(width)
    ids, best, runner_up, log_total, entropy = (
        t.view(3, 2) for t in native_kernels.logit_statistics(z.reshape(6, width), LOGPROB_FLOOR))
    want_ids = row_argmax(z)
    _, normalizer, want_runner_up = _statistics(z, want_ids)
    _, want_log_total, want_normalizer, want_entropy = _softmax_parts(z)
    assert torch.equal(ids, want_ids) and ids[1, 0] == 7
    assert torch.equal(runner_up, want_runner_up) and runner_up[1, 0] == 0
    torch.testing.assert_close(best + log_total, want_normalizer, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(log_total, want_log_total, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [96, 1003])
def test_the_mixture_is_torchs_logsumexp(width):
    z = _logits(width, seed=1)
    normalizer = torch.logsumexp(z, -1)  # (E, B)
    weights = torch.tensor([[0.5, 0.0], [0.0, 0.3], [0.5, 0.7]])  # an expert left out of each row
    got = native_kernels.mixture(z, torch.log(weights), normalizer)
    want = torch.logsumexp(torch.log(weights)[..., None] + z - normalizer[..., None], dim=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most"):
        native_kernels.mixture(torch.zeros(native_kernels.MIXTURE_MAX + 1, 1, 8),
                               torch.zeros(native_kernels.MIXTURE_MAX + 1, 1), torch.zeros(native_kernels.MIXTURE_MAX + 1, 1))


@pytest.mark.parametrize("hard", [False, True])
def test_the_route_rule_fuses_alike_through_either(monkeypatch, hard):
    torch.manual_seed(4)
    router = Router(RouterShape(num_experts=3, vocab_size=1003, comp_rank=8)).eval()
    with torch.no_grad():
        router.comp.weight.normal_(0, 0.1)
    rule = Route(["a", "b", "c"], router=router, hard=hard)
    assert native_kernels.library() is not None  # loaded: the rule takes the C passes
    z = _logits(1003, seed=2)
    weights = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    context = torch.randint(0, 1003, (2, 16), generator=torch.Generator().manual_seed(3))
    native = rule.fuse(z, weights, context)
    monkeypatch.setattr(native_kernels, "reads_logits", lambda logits: False)
    plain = rule.fuse(z, weights, context)
    torch.testing.assert_close(native.weights, plain.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(native.log_normalizers, plain.log_normalizers, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(native.logits, plain.logits, rtol=1e-5, atol=1e-4)


def test_the_mixture_adds_a_complementary_logit_in_its_pass():
    z = _logits(1003, seed=5)
    normalizer = torch.logsumexp(z, -1)
    weights = torch.tensor([[0.5, 0.2], [0.25, 0.3], [0.25, 0.5]])
    generator = torch.Generator().manual_seed(6)
    inputs, weight, bias = torch.randn(2, 5, generator=generator), torch.randn(5, 1003, generator=generator), \
        torch.randn(1003, generator=generator)
    scale = torch.tensor([1.0, 0.25])
    got = native_kernels.mixture(z, torch.log(weights), normalizer, (inputs, weight, bias, scale))
    want = (torch.logsumexp(torch.log(weights)[..., None] + z - normalizer[..., None], dim=0)
            + scale[:, None] * bias + inputs @ weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
