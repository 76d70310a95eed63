"""The engine against plain references: hand-computed fusion of each model's own forward, and
transformers' generate."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from fusion.config import FusionSpec, Limits, SamplingParams, parse_config
from fusion.engine.core import FusionEngine
from fusion.engine.types import ErrorEvent, GenerationRequest
from fusion.errors import (
    ConfigError,
    ExpertOutputError,
    ExpertUnavailableError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from fusion.experts.expert import ExpertInfo, LocalExpert, StepRequest
from fusion.frontdoor.service import FusionRequest, FusionService
from fusion.fuse.registry import make_rule
from tests.conftest import tiny_config_dict
from tests.helpers import wait_until

HISTORIES = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 9, 10, 11, 12, 13, 14, 15]]  # B = 3, different lengths


def plain_last_logits(model_dir, histories):
    """Each history's next-token logits from a fresh plain forward of the model: (B, V)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([h])).logits[0, -1] for h in histories])


def reference_fusion(rule, params, z, w):
    """The rules written out plainly, row by row. z: list of E (B, V) tensors, w: E floats."""
    E, B = len(z), z[0].shape[0]
    out = torch.empty_like(z[0])
    for b in range(B):
        rows = [z[e][b] for e in range(E)]
        if rule == "weighted_logits":
            total = sum(w)
            out[b] = sum((w[e] / total) * rows[e] for e in range(E))
        elif rule == "mixture":
            total = sum(w)
            probs = sum((w[e] / total) * torch.softmax(rows[e], -1) for e in range(E))
            out[b] = probs.log()
        elif rule == "logit_arithmetic":
            lp = [torch.log_softmax(r, -1) for r in rows]
            combined = sum(w[e] * lp[e] for e in range(E))
            lead = torch.softmax(rows[0], -1)
            combined[lead < params["alpha"] * lead.max()] = -math.inf
            out[b] = combined
        elif rule == "confidence":
            probs = [torch.softmax(r, -1) for r in rows]
            entropy = [-(p * p.log()).sum() for p in probs]
            scores = torch.tensor([math.log(w[e]) - entropy[e] / params["tau"] for e in range(E)])
            we = torch.softmax(scores, 0)
            out[b] = sum(we[e] * probs[e] for e in range(E)).log()
        elif rule == "single":
            out[b] = rows[params["expert"]]
    return out


RULE_CASES = [
    ("weighted_logits", {}, [0.5, 0.3, 0.2]),
    ("mixture", {}, [0.2, 0.5, 0.3]),
    ("logit_arithmetic", {"alpha": 0.1}, [1.0, 0.5, -0.5]),
    ("confidence", {"tau": 0.7}, [1.0, 2.0, 1.0]),
    ("single", {"expert": 1}, [0.0, 1.0, 0.0]),
]


@pytest.mark.parametrize("rule,params,weights", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_fused_logits_equal_hand_computation(tiny_dir, tiny_service, rule, params, weights):
    engine = tiny_service.engine
    V = engine.vocab_size
    z = [plain_last_logits(tiny_dir / n, HISTORIES)[:, :V] for n in ("a", "b", "c")]
    rule_obj = make_rule(rule, params, engine.names)
    batch = engine.new_batch()
    for h in HISTORIES:
        batch.add(GenerationRequest([h] * 3, SamplingParams(), rule_obj, weights))
    step = batch.fused_logits()
    batch.cancel_all()
    expected = reference_fusion(rule, params, z, weights)
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(step.fused)), "masked ids differ"
    torch.testing.assert_close(step.fused[finite], expected[finite], rtol=1e-4, atol=1e-4)


def test_padded_vocab_is_cut_to_shared_ids(tiny_service):
    engine = tiny_service.engine
    widths = [e.info.vocab_size for e in engine.experts]
    assert widths[2] == widths[0] + 13
    assert engine.vocab_size == min(widths) == len(tiny_service.tokenizers[0])


