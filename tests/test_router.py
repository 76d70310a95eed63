"""The learned router: training lowers the loss; checkpoints reload exactly and are tied to their
experts; a router that always picks one expert reproduces that expert."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from fusion.config import FusionSpec, SamplingParams, SpecOverrides, parse_config
from fusion.engine.types import GenerationRequest
from fusion.errors import AssetError, InvalidArgumentError, NotFoundError
from fusion.frontdoor.service import FusionRequest, FusionService
from fusion.fuse.router import FamiliarityGate, Route, Router, RouterShape, load_router, logit_features
from fusion.tools.router_training import (
    RouterTrainSettings,
    file_samples,
    lr_factor,
    prepare_router,
    router_loss,
    train_router,
)
from fusion.fuse.rules import context_rows, teacher_forced_context
from fusion.frontdoor.text import TextSample, end_of_turn_id
from tests.conftest import tiny_config_dict
from tests.tiny_models import CORPUS


def texts():
    return itertools.cycle(CORPUS)


@pytest.fixture(scope="module")
def trained(tiny_service, tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "router.pt"
    losses = []
    result = train_router(tiny_service, path, texts=texts(),
                          settings=RouterTrainSettings(minutes=5, max_texts=40, steps_per_text=3, lr=1e-2),
                          on_step=lambda step, loss: losses.append(loss))
    return path, losses, result


def test_training_loss_decreases(trained):
    _, losses, result = trained
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first * 0.9, (first, last)
    assert result.steps == 120


def test_cosine_schedule_spends_the_runs_budget():
    """The rate falls from lr to lr * min_lr_ratio along whichever budget (texts or minutes) runs out first."""
    cosine = RouterTrainSettings(minutes=10, max_texts=100, lr_schedule="cosine", min_lr_ratio=0.05)
    assert lr_factor(cosine, 0.0, 0) == pytest.approx(1.0)
    assert lr_factor(cosine, 0.0, 50) == pytest.approx(0.525)  # half the texts
    assert lr_factor(cosine, 300.0, 10) == pytest.approx(0.525)  # half the minutes
    assert lr_factor(cosine, 0.0, 100) == pytest.approx(0.05)
    assert lr_factor(cosine, 3600.0, 0) == pytest.approx(0.05)  # past the deadline: no lower
    assert lr_factor(RouterTrainSettings(lr_schedule="constant"), 300.0, 50) == 1.0
    with pytest.raises(ValueError, match="lr_schedule"):
        RouterTrainSettings(lr_schedule="linear")


def test_a_cosine_run_records_its_schedule_and_trains_otherwise(tiny_service, tmp_path):
    """The schedule is applied (the same texts and seed end elsewhere than at a constant rate) and recorded in
    the checkpoint's settings, which a shipped router's manifest command repeats."""
    import json

    states = {}
    for schedule in ("constant", "cosine"):
        path = tmp_path / f"{schedule}.pt"
        train_router(tiny_service, path, texts=texts(),
                     settings=RouterTrainSettings(minutes=5, max_texts=6, steps_per_text=2, lr=1e-2,
                                                  lr_schedule=schedule, min_lr_ratio=0.0, gate_texts=0))
        payload = torch.load(path, map_location="cpu", weights_only=True)
        assert json.loads(payload["metadata"])["settings"]["lr_schedule"] == schedule
        states[schedule] = load_router(path)[0].route.weight.detach()
    assert not torch.equal(states["constant"], states["cosine"])


def test_training_grows_the_factored_complementary_head(trained):
    """The recipe's complementary head is factored (hidden → rank → vocabulary) and starts at zero; a
    gradient reaches it through the randomly started down-projection, so training makes it non-zero."""
    path, _, _ = trained
    router, _ = load_router(path)
    assert router.shape.comp_rank == RouterTrainSettings.comp_rank > 0
    assert router.comp_down.weight.shape == (RouterTrainSettings.comp_rank, router.shape.hidden)
    assert router.comp.weight.shape == (router.shape.vocab_size, RouterTrainSettings.comp_rank)
    assert float(router.comp.weight.detach().abs().max()) > 0


def test_trained_router_has_a_fitted_gate_that_survives_a_reload(trained):
    path, _, _ = trained
    router, _ = load_router(path)
    assert router.gate is not None and router.gate.limit > 0 and router.gate.generalist == 0
    again, _ = load_router(path)
    x = torch.randn(4, router.shape.num_inputs)
    assert torch.equal(router.gate.pull(x), again.gate.pull(x))


def test_router_reads_context_through_the_first_experts_embeddings(trained, tiny_service):
    """Every row of the trained router's table is expert a's input embedding through one projection,
    so ids absent from training are embedded like their neighbours in a's space, not at random."""
    path, _, _ = trained
    router, payload = load_router(path)
    assert '"borrowed_embeddings": true' in payload["metadata"]
    vocab = tiny_service.engine.vocab_size
    base = tiny_service.engine.experts[0].model.get_input_embeddings().weight.detach().float()[:vocab]  # [V, H]
    mine = router.embed.weight.detach()  # [V, D]
    proj = torch.linalg.lstsq(base, mine).solution
    assert torch.allclose(base @ proj, mine, atol=1e-3 * float(mine.abs().max()))


