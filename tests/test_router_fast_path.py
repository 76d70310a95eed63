"""The route rule's decode-step fast path against plain reference computations: the router's features
from raw logits equal `logit_features` of the log-softmax (computed in float64), the fused logits equal
the rule written out op by op (log_softmax → router → gate → one-hot pick → mixture + complementary
logit), the complementary layer's decoding layout keeps the checkpoint's values, and the engine's
greedy and seeded tokens are those of the written-out rule."""

from __future__ import annotations

import pytest
import torch

from fusion.compute import one_thread
from fusion.config import SamplingParams
from fusion.engine.types import GenerationRequest
from fusion.fuse.router import (
    FamiliarityGate,
    Route,
    Router,
    RouterShape,
    load_router,
    logit_features,
    logit_statistics,
    save_router,
)
from fusion.fuse.rules import CONTEXT_TOKENS, FusedLogits, FusionRule


def _logits(experts: int = 3, rows: int = 4, vocab: int = 1024, seed: int = 3) -> torch.Tensor:
    """Logits as experts send them: bfloat16 values (so top ids tie now and then) with masked ids."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(experts, rows, vocab, generator=generator) * 4).bfloat16().float()  # (E, B, V)
    logits[:, :, -5:] = float("-inf")  # padded rows, banned ids
    logits[0, 1, [7, 290]] = logits[0, 1].max() + 1.0  # a tied maximum (two ids)
    return logits


def _router(vocab: int, seed: int = 0, comp_rank: int = 0, windows: tuple[int, ...] = RouterShape.windows) -> Router:
    torch.manual_seed(seed)
    router = Router(RouterShape(num_experts=3, vocab_size=vocab, comp_rank=comp_rank, windows=windows)).eval()
    with torch.no_grad():
        router.comp.weight.normal_(0, 0.3)  # make the complementary logit matter
        router.comp.bias.normal_(0, 0.3)
    return router


def reference_fuse(router: Router, logits: torch.Tensor, context: torch.Tensor, allowed: torch.Tensor | None,
                   hard: bool, complementary: bool = True, fail_safe: bool = False,
                   tau: float | None = None) -> FusedLogits:
    """The route rule op by op, as it was first written: every tensor over the whole vocabulary."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (E, B, V)
    inputs = router.inputs(log_probs, context)
    _, weights, _ = router.head(inputs, allowed)
    # the complementary logit from the checkpoint's matrices: h W_downᵀ (factored heads) W_compᵀ + b
    state = router.state_dict()
    hidden = router.body(inputs)  # (B, hidden)
    if "comp_down.weight" in state:
        hidden = hidden @ state["comp_down.weight"].T  # (B, rank)
    comp = hidden @ state["comp.weight"].T + state["comp.bias"]  # (B, V)
    if fail_safe and router.gate is not None:
        pull = router.gate.pull(inputs)
        if allowed is not None:
            pull = pull * allowed[router.gate.generalist].to(pull.dtype)
        toward = torch.zeros_like(weights)
        toward[router.gate.generalist] = 1.0
        weights = (1 - pull) * weights + pull * toward
        comp = comp * (1 - pull)[:, None]
    if tau is not None:  # w_i exp(-H_i / tau) / sum_j w_j exp(-H_j / tau), H from the float64 log-softmax
        log_p = torch.log_softmax(logits.double(), dim=-1)
        entropy = -(log_p.exp() * torch.nan_to_num(log_p, neginf=0.0)).sum(-1)  # (E, B)
        scaled = weights.double() * torch.exp(-entropy / tau)
        weights = (scaled / scaled.sum(0, keepdim=True)).float()
    if hard:
        weights = torch.nn.functional.one_hot(weights.argmax(0), weights.shape[0]).T.to(weights.dtype)
    fused = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)
    if complementary:
        fused = fused + comp
    return FusedLogits(fused, weights, torch.logsumexp(logits.float(), dim=-1))


@pytest.mark.parametrize("vocab", [1024, 300])  # blockwise argmax, and the plain one (width not a block multiple)
def test_logit_statistics_equal_the_features_of_the_log_softmax(vocab):
    logits = _logits(vocab=vocab)
    features, normalizer = logit_statistics(logits)
    expected = logit_features(torch.log_softmax(logits.double(), dim=-1))  # float64 reference
    torch.testing.assert_close(features.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normalizer, torch.logsumexp(logits, dim=-1))
    # a tied maximum names the id topk names, as the features the router was trained on do
    torch.testing.assert_close(features, logit_features(torch.log_softmax(logits, dim=-1)), rtol=1e-4, atol=1e-4)
    assert features[1, 6] == 0  # expert 0's margin on the tied row


