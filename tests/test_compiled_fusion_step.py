"""`fusion_step: compiled`: the route rule's step through torch.compile (inductor on a CPU) against the
eager step: the same fused scores, weights and normalizers for one row and for many, the eager step
taken where an expert's maximum ties (its id must be topk's, as in training), and a service configured
with it compiles the config's own rule at start-up and decodes the eager service's tokens."""

from __future__ import annotations

import pytest
import torch

from fusion import native_kernels
from fusion.compute import one_thread
from fusion.config import SpecOverrides, parse_config
from fusion.router import FamiliarityGate, Route, expert_fingerprint, save_router
from fusion.rules import CONTEXT_TOKENS
from fusion.service import FusionService
from tests.conftest import tiny_config_dict
from tests.test_router_fast_path import _logits, _router, reference_fuse


def _gated_route(vocab: int, hard: bool, comp_rank: int) -> tuple[Route, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A route rule whose gate pulls some rows of `_logits` part or all of the way, and its inputs."""
    router = _router(vocab, comp_rank=comp_rank)
    logits = _logits(vocab=vocab)
    context = torch.randint(-1, vocab, (4, CONTEXT_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        inputs = router.inputs(torch.log_softmax(logits, -1), context)
    router.gate = FamiliarityGate(inputs[0], torch.eye(inputs.shape[1]), limit=1.0, generalist=0)
    router.gate.limit = float(router.gate.distance(inputs[1:2])[0]) / 1.5
    weights = torch.tensor([[1.0] * 4, [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])  # (E, B): masks
    return Route(["a", "b", "c"], router=router, hard=hard, fail_safe=True), logits, context, weights


@pytest.mark.parametrize("native", [True, False], ids=["C-passes-loaded", "torch-passes"])
@pytest.mark.parametrize("hard,comp_rank", [(True, 16), (False, 0)])
def test_compiled_step_equals_the_eager_step(hard, comp_rank, native, monkeypatch):
    """With the C passes loaded (a server with quantized experts) the eager step takes them and the compiled
    graph must still keep torch's operators: tracing into the C call would hand it fake tensors' pointers."""
    if native:
        assert native_kernels.library() is not None
    else:
        monkeypatch.setattr(native_kernels, "reads_logits", lambda logits: False)
    vocab = 1024
    rule, logits, context, weights = _gated_route(vocab, hard, comp_rank)
    logits[0, 1, 290] = logits[0, 1, 7] - 0.5  # no tied maximum: the compiled step's result is used
    with one_thread():
        assert rule.compile_step() > 0
    for rows in (slice(0, 1), slice(0, 4), slice(1, 4)):  # the one-row graph and the any-rows graph
        part, ctx, w = logits[:, rows], context[rows], weights[:, rows]
        with one_thread(), torch.no_grad():
            compiled = rule.fuse(part, w, ctx)
            eager = rule.router.fuse(part, ctx, w > 0, hard=hard, fail_safe=True)
            expected = reference_fuse(rule.router, part, ctx, w > 0, hard, fail_safe=True)
            tied = rule._compiled(part, ctx, w > 0)[3]
        assert not bool(tied)
        torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled.weights, eager.weights)
        torch.testing.assert_close(compiled.log_normalizers, eager.log_normalizers)
        assert torch.equal(compiled.logits.argmax(-1), eager.logits.argmax(-1))


def test_the_engines_layouts_compile_no_further_graph():
    """Warm-up compiles the one-row and the any-rows graph; the layouts the engine hands the step (weights
    built as a transpose, logits sliced when rows drop out, one row of either) then run those graphs, so
    no step compiles while streams wait. The results stay the eager step's."""
    from torch._dynamo.utils import counters

    vocab = 1024
    rule, logits, context, weights = _gated_route(vocab, hard=True, comp_rank=16)
    logits[0, 1, 290] = logits[0, 1, 7] - 0.5  # no tied maximum
    with one_thread():
        rule.compile_step()
    graphs = counters["stats"]["unique_graphs"]
    transposed = weights.T.contiguous().T  # (E, B) with strides (1, E), as `torch.tensor(rows).T` is
    for rows in (slice(0, 1), slice(1, 2), slice(0, 3), slice(1, 4), slice(0, 4)):
        part, ctx, w = logits[:, rows], context[rows], transposed[:, rows]
        with one_thread(), torch.no_grad():
            compiled = rule.fuse(part, w, ctx)
            eager = rule.router.fuse(part, ctx, w > 0, hard=True, fail_safe=True)
        torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_tied_maximum_takes_the_eager_step():
    vocab = 1024
    rule, logits, context, weights = _gated_route(vocab, hard=True, comp_rank=16)  # row 1: ids 7 and 290 tie
    with one_thread():
        rule.compile_step()
    with one_thread(), torch.no_grad():
        assert bool(rule._compiled(logits, context, weights > 0)[3])
        result = rule.fuse(logits, weights, context)
        eager = rule.router.fuse(logits, context, weights > 0, hard=True, fail_safe=True)
    assert torch.equal(result.logits, eager.logits) and torch.equal(result.weights, eager.weights)


def _routed_config(tiny_dir, tmp_path, fusion_step: str, comp_rank: int = 0) -> dict:
    """The tiny trio with a random router (its checkpoint bound to them) as the config's route rule."""
    probe = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir)))
    fingerprints = [expert_fingerprint(e) for e in probe.engine.experts]
    path = save_router(_router(probe.engine.vocab_size, seed=4, comp_rank=comp_rank), tmp_path / "r.pt",
                       probe.expert_names, fingerprints)
    probe.close()
    return tiny_config_dict(tiny_dir, routers={"mine": str(path)}, fusion_step=fusion_step,
                            fusion={"rule": "route", "params": {"router": "mine", "hard": True}})