TRAINED = FusionSpec(rule="route", params={"router": "trained"})


def routed_service(tiny_dir, path, names=("a", "b", "c")) -> FusionService:
    """The tiny experts with the router at `path` configured as `trained` (requests name routers)."""
    return FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, names=names,
                                                                   routers={"trained": str(path)})))


def test_saved_router_reloads_to_identical_outputs(trained, tiny_service, tiny_dir):
    path, _, _ = trained
    router, _ = load_router(path)
    again, _ = load_router(path)
    logits = torch.randn(3, 5, tiny_service.engine.vocab_size)
    context = context_rows([[1], [1, 2], [3], [4, 5, 6], [7]])
    a, b = router.fuse(logits, context), again.fuse(logits, context)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.weights, b.weights)
    service = routed_service(tiny_dir, path)
    completion = service.complete("hello world", {"max_tokens": 6, "ignore_eos": True}, TRAINED)
    service.close()
    assert len(completion.token_ids) == 6
    assert all(sum(a.weight for a in ev.attribution) == pytest.approx(1.0) for ev in completion.events)


def test_tau_reaches_the_route_rule_through_the_service(trained, tiny_dir):
    """`tau` in a request's params reaches the route rule (its arithmetic is checked against a reference in
    test_router_fast_path): a small tau moves the weights a step reports, a very large one leaves them as the
    router gave them; a bad tau is an error naming the field; `fusion eval`'s rows flip it on its own."""
    from fusion.tools.evaluation import default_rows

    path, _, _ = trained
    service = FusionService.from_config(parse_config(tiny_config_dict(
        tiny_dir, routers={"trained": str(path)}, fusion={"rule": "route", "params": {"router": "trained"}})))

    def first_weights(**params) -> torch.Tensor:  # (E,) the weights of the first generated step
        spec = FusionSpec(rule="route", params={"router": "trained", "fail_safe": False, **params})
        completion = service.complete("hello world", {"max_tokens": 1, "ignore_eos": True}, spec)
        return torch.tensor([a.weight for a in completion.events[0].attribution])

    plain, sharp, flat = first_weights(), first_weights(tau=0.05), first_weights(tau=1e6)
    assert (plain > 0.01).sum() >= 2  # the router mixes: there is a mixture to scale
    assert sharp.sum() == pytest.approx(1.0) and (sharp - plain).abs().max() > 1e-3
    torch.testing.assert_close(flat, plain, rtol=0, atol=1e-4)
    with pytest.raises(InvalidArgumentError, match="fusion.params.tau: rule 'route': tau must be"):
        service.resolve_spec(FusionSpec(rule="route", params={"router": "trained", "tau": -1}))
    assert "route (config, tau 1)" in [name for name, _ in default_rows(service)]
    service.close()
    sharp_config = FusionService.from_config(parse_config(tiny_config_dict(
        tiny_dir, routers={"trained": str(path)}, fusion={"rule": "route", "params": {"router": "trained", "tau": 2}})))
    flipped = dict(default_rows(sharp_config))["route (config, tau off)"]
    assert flipped.params == {"router": "trained", "tau": None}
    assert sharp_config.resolve_spec(flipped)[0].tau is None
    sharp_config.close()