@pytest.mark.parametrize("hard", [True, False])
@pytest.mark.parametrize("fail_safe", [True, False])
@pytest.mark.parametrize("complementary", [True, False])
@pytest.mark.parametrize("comp_rank", [0, 16])  # one hidden → vocab layer, and the factored head
@pytest.mark.parametrize("tau", [None, 0.7])
def test_route_fuse_equals_the_reference(hard, fail_safe, complementary, comp_rank, tau):
    vocab = 1024
    router = _router(vocab, comp_rank=comp_rank)
    logits = _logits(vocab=vocab)
    context = torch.randint(-1, vocab, (4, CONTEXT_TOKENS), generator=torch.Generator().manual_seed(1))
    allowed = torch.tensor([[True] * 4, [True, False, True, True], [True, True, False, True]])  # (E, B)
    with torch.no_grad():
        inputs = router.inputs(torch.log_softmax(logits, -1), context)
        # a gate that finds rows 0 and 2 familiar and pulls row 1 half way and row 3 all the way
        router.gate = FamiliarityGate(inputs[0], torch.eye(inputs.shape[1]), limit=1.0, generalist=0)
        router.gate.limit = float(router.gate.distance(inputs[1:2])[0]) / 1.5
        result = router.fuse(logits, context, allowed, hard=hard, complementary=complementary, fail_safe=fail_safe,
                             tau=tau)
        expected = reference_fuse(router, logits, context, allowed, hard, complementary, fail_safe, tau)
    torch.testing.assert_close(result.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.weights, expected.weights)
    torch.testing.assert_close(result.log_normalizers, expected.log_normalizers)
    assert torch.equal(result.logits.argmax(-1), expected.logits.argmax(-1))


def _gated(router: Router, logits: torch.Tensor, context: torch.Tensor) -> Router:
    """`router` with a gate that finds row 0 familiar, pulls row 1 part of the way and the rest further (one
    row: pulls it half way)."""
    with torch.no_grad():
        inputs = router.inputs(torch.log_softmax(logits, -1), context)
        centre = inputs[0] if inputs.shape[0] > 1 else inputs[0] * 0.9
        router.gate = FamiliarityGate(centre, torch.eye(inputs.shape[1]), limit=1.0, generalist=0)
        router.gate.limit = float(router.gate.distance(inputs[min(1, inputs.shape[0] - 1)][None])[0]) / 1.5
    return router


def _torch_fuse(router: Router, *args, **kwargs) -> FusedLogits:
    """`router.fuse` through torch's operators alone (no C head)."""
    router._native_head = lambda *_, **__: None
    try:
        return router.fuse(*args, **kwargs)
    finally:
        del router._native_head


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fail_safe", [True, False])
@pytest.mark.parametrize("comp_rank,windows", [(0, RouterShape.windows), (16, RouterShape.windows), (16, (8,))])
@pytest.mark.parametrize("tau", [None, 0.5])
def test_the_c_head_computes_what_torchs_operators_do(rows, fail_safe, comp_rank, windows, tau):
    """Where the route rule's passes run in C, the router's head (context features, body, weights, the gate's
    pull, the complementary layer's input) is one C call: the same weights and fused logits as torch's
    operators, within float32 rounding, with experts left out of some rows."""
    from fusion.forward import native_kernels
    assert native_kernels.library() is not None  # (CI builds the kernels: the C head is what is tested)
    vocab = 1024
    router = _router(vocab, comp_rank=comp_rank, windows=windows)
    logits = _logits(rows=max(rows, 2), vocab=vocab)[:, :rows].contiguous()  # (its second row has a tie)
    context = torch.randint(-1, vocab, (rows, CONTEXT_TOKENS), generator=torch.Generator().manual_seed(2))
    context[0, :40] = -1  # a short history: windows with fewer ids than their width
    allowed = torch.ones(3, rows, dtype=torch.bool)
    allowed[1, -1] = False
    router = _gated(router, logits, context)
    assert router._native_params(CONTEXT_TOKENS) is not None
    with torch.no_grad():
        got = router.fuse(logits, context, allowed, fail_safe=fail_safe, tau=tau)
        want = _torch_fuse(router, logits, context, allowed, fail_safe=fail_safe, tau=tau)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))


def test_the_c_head_reads_a_replaced_tensor_and_copies_the_router():
    """The C head points at the router's tensors: one replaced (a new parameter, a new gate) is read from its
    new place, a context id past the embedding is an IndexError, a tensor it cannot read (float64) leaves the
    head to torch, and a router that has run it still copies (the pointers are not part of its state)."""
    import copy

    from fusion.forward import native_kernels
    assert native_kernels.library() is not None
    vocab = 1024
    router = _router(vocab, comp_rank=16)
    logits, context = _logits(rows=2, vocab=vocab), torch.randint(-1, vocab, (2, CONTEXT_TOKENS))
    allowed = torch.ones(3, 2, dtype=torch.bool)
    with torch.no_grad():
        router.fuse(logits, context, allowed)
        router.route.weight = torch.nn.Parameter(torch.randn(3, router.shape.hidden), requires_grad=False)
        router = _gated(router, logits, context)
        got = router.fuse(logits, context, allowed, fail_safe=True)
        want = _torch_fuse(router, logits, context, allowed, fail_safe=True)
        torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(router)
        torch.testing.assert_close(twin.fuse(logits, context, allowed).logits, router.fuse(logits, context, allowed).logits)
        outside = context.clone()
        outside[1, -1] = vocab  # past the embedding: an error, as torch's embedding raises, never a read past it
        with pytest.raises(IndexError):
            router.fuse(logits, outside, allowed)
        router.route.bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64), requires_grad=False)
        assert router._native_params(CONTEXT_TOKENS) is None