def test_service_compiles_its_own_route_step(tiny_dir, tmp_path):
    """`fusion_step: compiled` compiles the config's rule when the service starts; its tokens are the
    eager service's; a request that changes the rule's params gets an eager rule of its own."""
    tokens = {}
    for step in ("eager", "compiled"):
        config = _routed_config(tiny_dir, tmp_path, step, comp_rank=8)
        service = FusionService.from_config(parse_config(config), cache_dir=tmp_path / "cache")
        assert service._rules.cache_info().currsize == (step == "compiled")  # built (and compiled) at start-up
        rule = service.resolve_spec(None)[0]
        assert (rule._compiled is not None) == (step == "compiled")
        other = service.resolve_spec(SpecOverrides(params={"hard": False}))[0]
        assert other is not rule and other._compiled is None
        completion = service.complete("hello world", {"max_tokens": 16, "ignore_eos": True})
        tokens[step] = completion.token_ids
        service.close()
    assert len(tokens["eager"]) == 16 and tokens["compiled"] == tokens["eager"]
    assert (tmp_path / "cache" / "compiled").is_dir()  # inductor's cache, for the next start


@pytest.mark.cuda
def test_cuda_compiled_step_equals_the_eager_step():
    """The same on a GPU (inductor's GPU kernels; benchmarks/gpu_check.sh runs it)."""
    rule, logits, context, weights = _gated_route(1024, hard=True, comp_rank=16)
    logits[0, 1, 290] = logits[0, 1, 7] - 0.5
    rule.compile_step("cuda")
    logits, context, weights = logits.cuda(), context.cuda(), weights.cuda()
    with torch.no_grad():
        compiled = rule.fuse(logits, weights, context)
        eager = rule.router.fuse(logits, context, weights > 0, hard=True, fail_safe=True)
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.weights, eager.weights)


def test_a_step_that_cannot_compile_runs_eagerly(tiny_dir, tmp_path, monkeypatch, caplog):
    """Where torch.compile fails (no C++ compiler, no Triton), the service starts and serves eagerly."""
    config = _routed_config(tiny_dir, tmp_path, "compiled")

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="fusion.service"):
        service = FusionService.from_config(parse_config(config))
    assert "could not be built here (RuntimeError: no C++ compiler)" in caplog.text
    assert service.resolve_spec(None)[0]._compiled is None
    assert len(service.complete("hello", {"max_tokens": 4, "ignore_eos": True}).token_ids) == 4
    service.close()