def test_a_router_trained_under_tau_serves_it_unless_a_request_sets_its_own(tiny_service, tiny_dir, tmp_path,
                                                                               monkeypatch):
    """`train-router --tau` records the scaling in the checkpoint; a route rule that leaves `tau` out applies
    it (the weights a step reports are the scaled ones), a request's own tau replaces it, `tau: null` turns it
    off; a shipped copy's manifest command repeats it; `fusion eval`'s rows flip it off."""
    import json

    import fusion.tools.router_training as router_training
    from fusion.tools.evaluation import default_rows

    path = tmp_path / "tau.pt"
    train_router(tiny_service, path, texts=texts(), settings=RouterTrainSettings(
        minutes=5, max_texts=4, steps_per_text=1, lr=1e-2, tau=0.25, gate_texts=0))
    payload = torch.load(path, map_location="cpu", weights_only=True)
    assert json.loads(payload["metadata"])["settings"]["tau"] == 0.25
    service = FusionService.from_config(parse_config(tiny_config_dict(
        tiny_dir, routers={"trained": str(path)}, fusion={"rule": "route", "params": {"router": "trained"}})))

    def step(**params) -> tuple[float | None, torch.Tensor]:  # the rule's tau, the first step's weights (E,)
        spec = FusionSpec(rule="route", params={"router": "trained", "fail_safe": False, **params})
        completion = service.complete("hello world", {"max_tokens": 1, "ignore_eos": True}, spec)
        return service.resolve_spec(spec)[0].tau, torch.tensor([a.weight for a in completion.events[0].attribution])

    (default_tau, default), (same_tau, same), (off_tau, off), (own_tau, _) = (
        step(), step(tau=0.25), step(tau=None), step(tau=3))
    assert (default_tau, same_tau, off_tau, own_tau) == (0.25, 0.25, None, 3.0)
    torch.testing.assert_close(default, same, rtol=0, atol=1e-5)  # a cached prefix may round otherwise
    assert (default - off).abs().max() > 1e-3  # the scaling moved the router's weights
    flipped = dict(default_rows(service))["route (config, tau off)"]
    assert service.resolve_spec(flipped)[0].tau is None
    service.close()
    monkeypatch.setattr(router_training, "ROUTERS_DIR", tmp_path / "routers")
    shipped = router_training.ship_router(path, tiny_service)
    assert json.loads(shipped.with_suffix(".json").read_text())["command"].endswith(" --tau 0.25")
    with pytest.raises(ValueError, match=r"tau \(--tau\) must be a finite number > 0, got 0"):
        RouterTrainSettings(tau=0)