@pytest.mark.parametrize("comp_rank", [0, 8])
def test_decoding_layout_keeps_the_checkpoint(tmp_path, comp_rank):
    router = _router(512, comp_rank=comp_rank)
    path = save_router(router, tmp_path / "router.pt", ["a", "b", "c"], ["x", "y", "z"])
    loaded, _ = load_router(path)
    assert loaded.comp.weight.T.is_contiguous()  # (comp_width, V) rows for the per-step product
    assert loaded.shape.comp_rank == comp_rank
    for name, value in router.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    again, _ = load_router(save_router(loaded, tmp_path / "again.pt", ["a", "b", "c"], ["x", "y", "z"]))
    for name, value in router.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    logits, context = _logits(vocab=512), torch.randint(-1, 512, (4, CONTEXT_TOKENS))
    with torch.no_grad():
        torch.testing.assert_close(loaded.fuse(logits, context, hard=True).logits,
                                   router.fuse(logits, context, hard=True).logits)


def test_checkpoints_from_before_the_factored_head_load_as_one_layer(tmp_path):
    """A checkpoint whose shape has no comp_rank (written before the factored head) is one hidden → vocab
    layer, and fuses as it did."""
    router = _router(512)
    path = save_router(router, tmp_path / "old.pt", ["a", "b", "c"], ["x", "y", "z"])
    payload = torch.load(path, weights_only=True)
    del payload["shape"]["comp_rank"]
    torch.save(payload, path)
    loaded, _ = load_router(path)
    assert loaded.shape.comp_rank == 0 and loaded.comp_down is None
    logits, context = _logits(vocab=512), torch.randint(-1, 512, (4, CONTEXT_TOKENS))
    with torch.no_grad():
        torch.testing.assert_close(loaded.fuse(logits, context, hard=False).logits,
                                   router.fuse(logits, context, hard=False).logits)


def test_factored_head_rank_is_checked():
    with pytest.raises(ValueError, match="comp_rank"):
        RouterShape(num_experts=3, vocab_size=100, hidden=32, comp_rank=32)


def test_one_thread_restores_the_thread_count():
    threads = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


class ReferenceRoute(FusionRule):
    """`route` with `reference_fuse` in place of the fast path."""

    name = "route"

    def __init__(self, expert_names, router: Router, hard: bool) -> None:
        super().__init__(expert_names)
        self.router, self.hard = router, hard

    def fuse(self, logits, weights, context=None) -> FusedLogits:
        with torch.no_grad():
            return reference_fuse(self.router, logits, context, weights > 0, self.hard, fail_safe=True)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=12, ignore_eos=True),  # greedy
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7, logprobs=3),
])
def test_engine_tokens_equal_the_reference_rule(tiny_service, sampling):
    engine = tiny_service.engine
    router = _router(engine.vocab_size, seed=4)
    prompt = [[5, 17, 42, 99, 7]] * 3
    runs = []
    for rule in (Route(engine.names, router=router, hard=True), ReferenceRoute(engine.names, router, hard=True)):
        events = list(engine.generate(GenerationRequest(prompt, sampling, rule, [1.0, 1.0, 1.0])))
        runs.append(events)
    fast, reference = runs
    assert [e.token_id for e in fast] == [e.token_id for e in reference]
    assert [e.logprob for e in fast] == pytest.approx([e.logprob for e in reference], abs=1e-5)
    assert [[a.weight for a in e.attribution] for e in fast] == [[a.weight for a in e.attribution] for e in reference]
    assert [[i for i, _ in e.top_logprobs] for e in fast] == [[i for i, _ in e.top_logprobs] for e in reference]


def test_greedy_sampling_picks_the_first_maximum():
    from fusion.fuse.sampler import SamplingMetadata, sample

    logits = (torch.randn(4, 49152, generator=torch.Generator().manual_seed(2)) * 3).bfloat16().float()
    logits[1, [100, 40000]] = logits[1].max() + 1  # tied maxima: the first wins, as argmax
    md = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 4, 49152, {})
    out = sample(logits, md)
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.token_ids[1] == 100
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(-1, out.token_ids[:, None])[:, 0])