def greedy_generate(model_dir, prompt, n):
    """Plain transformers greedy decoding; padded output rows (no token) are suppressed, as fusion cuts them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer_size = len(AutoTokenizer.from_pretrained(model_dir))
    padded = list(range(tokenizer_size, model.config.vocab_size)) or None
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                              suppress_tokens=padded)
    out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["a", "c"])
def test_single_expert_reproduces_generate(tiny_dir, name):
    config = parse_config({"experts": [{"name": name, "model": str(tiny_dir / name), "dtype": "float32"}]})
    service = FusionService.from_config(config)
    prompt = [5, 17, 42, 99, 7, 3]
    expected = greedy_generate(tiny_dir / name, prompt, 24)
    rule = make_rule("weighted_logits", {}, [name])
    request = GenerationRequest([prompt], SamplingParams(max_tokens=24, ignore_eos=True), rule, [1.0])
    tokens = [ev.token_id for ev in service.engine.generate(request)]
    assert tokens == expected
    # Prefix reuse: a second request whose prompt is the first's prompt plus half its output, on the
    # same session id, must continue exactly as generate does.
    expert = service.engine.experts[0]
    session = "reuse"
    history = prompt + expected[:12]
    expert.step([StepRequest(session, prompt)])  # cache holds the prompt only
    got = []
    for _ in range(12):
        logits = expert.step([StepRequest(session, history + got)])
        got.append(int(logits[0, : service.engine.vocab_size].argmax()))
    assert got == expected[12:]
    assert expert.cache.hits > 0
    expert.release([session])
    service.close()


def test_self_fusion_equals_generate(tiny_dir):
    """An expert fused with itself, any weights, weighted logits: the same greedy tokens."""
    config = parse_config({
        "experts": [
            {"name": "x", "model": str(tiny_dir / "a"), "dtype": "float32", "weight": 0.3},
            {"name": "y", "model": str(tiny_dir / "a"), "dtype": "float32", "weight": 0.7},
        ]
    })
    service = FusionService.from_config(config)
    prompt = [8, 9, 10, 11]
    rule, weights = service.resolve_spec(None)
    request = GenerationRequest([prompt, prompt], SamplingParams(max_tokens=16, ignore_eos=True), rule, weights)
    assert [ev.token_id for ev in service.engine.generate(request)] == greedy_generate(tiny_dir / "a", prompt, 16)
    service.close()


def test_batched_generation_equals_one_by_one(tiny_service):
    """Rows in one batch (greedy and seeded sampling, different prompt lengths) match their solo runs."""
    rule, weights = tiny_service.resolve_spec(FusionSpec(rule="mixture"))

    def requests():
        return [
            GenerationRequest([HISTORIES[0]] * 3, SamplingParams(max_tokens=10, ignore_eos=True), rule, weights),
            GenerationRequest([HISTORIES[1]] * 3, SamplingParams(max_tokens=7, temperature=0.9, seed=11,
                                                                 ignore_eos=True, top_k=50), rule, weights),
            GenerationRequest([HISTORIES[2]] * 3, SamplingParams(max_tokens=12, temperature=1.2, seed=5,
                                                                 top_p=0.9, ignore_eos=True), rule, weights),
        ]

    batched = tiny_service.engine.generate_many(requests())
    solo_runs = [[ev.token_id for ev in tiny_service.engine.generate(r)] for r in requests()]
    batch_runs = [[ev.token_id for ev in events] for events in batched.values()]
    assert [len(r) for r in batch_runs] == [10, 7, 12]
    assert batch_runs == solo_runs


def test_seed_reproduces_sample(tiny_service):
    params = {"temperature": 1.0, "seed": 1234, "max_tokens": 20, "ignore_eos": True}
    first = tiny_service.complete("hello world", params)
    second = tiny_service.complete("hello world", params)
    other = tiny_service.complete("hello world", params | {"seed": 99})
    assert first.token_ids == second.token_ids
    assert first.token_ids != other.token_ids


def test_attribution_and_logprobs(tiny_service):
    completion = tiny_service.complete("the quick brown fox", {"max_tokens": 5, "ignore_eos": True, "logprobs": 3})
    for event in completion.events:
        weights = [a.weight for a in event.attribution]
        assert [a.expert for a in event.attribution] == ["a", "b", "c"]
        assert sum(weights) == pytest.approx(1.0) and weights == pytest.approx([0.5, 0.3, 0.2])
        assert all(0.0 <= a.prob <= 1.0 for a in event.attribution)
        assert len(event.top_logprobs) == 3
        assert event.top_logprobs[0][1] >= event.logprob - 1e-6  # greedy picks the top id
        assert event.top_logprobs[0][0] == event.token_id


def test_score_matches_generation_logprobs(tiny_service):
    """Teacher-forced fused logprobs equal the logprobs reported while generating the same ids."""
    tok = tiny_service.tokenizers[0]
    prompt = "hello world"
    rule, weights = tiny_service.resolve_spec(None)
    prompt_ids = [tok(prompt)["input_ids"]] * 3
    request = GenerationRequest(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True), rule, weights)
    events = list(tiny_service.engine.generate(request))
    ids = [e.token_id for e in events]
    scored = tiny_service.engine.score(prompt_ids, ids, rule, weights)
    assert scored == pytest.approx([e.logprob for e in events], abs=1e-4)
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)


def test_stop_conditions(tiny_service):
    base = {"max_tokens": 12, "ignore_eos": True}
    full = tiny_service.complete("the quick brown fox", base)
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_id = full.token_ids[4]
    by_id = tiny_service.complete("the quick brown fox", base | {"stop_token_ids": [stop_id]})
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    stop_text = full.text[3:6]
    if stop_text.strip():
        by_text = tiny_service.complete("the quick brown fox", base | {"stop": [stop_text]})
        assert by_text.finish_reason == "stop"
        assert by_text.text == full.text[: full.text.index(stop_text)]


def test_eos_stops_unless_ignored(tiny_service):
    eos = tiny_service.tokenizers[0].eos_token_id
    biased = tiny_service.complete("hello", {"max_tokens": 10, "logit_bias": {eos: 100.0}})
    assert biased.token_ids == [eos] and biased.finish_reason == "stop"
    ignored = tiny_service.complete("hello", {"max_tokens": 3, "logit_bias": {eos: 100.0}, "ignore_eos": True})
    assert ignored.token_ids == [eos] * 3


def test_banned_ids_never_sampled(tiny_service):
    plain = tiny_service.complete("hello", {"max_tokens": 6, "ignore_eos": True})
    banned = sorted(set(plain.token_ids))
    again = tiny_service.complete("hello", {"max_tokens": 6, "ignore_eos": True, "banned_token_ids": banned})
    assert not set(again.token_ids) & set(banned)


def test_cancelled_stream_frees_sessions(tiny_service):
    stream = tiny_service.submit(FusionRequest("hello", {"max_tokens": 50, "ignore_eos": True}))
    events = iter(stream)
    next(events)
    assert all(stream.request_id in e.cache for e in tiny_service.engine.experts)
    events.close()  # the scheduler frees the sessions between steps
    wait_until(lambda: all(stream.request_id not in e.cache for e in tiny_service.engine.experts),
               timeout_s=10, message="the closed stream's sessions were not freed")
    assert all(stream.request_id not in e.cache for e in tiny_service.engine.experts)
    assert tiny_service.active == 0


# -- bad input --------------------------------------------------------------------------------
def test_unknown_rule_and_bad_params(tiny_service):
    with pytest.raises(InvalidArgumentError, match="unknown fusion rule 'nope'"):
        tiny_service.resolve_spec(FusionSpec(rule="nope"))
    with pytest.raises(InvalidArgumentError, match="alpha"):
        tiny_service.resolve_spec(FusionSpec(rule="logit_arithmetic", params={"alpha": 3}))
    with pytest.raises(InvalidArgumentError, match="no parameter"):
        tiny_service.resolve_spec(FusionSpec(rule="mixture", params={"temperature": 1}))


def test_weights_that_do_not_fit_the_rule(tiny_service):
    with pytest.raises(InvalidArgumentError, match="weights >= 0.*'c' has -1"):
        tiny_service.resolve_spec(FusionSpec(rule="mixture", weights={"a": 1, "b": 1, "c": -1}))
    with pytest.raises(InvalidArgumentError, match="positive weight sum"):
        tiny_service.resolve_spec(FusionSpec(weights={"a": 0}))
    with pytest.raises(InvalidArgumentError, match="lead expert 'a'"):
        tiny_service.resolve_spec(FusionSpec(rule="logit_arithmetic", weights={"a": -1, "b": 1}))
    rule = make_rule("mixture", {}, ["a", "b", "c"])
    with pytest.raises(InvalidArgumentError, match="needs 3 weights"):
        tiny_service.engine.admission.generation(GenerationRequest([[1]] * 3, SamplingParams(), rule, [1.0]))


def test_empty_experts_and_mismatched_tokenizers(tiny_dir):
    with pytest.raises(ConfigError, match="experts"):
        parse_config({"experts": []})
    with pytest.raises(InvalidArgumentError, match="at least one expert"):
        FusionEngine([])
    config = parse_config(tiny_config_dict(tiny_dir, names=("a", "other")))
    experts = [LocalExpert.load(e) for e in config.experts]
    with pytest.raises(ConfigError, match="experts 'a' and 'other' use different tokenizers"):
        FusionEngine(experts)  # token ids mean different strings: the token engine refuses them
    service = FusionService.from_config(config)  # the service fuses them over text instead
    try:
        assert service.cross is not None
    finally:
        service.close()


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -1, "top_k"),
    ("min_p", 2.0, "min_p"),
    ("max_tokens", 0, "max_tokens"),
    ("temperature", float("nan"), "temperature"),
])
def test_bad_sampling_values(tiny_service, field, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        tiny_service.admit(FusionRequest("hi", {field: value}))


def test_limits(tiny_dir):
    config = parse_config(tiny_config_dict(tiny_dir, limits={"max_prompt_tokens": 30, "max_tokens": 5}))
    service = FusionService.from_config(config)
    with pytest.raises(ResourceExhaustedError, match="max_prompt_tokens=30"):
        service.admit(FusionRequest("the quick brown fox jumps over the lazy dog " * 5, {"max_tokens": 5}))
    with pytest.raises(ResourceExhaustedError, match="max_tokens: 6 exceeds the limit 5"):
        service.admit(FusionRequest("hi", {"max_tokens": 6}))
    service.close()


class NaNExpert:
    """Wraps a real expert and poisons its logits, as a broken checkpoint would."""

    def __init__(self, inner, value):
        self.inner, self.value, self.info = inner, value, inner.info

    def _poison(self, out):
        if self.value == "all -inf":  # no token possible at all
            out[:] = float("-inf")
        else:
            out[:, 3] = self.value
        return out

    def step(self, requests):
        return self._poison(self.inner.step(requests))

    def score(self, session_id, token_ids, n):
        return self._poison(self.inner.score(session_id, token_ids, n))

    def release(self, ids):
        self.inner.release(ids)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "all -inf"])
def test_non_finite_logits_are_refused(tiny_service, value):
    experts = list(tiny_service.engine.experts)
    experts[1] = NaNExpert(experts[1], value)
    engine = FusionEngine(experts)
    rule = make_rule("weighted_logits", {}, engine.names)
    request = GenerationRequest([[1, 2, 3]] * 3, SamplingParams(max_tokens=3), rule, [1, 1, 1])
    with pytest.raises(ExpertOutputError, match="expert 'b' returned non-finite logits"):
        list(engine.generate(request))
    with pytest.raises(ExpertOutputError, match="expert 'b'"):
        engine.score([[1, 2, 3]] * 3, [4, 5], rule, [1, 1, 1])
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)
    engine.close()


def test_a_masked_token_is_not_refused(tiny_service):
    """-inf for some ids is how a model rules tokens out; only rows with NaN, +inf or nothing finite fail."""
    experts = list(tiny_service.engine.experts)
    experts[1] = NaNExpert(experts[1], float("-inf"))
    engine = FusionEngine(experts)
    rule = make_rule("mixture", {}, engine.names)
    request = GenerationRequest([[1, 2, 3]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), rule, [1, 1, 1])
    events = list(engine.generate(request))  # raises ExpertOutputError if the row were refused
    assert [e.index for e in events] == [0, 1, 2, 3]
    engine.close()


def _run_with_joins(engine, requests, joins):
    """Step one DecodeBatch, adding request i at step joins[i]; returns each request's token ids, and
    the prompt tokens the experts computed at each step (cache misses)."""
    batch = engine.new_batch()
    tokens = {r.request_id: [] for r in requests}
    computed, step = [], 0
    while step <= max(joins) or batch.active:
        for request, join in zip(requests, joins):
            if join == step:
                batch.add(request)
        before = [e.cache.misses for e in engine.experts]
        for event in batch.step():
            tokens[event.request_id].append(event.token_id)
        computed.append([e.cache.misses - b for e, b in zip(engine.experts, before)])
        step += 1
    return [tokens[r.request_id] for r in requests], computed


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}])
def test_chunked_prefill_gives_the_same_tokens(tiny_dir, sampling):
    """Long prompts joining a running batch are prefilled a chunk per step; every step computes at most
    one chunk of prompt per expert besides one id per running row, and the tokens equal those of
    whole-prompt prefill, greedy and seeded."""
    prompts = [list(range(5, 45)), [3, 250, 11], list(range(100, 161)), [8, 9, 10, 11, 12]]
    joins = [0, 0, 2, 3]
    results = {}
    for chunk in (4096, 7):
        config = parse_config(tiny_config_dict(tiny_dir, limits={"prefill_chunk_tokens": chunk}))
        service = FusionService.from_config(config)
        rule, weights = service.resolve_spec(None)
        requests = [
            GenerationRequest([p] * 3, SamplingParams(max_tokens=6, ignore_eos=True, seed=20 + i, **sampling),
                              rule, weights)
            for i, p in enumerate(prompts)
        ]
        results[chunk] = _run_with_joins(service.engine, requests, joins)
        service.close()
    (whole, whole_computed), (chunked, chunked_computed) = results[4096], results[7]
    assert chunked == whole
    assert all(len(t) == 6 for t in chunked)
    assert max(max(c) for c in whole_computed) >= 61  # the whole 61-id prompt in one step
    assert max(max(c) for c in chunked_computed) <= 7 + len(prompts)  # one chunk + one id per running row
    assert len(chunked_computed) > len(whole_computed)  # the prompts took several steps


# -- the decode step against mock experts (fixed logits) -----------------------------------------
class TableExpert:
    """An Expert whose next-token logits are a fixed function of the last id: `bias[(last + shift) % V]`
    is raised by `height`. It records every step it was asked for, and frees sessions on release."""

    def __init__(self, name: str, shift: int, height: float, vocab: int = 16, eos: int = 0):
        self.info = ExpertInfo(name=name, model="table", vocab_size=vocab, tokenizer_size=vocab,
                               tokenizer_fingerprint="table", eos_token_ids=(eos,), dtype="float32", device="cpu",
                               max_cached_tokens=1 << 20)
        self.shift, self.height = shift, height
        self.steps: list[list[tuple[str, list[int]]]] = []
        self.sessions: set[str] = set()

    def logits_after(self, last: int) -> torch.Tensor:  # (V,)
        row = torch.linspace(0.0, 1.0, self.info.vocab_size)  # a fixed, non-flat background
        row[(last + self.shift) % self.info.vocab_size] += self.height
        return row

    def step(self, requests):
        self.steps.append([(r.session_id, list(r.token_ids)) for r in requests])
        self.sessions.update(r.session_id for r in requests)
        return torch.stack([self.logits_after(r.token_ids[-1]) for r in requests])

    def score(self, session_id, token_ids, num_positions):
        return torch.stack([self.logits_after(t) for t in token_ids[-num_positions - 1:-1]])

    def release(self, session_ids):
        self.sessions.difference_update(session_ids)

    def describe(self):
        return self.info

    @property
    def active_sessions(self):
        return len(self.sessions)

    def close(self):
        pass


def test_decode_step_with_mock_experts_equals_a_hand_computation():
    """Two table experts, weighted logits 0.75/0.25, greedy: each step's token is the argmax of the
    weighted sum of the two tables, computed here by hand; each expert sees the whole shared history;
    rows of different prompts decode side by side; EOS and max_tokens end their rows."""
    a, b = TableExpert("a", shift=1, height=4.0), TableExpert("b", shift=3, height=10.0)
    engine = FusionEngine([a, b], Limits(max_tokens=8))
    timings = []
    engine.step_observers.append(timings.append)
    rule = make_rule("weighted_logits", {}, engine.names)
    weights = [0.75, 0.25]

    def expected_tokens(prompt, max_tokens):
        history, out = list(prompt), []
        while len(out) < max_tokens:
            fused = 0.75 * a.logits_after(history[-1]) + 0.25 * b.logits_after(history[-1])
            out.append(int(fused.argmax()))
            history.append(out[-1])
            if out[-1] == 0:  # EOS
                break
        return out

    prompts = {"p1": [5], "p2": [9, 2], "p3": [13]}
    requests = [GenerationRequest([p, p], SamplingParams(max_tokens=6), rule, weights, request_id=rid)
                for rid, p in prompts.items()]
    results = engine.generate_many(requests)
    for rid, prompt in prompts.items():
        tokens = [ev.token_id for ev in results[rid]]
        assert tokens == expected_tokens(prompt, 6), rid
        assert results[rid][-1].finish_reason == ("stop" if tokens[-1] == 0 else "length")
        assert [att.weight for att in results[rid][0].attribution] == pytest.approx(weights)
    # a's peak counts 0.75 * 4 = 3 against b's 0.25 * 10 = 2.5: a leads, so p3 runs 14, 15 and wraps to EOS.
    assert [ev.token_id for ev in results["p3"]] == [14, 15, 0]
    first_step = {sid: ids for sid, ids in a.steps[0]}
    assert first_step == {"p1": [5], "p2": [9, 2], "p3": [13]}  # every row in one batched step
    second_step = dict(a.steps[1])
    assert second_step["p1"] == [5] + [ev.token_id for ev in results["p1"][:1]]  # the shared history grows
    assert "p3" not in dict(a.steps[3]) and "p1" in dict(a.steps[3])  # a finished row leaves the batch
    assert not a.sessions and not b.sessions  # every session released
    assert len(timings) == len(a.steps) and all(t.step_s >= t.experts_s > 0 for t in timings)


class FaultyExpert:
    """Wraps a real expert: any step naming a session that contains `poison` raises `error`, as an
    out-of-memory forward or a lost replica would."""

    def __init__(self, inner, error):
        self.inner, self.error, self.info = inner, error, inner.info
        self.calls = 0

    def step(self, requests):
        self.calls += 1
        if any("poison" in r.session_id for r in requests):
            raise self.error
        return self.inner.step(requests)

    def score(self, session_id, token_ids, n):
        return self.inner.score(session_id, token_ids, n)

    def release(self, ids):
        self.inner.release(ids)


def _run_batch(engine, requests):
    batch = engine.new_batch()
    for r in requests:
        batch.add(engine.admit(r))
    tokens = {r.request_id: [] for r in requests}
    errors = {}
    while batch.active:
        for event in batch.step():
            if isinstance(event, ErrorEvent):
                errors[event.request_id] = event.error
            else:
                tokens[event.request_id].append(event.token_id)
    return tokens, errors


def test_a_failing_expert_call_fails_only_its_rows(tiny_service):
    """One request whose expert call fails (here: out of memory) leaves the batch with its own error; the
    call is retried in halves, so the rows batched with it decode on, token for token as they would
    alone, and every session is freed."""
    experts = list(tiny_service.engine.experts)
    experts[1] = FaultyExpert(experts[1], RuntimeError("CUDA out of memory"))
    engine = FusionEngine(experts)
    rule = make_rule("weighted_logits", {}, engine.names)

    def request(prompt, request_id):
        return GenerationRequest([prompt] * 3, SamplingParams(max_tokens=5, ignore_eos=True), rule, [1, 1, 1],
                                 request_id=request_id)

    prompts = {"ok-1": [5, 6, 7], "poison-1": [8, 9], "ok-2": [10, 11, 12, 13]}
    alone = {rid: [e.token_id for e in engine.generate(request(p, rid))] for rid, p in prompts.items() if "ok" in rid}
    tokens, errors = _run_batch(engine, [request(p, rid) for rid, p in prompts.items()])
    assert set(errors) == {"poison-1"} and tokens["poison-1"] == []
    assert isinstance(errors["poison-1"], ExpertOutputError) and "expert 'b'" in str(errors["poison-1"])
    assert "out of memory" not in str(errors["poison-1"])  # the detail goes to the log, not the client
    assert {rid: tokens[rid] for rid in alone} == alone
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)
    engine.close()


def test_a_lost_expert_fails_only_the_rows_that_consult_it(tiny_service):
    """An expert with no replica left fails the requests that read it, at once (no retries); a request
    whose weights leave that expert out decodes on as it would alone."""
    lost = ExpertUnavailableError("expert 'b': no replica could answer")
    experts = list(tiny_service.engine.experts)
    experts[1] = FaultyExpert(experts[1], lost)
    engine = FusionEngine(experts)
    rule = make_rule("weighted_logits", {}, engine.names)

    def request(prompt, request_id, weights):
        return GenerationRequest([prompt] * 3, SamplingParams(max_tokens=5, ignore_eos=True), rule, weights,
                                 request_id=request_id)

    without_b = request([10, 11, 12], "ok-without-b", [1, 0, 1])
    alone = [e.token_id for e in engine.generate(request([10, 11, 12], "alone", [1, 0, 1]))]
    calls = experts[1].calls
    tokens, errors = _run_batch(engine, [request([5, 6], "poison-with-b", [1, 1, 1]),
                                         request([7, 8], "other-with-b", [1, 1, 1]), without_b])
    assert errors == {"poison-with-b": lost, "other-with-b": lost}
    assert tokens["ok-without-b"] == alone
    assert experts[1].calls == calls + 1  # one failed call, no retries of a lost expert
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)
    engine.close()


def test_fused_logits_that_overflow_end_the_request_with_the_cause(tiny_service):
    """Finite experts, weights float32 can hold, yet logit arithmetic with weights of 1e38 overflows:
    the request ends with an error naming the cause (never a token sampled from NaN), its batch-mates
    go on, and a score refuses the same way."""
    engine = tiny_service.engine
    names = tiny_service.expert_names
    rule = make_rule("logit_arithmetic", {"lead": names[0]}, names)
    huge = GenerationRequest([[5, 17, 42]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), rule, [1e38, 1e38, 0.0])
    rule_ok, weights_ok = tiny_service.resolve_spec(None)
    fine = GenerationRequest([[5, 17, 42]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), rule_ok, weights_ok)
    batch = engine.new_batch()
    for request in (huge, fine):
        engine.admit(request)
        batch.add(request)
    events = batch.step()
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert [e.request_id for e in errors] == [huge.request_id]
    assert isinstance(errors[0].error, ExpertOutputError) and "overflowed float32" in str(errors[0].error)
    assert [e.request_id for e in events if not isinstance(e, ErrorEvent)] == [fine.request_id]
    while batch.active:
        assert not any(isinstance(e, ErrorEvent) for e in batch.step())
    with pytest.raises(ExpertOutputError, match="overflowed float32"):
        engine.score([[5, 17, 42]] * 3, [9, 11], rule, [1e38, 1e38, 0.0])
    assert all(len(e.cache) == 0 for e in engine.experts)