def test_route_weight_is_recorded_and_repeated_by_the_shipped_command(tiny_service, tmp_path, monkeypatch):
    """`train-router --route-weight 0` trains on the fused cross-entropy alone: the checkpoint records the
    weight and a shipped copy's command repeats it (the default weight is left out of the command)."""
    import json

    import fusion.tools.router_training as router_training

    monkeypatch.setattr(router_training, "ROUTERS_DIR", tmp_path / "routers")
    commands = {}
    for weight in (0.0, router_training.DEFAULT_ROUTE_WEIGHT):
        path = tmp_path / f"w{weight}.pt"
        train_router(tiny_service, path, texts=texts(), settings=RouterTrainSettings(
            minutes=5, max_texts=2, steps_per_text=1, lr=1e-2, route_weight=weight, gate_texts=0))
        payload = torch.load(path, map_location="cpu", weights_only=True)
        assert json.loads(payload["metadata"])["settings"]["route_weight"] == weight
        shipped = router_training.ship_router(path, tiny_service)
        commands[weight] = json.loads(shipped.with_suffix(".json").read_text())["command"]
    assert commands[0.0].endswith(" --route-weight 0")
    assert "--route-weight" not in commands[router_training.DEFAULT_ROUTE_WEIGHT]
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match=r"route_weight \(--route-weight\) must be a finite number >= 0"):
            RouterTrainSettings(route_weight=bad)


def test_router_refused_against_other_experts(trained, tiny_dir):
    path, _, _ = trained
    service = routed_service(tiny_dir, path, names=("b", "a", "c"))
    with pytest.raises(InvalidArgumentError, match="router 'trained' cannot be used with these experts"):
        service.resolve_spec(TRAINED)
    service.close()
    two = routed_service(tiny_dir, path, names=("a", "b"))
    with pytest.raises(InvalidArgumentError, match="router has 3 experts"):
        two.resolve_spec(TRAINED)
    two.close()


def test_requests_name_routers_never_files(trained, tiny_dir, tmp_path):
    """A request may not send a path (a file-existence oracle, and one router spelled many ways); an
    unknown name is NOT_FOUND listing the configured ones; a broken checkpoint does not leak its path."""
    path, _, _ = trained
    service = routed_service(tiny_dir, path)
    for spelling in (str(path), str(path.parent / "." / path.name), "/etc/passwd"):
        with pytest.raises(InvalidArgumentError, match="fusion.params.path: requests may not name files"):
            service.resolve_spec(FusionSpec(rule="route", params={"path": spelling}))
    with pytest.raises(NotFoundError, match=r"unknown router 'other'; known: \['auto', 'trained'\]"):
        service.resolve_spec(FusionSpec(rule="route", params={"router": "other"}))
    assert service.resolve_spec(TRAINED)[0] is service.resolve_spec(SpecOverrides(params={"router": "trained"},
                                                                                   rule="route"))[0]
    service.close()
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a checkpoint")
    service = routed_service(tiny_dir, broken)
    with pytest.raises(InvalidArgumentError) as err:
        service.resolve_spec(TRAINED)
    assert "router 'trained' cannot be used" in str(err.value) and str(tmp_path) not in str(err.value)
    service.close()


def test_router_always_picking_one_expert_reproduces_it(tiny_service):
    engine = tiny_service.engine
    router = Router(RouterShape(num_experts=3, vocab_size=engine.vocab_size))
    with torch.no_grad():
        for p in router.route.parameters():
            p.zero_()
        router.route.bias[2] = 50.0  # always expert "c"
    rule = Route(engine.names, router=router)
    prompt = [5, 17, 42, 99]
    routed = [e.token_id for e in engine.generate(GenerationRequest(
        [prompt] * 3, SamplingParams(max_tokens=12, ignore_eos=True), rule, [1.0, 1.0, 1.0]))]
    single, w = tiny_service.resolve_spec(FusionSpec(rule="single", params={"expert": "c"}))
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
    context = teacher_forced_context([5, 0], [1, 2, 3, 4])
    loss = router_loss(router, logits, context, targets, route_weight=0.0)
    _, w, _ = router(lp, context)
    fused = torch.log((w[..., None] * p).sum(0))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(fused, targets))
    # under tau, the mixture's weights are w_i exp(-H_i / tau), renormalised: as the route rule serves them
    tau = 0.7
    entropy = -(p * lp).sum(-1)  # (E, n)
    scaled = w * torch.exp(-entropy / tau)
    scaled = scaled / scaled.sum(0, keepdim=True)
    fused = torch.log((scaled[..., None] * p).sum(0))
    torch.testing.assert_close(router_loss(router, logits, context, targets, route_weight=0.0, tau=tau),
                               torch.nn.functional.cross_entropy(fused, targets))


