"""The learned router: training lowers the loss; checkpoints reload exactly and are tied to their
experts; a router that always picks one expert reproduces that expert."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusion.config import FusionSpec, parse_config
from fusion.errors import InvalidArgumentError
from fusion.pipeline import FusionPipeline
from fusion.router import Route, Router, RouterShape, load_router, logit_features
from fusion.router_training import RouterTrainSettings, router_loss, train_router
from tests.conftest import tiny_config_dict
from tests.tiny_models import CORPUS


def texts():
    return itertools.cycle(CORPUS)


@pytest.fixture(scope="module")
def trained(tiny_pipeline, tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "router.pt"
    losses = []
    result = train_router(tiny_pipeline, path, texts=texts(),
                          settings=RouterTrainSettings(minutes=5, max_texts=40, steps_per_text=3, lr=1e-2),
                          on_step=lambda step, loss: losses.append(loss))
    return path, losses, result


def test_training_loss_decreases(trained):
    _, losses, result = trained
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first * 0.9, (first, last)
    assert result.steps == 120


def test_saved_router_reloads_to_identical_outputs(trained, tiny_pipeline):
    path, _, _ = trained
    router, _ = load_router(path)
    again, _ = load_router(path)
    logits = torch.randn(3, 5, tiny_pipeline.engine.vocab_size)
    prev = torch.tensor([1, 2, 3, 4, 5])
    a, b = router.fuse(logits, prev), again.fuse(logits, prev)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.weights, b.weights)
    rule, weights = tiny_pipeline.resolve_spec(FusionSpec(rule="route", params={"path": str(path)}))
    completion = tiny_pipeline.complete("hello world", {"max_tokens": 6, "ignore_eos": True},
                                        FusionSpec(rule="route", params={"path": str(path)}))
    assert len(completion.token_ids) == 6
    assert all(sum(a.weight for a in ev.attribution) == pytest.approx(1.0) for ev in completion.events)


def test_router_refused_against_other_experts(trained, tiny_dir):
    path, _, _ = trained
    swapped = parse_config(tiny_config_dict(tiny_dir, names=("b", "a", "c")))
    pipeline = FusionPipeline.from_config(swapped)
    with pytest.raises(Exception, match="trained with other experts"):
        pipeline.resolve_spec(FusionSpec(rule="route", params={"path": str(path)}))
    pipeline.close()
    two = FusionPipeline.from_config(parse_config(tiny_config_dict(tiny_dir, names=("a", "b"))))
    with pytest.raises(InvalidArgumentError, match="router has 3 experts"):
        two.resolve_spec(FusionSpec(rule="route", params={"path": str(path)}))
    two.close()


def test_router_always_picking_one_expert_reproduces_it(tiny_pipeline):
    engine = tiny_pipeline.engine
    router = Router(RouterShape(num_experts=3, vocab_size=engine.vocab_size))
    with torch.no_grad():
        for p in router.route.parameters():
            p.zero_()
        router.route.bias[2] = 50.0  # always expert "c"
    rule = Route(engine.names, router=router)
    from fusion.config import SamplingParams
    from fusion.engine import GenerationRequest

    prompt = [5, 17, 42, 99]
    routed = [e.token_id for e in engine.generate(GenerationRequest(
        [prompt] * 3, SamplingParams(max_tokens=12, ignore_eos=True), rule, [1.0, 1.0, 1.0]))]
    single, w = tiny_pipeline.resolve_spec(FusionSpec(rule="single", params={"expert": "c"}))
    alone = [e.token_id for e in engine.generate(GenerationRequest(
        [prompt] * 3, SamplingParams(max_tokens=12, ignore_eos=True), single, w))]
    assert routed == alone


def test_features_and_loss_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 10)
    lp = torch.log_softmax(logits, -1)
    feats = logit_features(lp)
    assert feats.shape == (4, 3 * 2 + 4)
    p = lp.exp()
    torch.testing.assert_close(feats[:, 0], -(p[0] * lp[0]).sum(-1))
    torch.testing.assert_close(feats[:, 6 + 1], lp[0].gather(-1, lp[1].argmax(-1, keepdim=True))[:, 0])
    router = Router(RouterShape(num_experts=2, vocab_size=10, complementary=False))
    targets = torch.tensor([1, 2, 3, 4])
    prev = torch.tensor([0, 1, 2, 3])
    loss = router_loss(router, logits, prev, targets, route_weight=0.0)
    _, w, _ = router(lp, prev)
    fused = torch.log((w[..., None] * p).sum(0))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(fused, targets))