def test_familiarity_gate_is_a_mahalanobis_distance():
    torch.manual_seed(0)
    mix = torch.randn(6, 6)
    fit, held = torch.randn(4000, 6) @ mix + 3.0, torch.randn(2000, 6) @ mix + 3.0
    gate = FamiliarityGate.fit(fit, held, generalist=1)
    # Reference: the shrunk covariance's inverse, by hand.
    centred = fit.double() - fit.double().mean(0)
    cov = centred.T @ centred / (len(fit) - 1)
    cov = cov + 1e-2 * cov.diagonal().mean() * torch.eye(6, dtype=cov.dtype)
    x = torch.randn(5, 6) * 4
    d = x.double() - fit.double().mean(0)
    expected = ((d @ torch.linalg.inv(cov)) * d).sum(-1) / 6
    torch.testing.assert_close(gate.distance(x).double(), expected, rtol=1e-3, atol=1e-4)
    # About 1% of familiar inputs are pulled at all; inputs far outside are pulled all the way.
    fresh = torch.randn(4000, 6) @ mix + 3.0
    assert 0.002 < float((gate.pull(fresh) > 0).float().mean()) < 0.03
    assert torch.equal(gate.pull(fresh * 0 + 1e3), torch.ones(4000))


def test_fail_safe_pulls_unfamiliar_steps_to_the_generalist():
    router = _random_router(10)
    logits, context = torch.randn(3, 2, 10), context_rows([[1, 2], [3]])
    inputs = router.inputs(torch.log_softmax(logits, -1), context).detach()
    # A gate that finds row 0 familiar (it is the mean) and row 1 far outside.
    router.gate = FamiliarityGate(inputs[0], torch.eye(inputs.shape[1]), limit=1e-3, generalist=2)
    with torch.no_grad():
        plain = router.fuse(logits, context)
        safe = router.fuse(logits, context, fail_safe=True)
        left_out = router.fuse(logits, context, allowed=torch.tensor([[True] * 2, [True] * 2, [False] * 2]),
                               fail_safe=True)
    torch.testing.assert_close(safe.logits[0], plain.logits[0])  # familiar: unchanged
    torch.testing.assert_close(safe.weights[:, 1], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(safe.logits[1], torch.log_softmax(logits[2, 1], -1))  # the generalist alone, no c
    assert left_out.weights[2].abs().max() == 0  # never pulled to an expert the request left out


def test_context_features_are_window_means():
    router = Router(RouterShape(num_experts=2, vocab_size=30, windows=(2, 4)))
    context = context_rows([[3, 4, 5, 6, 7], [9]], k=4)  # (2, 4)
    feats = router.context_features(context)
    emb = router.embed.weight.detach()
    expected0 = torch.cat([emb[7], emb[[6, 7]].mean(0), emb[[4, 5, 6, 7]].mean(0)])
    expected1 = torch.cat([emb[9], emb[9], emb[9]])  # padding never counts
    torch.testing.assert_close(feats.detach(), torch.stack([expected0, expected1]))


def _random_router(vocab_size: int) -> Router:
    torch.manual_seed(3)
    router = Router(RouterShape(num_experts=3, vocab_size=vocab_size))
    with torch.no_grad():
        router.comp.weight.normal_(std=0.5)  # make the complementary logit matter
    return router.eval()


def test_route_scores_what_it_generates(tiny_service):
    """The decode path (per-step context rows) and the teacher-forced path (sliding windows) give the
    router the same context: scored log-probs equal those reported while sampling, past the window."""
    engine = tiny_service.engine
    rule = Route(engine.names, router=_random_router(engine.vocab_size))
    prompt = [[5, 17, 42, 99, 7, 8]] * 3
    request = GenerationRequest(prompt, SamplingParams(max_tokens=70, ignore_eos=True, temperature=1.0, seed=11),
                                rule, [1.0, 1.0, 1.0])
    events = list(engine.generate(request))
    ids = [e.token_id for e in events]
    scored = engine.score(prompt, ids, rule, [1.0, 1.0, 1.0])
    assert scored == pytest.approx([e.logprob for e in events], abs=1e-4)


def test_complementary_logit_can_be_left_out(tiny_service):
    engine = tiny_service.engine
    router = _random_router(engine.vocab_size)
    logits = torch.randn(3, 4, engine.vocab_size)
    context = context_rows([[1, 2], [3], [4, 5], [6]])
    with_comp = Route(engine.names, router=router).fuse(logits, torch.ones(3, 4), context)
    pure = Route(engine.names, router=router, complementary=False).fuse(logits, torch.ones(3, 4), context)
    lp = torch.log_softmax(logits, -1)
    expected = torch.logsumexp(torch.log(pure.weights)[..., None] + lp, 0)
    torch.testing.assert_close(pure.logits, expected)
    comp = router.comp(router.body(torch.cat([logit_features(lp), router.context_features(context)], -1)))
    torch.testing.assert_close(with_comp.logits, expected + comp.detach())


def test_training_data_files(tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text('{"prompt": "What is 2 + 2?", "text": "4"}\n\n{"completion": "plain words"}\n')
    plain = tmp_path / "notes.txt"
    plain.write_text("x" * 3100)
    samples = file_samples([jsonl, plain], seed=0)
    seen = {next(samples) for _ in range(200)}
    assert TextSample("4", "What is 2 + 2?", end_turn=True) in seen
    assert TextSample("plain words") in seen
    assert {len(s.text) for s in seen if s.text.startswith("x")} == {1500, 100}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 needs a non-empty string \"text\""):
        next(file_samples([bad], seed=0))
    with pytest.raises(ValueError, match="no such file"):
        next(file_samples([tmp_path / "missing.txt"], seed=0))


def test_chat_sample_ids_end_the_turn(tiny_service):
    prompts, ids = tiny_service.sample_ids(TextSample("the cat", "hello", end_turn=True))
    tok = tiny_service.tokenizers[0]
    assert prompts == tiny_service.admit(FusionRequest("hello", {"max_tokens": 1})).prompt_ids
    assert ids == tok("the cat", add_special_tokens=False)["input_ids"] + [end_of_turn_id(tok)]


def test_auto_router_is_trained_once_per_trio(tiny_dir, tmp_path, caplog):
    """`router: auto` names the cached router of exactly these experts: refused (clearly) before it exists,
    by a request and by a service configured with it (loading never trains); trained once by the tool's
    `prepare_router`, then reused by every service of the same trio."""
    cache = tmp_path / "cache"
    config = parse_config(tiny_config_dict(tiny_dir))
    service = FusionService.from_config(config, cache_dir=cache)
    auto = FusionSpec(rule="route", params={"router": "auto"})
    with pytest.raises(InvalidArgumentError, match="no router is trained for these experts yet; run `fusion train-router`"):
        service.resolve_spec(auto)
    auto_config = parse_config(tiny_config_dict(tiny_dir, fusion=auto.model_dump()))
    with pytest.raises(AssetError, match="fusion.params.router: auto: no router is trained .*fusion train-router"):
        FusionService.from_config(auto_config, cache_dir=cache)
    assert not (cache / "routers").exists()
    path = prepare_router(service, RouterTrainSettings(max_texts=4, steps_per_text=1))
    assert path.parent == cache / "routers" and path.is_file()
    stamp = path.stat().st_mtime_ns
    assert prepare_router(service) == path and path.stat().st_mtime_ns == stamp  # not trained again
    expected = service.complete("hello world", {"max_tokens": 5}, auto)
    service.close()

    with caplog.at_level(logging.INFO, logger="fusion.frontdoor.service"):
        routed = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, fusion=auto.model_dump())),
                                            cache_dir=cache)
    # which file `router: auto` reads is said, and once: one trained here shadows a shipped one
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("router: auto reads")]
    assert said == [f"router: auto reads {path} (trained here for these experts)"]
    from fusion.tools.evaluation import evaluate

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusion.tools.evaluation"):
        evaluate(routed, questions=0, domains=[])  # the figures say whose they are
    assert f"router: auto reads {path}" in [r.getMessage() for r in caplog.records]
    assert path.stat().st_mtime_ns == stamp
    assert routed.complete("hello world", {"max_tokens": 5}).token_ids == expected.token_ids
    routed.close()
    swapped = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, names=("b", "a", "c"))),
                                         cache_dir=cache)
    assert swapped.auto_router_path() != path  # another trio, another router
    swapped.close()


def test_a_shipped_router_is_found_for_exactly_its_config_experts(tiny_dir, tmp_path, monkeypatch):
    """`train-router --ship` copies a router into the package (bf16 matrices, a manifest); `router: auto`
    finds it from an empty cache for the config whose expert refs it was shipped for, checked by names
    and tokenizers, and gives the answers of the router it was made from within bf16's rounding; another
    config's experts (renamed) do not find it."""
    import json

    import fusion.models as models
    import fusion.tools.router_training as router_training
    from fusion.fuse.router import load_router

    monkeypatch.setattr(models, "ROUTERS_DIR", tmp_path / "routers")
    monkeypatch.setattr(router_training, "ROUTERS_DIR", tmp_path / "routers")
    auto = FusionSpec(rule="route", params={"router": "auto"})
    trainer = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir)), cache_dir=tmp_path / "train-cache")
    trained = prepare_router(trainer, RouterTrainSettings(max_texts=4, steps_per_text=1))
    shipped = router_training.ship_router(trained, trainer)
    trainer.close()
    assert shipped.parent == tmp_path / "routers" and shipped.with_suffix(".json").is_file()
    manifest = json.loads(shipped.with_suffix(".json").read_text())
    assert manifest["experts"][0][0] == "a" and manifest["data_sha256"] and manifest["command"].startswith(
        "fusion train-router --ship --max-texts 4")
    _, payload = load_router(shipped)
    assert payload["identity"] == "config" and all(
        v.dtype == torch.bfloat16 for v in payload["state_dict"].values() if v.is_floating_point() and v.dim() >= 2)

    fresh = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, fusion=auto.model_dump())),
                                      cache_dir=tmp_path / "empty-cache")
    assert fresh.auto_router_checkpoint() == shipped
    assert fresh.complete("hello world", {"max_tokens": 5}).token_ids  # loads and routes
    fresh.close()
    other = parse_config(tiny_config_dict(tiny_dir, names=("b", "a", "c"), fusion=auto.model_dump()))
    with pytest.raises(AssetError, match="no router is trained"):
        FusionService.from_config(other, cache_dir=tmp_path / "empty-cache")


def test_a_router_trained_to_ship_stays_out_of_the_auto_entry(tiny_service, tmp_path):
    """`train-router --ship` without `--out` writes beside the cache entry `router: auto` reads: left in it, the
    local copy would shadow the shipped router, and every router shipped after it, on this machine."""
    from fusion.tools.cli import router_out

    entry = tiny_service.auto_router_path()
    assert router_out(tiny_service, None, ship=False) == entry
    shipping = router_out(tiny_service, None, ship=True)
    assert shipping != entry and shipping.parent == entry.parent and shipping.suffix == ".pt"
    assert router_out(tiny_service, tmp_path / "r.pt", ship=True) == tmp_path / "r.pt"
