"""Cross-tokenizer fusion (fusion.crosstok.step, fusion.crosstok.decode) on tiny models over two
different byte-level BPE vocabularies, against plain reference computations."""

from __future__ import annotations

import math
from functools import lru_cache

import openai
import pytest
import torch

from fusion.config import ExpertConfig, SamplingParams, parse_config
from fusion.crosstok.step import END, CrossParams, CrossTokenizerFusion, _Row
from fusion.crosstok.decode import decode, score_text
from fusion.errors import InvalidArgumentError
from fusion.experts.expert import ExpertInfo, LocalExpert
from fusion.fuse.rules import Mixture, WeightedLogits
from fusion.frontdoor.service import FusionRequest, FusionService
from fusion.crosstok.spelling import Spelling
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S
from tests.tiny_models import make_model, make_tokenizer

OTHER_CORPUS = [
    "a quick brown dog jumps over the lazy fox",
    "12 plus 35 equals 47 , and 9 times 9 is 81",
    "def mul ( x , y ) : return x * y",
    "hello there , small models decode together",
] * 5


@pytest.fixture(scope="module")
def xdir(tiny_dir, tmp_path_factory):
    """`a` (the shared tiny tokenizer) and `x` (another byte-level BPE vocabulary, another model)."""
    root = tmp_path_factory.mktemp("xtok")
    other = make_tokenizer(root / "tokx", vocab_size=330, corpus=OTHER_CORPUS)
    make_model(root / "x", other, seed=7)
    return {"a": tiny_dir / "a", "x": root / "x"}


def load(path, name="e"):
    return LocalExpert.load(ExpertConfig(name=name, model=str(path), dtype="float32"))


def spelling_of(expert):
    return Spelling.from_tokenizer(expert.tokenizer, expert.info.eos_token_ids)


def plain_last_logits(expert, ids):
    """The next-token logits after `ids` from the expert's model alone, uncached."""
    with torch.no_grad():
        return expert.model(torch.tensor([ids])).logits[0, -1].float()


# -- one step's rows and events -------------------------------------------------------------------
def test_rows_answer_prefix_queries_as_a_full_cumulative_sum_does(xdir):
    """`_Row.batch` (all rows per op, one thread, each indexed over its span only) against the plain
    computation: one full cumulative sum over each row's ids sorted by bytes."""
    spelling = spelling_of(load(xdir["x"]))
    torch.manual_seed(0)
    logits = torch.randn(3, spelling.vocab_size + 5) * 4  # padded output rows beyond the vocabulary
    n = len(spelling.sorted_ids)
    spans = [(0, n), spelling.range_of(b" q"), (0, 0)]  # every id; a narrow range; none
    queries = [spelling.range_of(x) for x in (b"", b" ", b" q", b" qu", b"1", b"zz", b"\xff")] + [(5, 5), (0, n)]
    threads = torch.get_num_threads()
    for row, plain, span in zip(_Row.batch(logits, spelling, spans), logits, spans):
        logp = torch.log_softmax(plain[: spelling.vocab_size], dim=-1)
        probs = logp[spelling.sorted_ids].exp().double()
        csum = torch.cat([probs.new_zeros(1), probs.cumsum(0)])
        assert torch.equal(row.logp, logp)
        if span == (0, n):
            assert torch.equal(row.csum, csum)  # the full row is the plain computation itself
        expected = torch.stack([csum[hi] - csum[lo] for lo, hi in queries])
        torch.testing.assert_close(row.span_masses(torch.tensor([lo for lo, _ in queries]),
                                                   torch.tensor([hi for _, hi in queries])), expected,
                                   rtol=1e-12, atol=1e-15)
        for lo, hi in queries:
            assert row.mass(lo, hi) == pytest.approx(float(csum[hi] - csum[lo]), rel=1e-12, abs=1e-15)
            if hi > lo:
                values, ids = row.top(lo, hi, 4)
                top = torch.topk(logp[spelling.sorted_ids[lo:hi]], min(4, hi - lo))
                assert values == top.values.tolist()
                assert ids == spelling.sorted_ids[lo:hi][top.indices].tolist()
    assert torch.get_num_threads() == threads  # restored after the single-threaded ops


# -- exact text probabilities ---------------------------------------------------------------------
class PlainReference:
    """P(the text after `ids` starts with x), by recursion over every spelling with uncached forwards."""

    def __init__(self, expert, spelling):
        self.expert, self.spelling = expert, spelling
        self.rows = lru_cache(maxsize=None)(self._row)

    def _row(self, ids):
        return torch.log_softmax(plain_last_logits(self.expert, list(ids)).double(), -1).exp()

    def prefix(self, ids, x):
        probs, total = self.rows(tuple(ids)), 0.0
        for t, b in enumerate(self.spelling.token_bytes):
            if not b:
                continue
            if b.startswith(x):
                total += float(probs[t])
            elif x.startswith(b):
                total += float(probs[t]) * self.prefix(list(ids) + [t], x[len(b):])
        return total

    def end(self, ids, u):
        """P(the text after ids is exactly u, then an end-of-sequence id)."""
        probs = self.rows(tuple(ids))
        total = float(probs[list(self.expert.info.eos_token_ids)].sum()) if not u else 0.0
        for t, b in enumerate(self.spelling.token_bytes):
            if b and u.startswith(b):
                total += float(probs[t]) * self.end(list(ids) + [t], u[len(b):])
        return total


def test_events_are_exact_text_probabilities(xdir):
    """Exact mode: each event's probability is P(starts with u+c, not with a longer candidate) / P(u),
    computed here by brute force over every spelling."""
    expert = load(xdir["a"])
    spelling = spelling_of(expert)
    fusion = CrossTokenizerFusion([expert], [spelling], CrossParams.exact(top_k=4))
    prompt = expert.tokenizer("the answer is 4", add_special_tokens=False)["input_ids"]
    (state,) = fusion.open([prompt], [True], hold_back_prompt=True)
    assert state.pending == b" 4"
    pieces, logprobs = fusion.events([state])
    reference = PlainReference(expert, spelling)
    u = state.pending
    denominator = reference.prefix(state.ids, u)
    texts = [p for p in pieces if p is not END]
    checked = [p for p in texts if len(p) > 1] + [b" ", b"7", b"x"]
    for piece in checked:
        children = [c for c in texts if c.startswith(piece) and len(c) > len(piece)
                    and not any(c.startswith(m) and len(piece) < len(m) < len(c) for m in texts)]
        mass = reference.prefix(state.ids, u + piece) - sum(reference.prefix(state.ids, u + c) for c in children)
        assert math.isclose(math.exp(float(logprobs[0, pieces.index(piece)])), mass / denominator,
                            rel_tol=1e-4, abs_tol=1e-9), piece
    end = reference.end(state.ids, u) / denominator
    assert math.isclose(math.exp(float(logprobs[0, -1])), end, rel_tol=1e-4, abs_tol=1e-9)
    assert math.isclose(float(logprobs[0].double().exp().sum()), 1.0, abs_tol=1e-3)  # a partition
    fusion.close([state])


def test_serving_paths_carry_their_spellings_probabilities(xdir):
    """Serving's one pruned lookahead level (few paths kept, so canonical spellings come in without a row
    to read their probability from): every path looked at has the probability of its ids, the product
    of each id's probability after the ones before it, from plain forwards."""
    experts = [load(xdir["a"], "a"), load(xdir["x"], "x")]
    fusion = CrossTokenizerFusion(experts, [spelling_of(e) for e in experts], CrossParams(max_paths=1))
    prompts = [e.tokenizer("the quick brown fox, 12 plus 35", add_special_tokens=False)["input_ids"] for e in experts]
    states = fusion.open(prompts, [True, True], hold_back_prompt=True)
    canonical = 0
    for _ in range(4):
        pieces, logprobs = fusion.events(states)
        for state, expert in zip(states, experts):
            for path in state.paths.values():
                logp, ids = 0.0, list(state.ids)
                for token in path.tokens:
                    logp += float(torch.log_softmax(plain_last_logits(expert, ids).double(), -1)[token])
                    ids.append(token)
                assert math.isclose(path.logp, logp, rel_tol=1e-4, abs_tol=1e-4), (expert.info.name, path.text)
                canonical += len(path.text) > len(state.pending)  # beyond u: a looked-ahead spelling
        longer = [j for j, p in enumerate(pieces) if p is not END and len(p) > 1]  # advance by multi-byte pieces
        choice = max(longer, key=lambda j: float(logprobs[:, j].sum()))
        for state in states:
            state.advance(pieces[choice])
    assert canonical  # looked-ahead spellings were checked too
    fusion.close(states)


class MergedExpert:
    """Expert `inner` seen through a vocabulary with extra merged tokens: id V + j spells the bytes of
    the pair `merges[j]` = (a, b) and has probability p(a) p(b | a); id a < V keeps the mass of a not
    followed by a merge partner. The same text distribution, spelled differently."""

    def __init__(self, inner, merges):
        self.inner, self.merges = inner, merges
        self.base = inner.info.vocab_size
        info = inner.info
        self.info = ExpertInfo(**{**vars(info), "name": "merged", "vocab_size": self.base + len(merges),
                                  "tokenizer_size": self.base + len(merges), "tokenizer_fingerprint": "merged"})

    def expand(self, ids):
        out = []
        for t in ids:
            out += list(self.merges[t - self.base]) if t >= self.base else [t]
        return out

    def spelling(self, inner_spelling):
        token_bytes = list(inner_spelling.token_bytes) + [inner_spelling.spell(m) for m in self.merges]
        pairs = {m: self.base + j for j, m in enumerate(self.merges)}

        def encode(text):
            ids, out = inner_spelling.encode(text), []
            for t in ids:
                if out and (out[-1], t) in pairs:
                    out[-1] = pairs[(out[-1], t)]
                else:
                    out.append(t)
            return out

        return Spelling(token_bytes, encode, inner_spelling.eos_ids)

    def extend(self, session_id, token_ids, extensions):
        base = self.expand(token_ids)
        firsts = sorted({a for a, _ in self.merges})
        rows = []
        for ext in extensions:
            ext = self.expand(ext)
            logits = self.inner.extend(session_id, base, [ext] + [ext + [a] for a in firsts])
            probs = torch.softmax(logits.double(), -1)  # (1 + len(firsts), V)
            row = probs[0].clone()
            merged = torch.zeros(len(self.merges), dtype=torch.float64)
            for j, (a, b) in enumerate(self.merges):
                p_ab = probs[0, a] * probs[1 + firsts.index(a), b]
                merged[j] = p_ab
                row[a] -= p_ab
            rows.append(torch.cat([row, merged]).clamp(min=1e-300).log())
        return torch.stack(rows)

    def release(self, session_ids):
        self.inner.release(session_ids)


def test_a_retokenized_copy_fuses_to_the_same_text_probabilities(xdir):
    """Expert `a` and `a` seen through merged tokens spell text differently but mean the same text
    distribution: in exact mode each one's events, and the fused ones, equal `a`'s alone."""
    expert = load(xdir["a"])
    spelling = spelling_of(expert)
    tok = expert.tokenizer
    prompt = tok("what is 12 + 35 ? the answer is", add_special_tokens=False)["input_ids"]
    sample = spelling.encode("what is 12 + 35 ? the answer is 47 . the quick brown fox")
    merges = []
    for pair in zip(sample, sample[1:]):  # adjacent pairs whose bytes no single id of a's spells
        # (not the prompt's last id: both experts then hold back the same pending text)
        if pair not in merges and not spelling.ids_of(spelling.spell(pair)) and prompt[-1] not in pair:
            merges.append(pair)
    merges = merges[:8]
    assert len(merges) >= 4
    merged = MergedExpert(expert, merges)
    merged_spelling = merged.spelling(spelling)
    merged_prompt = merged_spelling.encode("what is 12 + 35 ? the answer is")
    alone = CrossTokenizerFusion([expert], [spelling], CrossParams.exact(top_k=6))
    pair = CrossTokenizerFusion([expert, merged], [spelling, merged_spelling], CrossParams.exact(top_k=6))
    (solo,) = alone.open([prompt], [True], hold_back_prompt=True)
    states = pair.open([prompt, merged_prompt], [True, True], hold_back_prompt=True)
    pieces, logprobs = pair.events(states)
    assert any(len(p or b"") > 1 and p not in [spelling.token_bytes[i] for i in range(len(spelling.token_bytes))]
               for p in pieces[:-1]) or len(pieces) > 257  # the merged vocabulary proposes its own pieces
    torch.testing.assert_close(logprobs[0].exp(), logprobs[1].exp(), rtol=1e-4, atol=1e-7)
    alone_probs = torch.softmax(logprobs[0], -1)
    weights = torch.tensor([[0.5], [0.5]])
    for rule in (Mixture(["a", "m"]), WeightedLogits(["a", "m"])):
        fused = torch.softmax(rule.fuse(logprobs[:, None], weights).logits[0], -1)
        torch.testing.assert_close(fused, alone_probs, rtol=1e-4, atol=1e-7)
    # and the text probabilities are a's own (its events over the same candidate pieces)
    alone_pieces, alone_logprobs = alone.events([solo])
    for j, piece in enumerate(alone_pieces):
        if piece is END:
            continue
        reference = PlainReference(expert, spelling)
        u = solo.pending
        assert math.isclose(reference.prefix(solo.ids, u + piece) / reference.prefix(solo.ids, u),
                            sum(math.exp(float(logprobs[0, k])) for k, p in enumerate(pieces)
                                if p is not END and p.startswith(piece)), rel_tol=1e-3, abs_tol=1e-7) \
            if len(piece) > 1 and j % 5 == 0 else True
    alone.close([solo])
    pair.close(states)


# -- decoding through the service -----------------------------------------------------------------
@pytest.fixture(scope="module")
def sharp_dir(tiny_dir, tmp_path_factory):
    """A confident tiny model (large output weights), so that greedy decoding has clear winners."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("sharp")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a")
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(root / "s")
    AutoTokenizer.from_pretrained(tiny_dir / "a").save_pretrained(root / "s")
    return root / "s"


def two_expert_config(paths, **extra):
    data = {"experts": [{"name": n, "model": str(p), "dtype": "float32", "weight": 0.5} for n, p in paths.items()],
            "fusion": {"rule": "weighted_logits"}}
    data.update(extra)
    return parse_config(data)


def test_greedy_self_fusion_is_the_same_text_on_both_paths(sharp_dir):
    """An expert fused with itself: the shared-tokenizer path (token ids) and the cross-tokenizer
    path (text) produce the same greedy text."""
    paths = {"one": sharp_dir, "two": sharp_dir}
    texts = []
    for alignment in ("auto", "text"):
        service = FusionService.from_config(two_expert_config(paths, alignment=alignment))
        assert (service.cross is not None) == (alignment == "text")
        try:
            texts.append(service.complete("the quick brown", {"max_tokens": 16, "ignore_eos": True}).text)
        finally:
            service.close()
    token_text, cross_text = texts
    assert len(token_text) > 20
    n = min(len(token_text), len(cross_text))
    assert cross_text[:n] == token_text[:n]


@pytest.fixture(scope="module")
def cross_service(xdir):
    service = FusionService.from_config(two_expert_config({"a": xdir["a"], "x": xdir["x"]}))
    yield service
    service.close()


@pytest.mark.parametrize("prompt", ["the answer is ", "the quick bro", "what is 12 + 3", "hello world ,"])
def test_histories_always_spell_the_shared_text(cross_service, prompt):
    """Prompts whose last characters re-tokenize once text follows (a trailing space, a partial word,
    digits): every expert's ids, then its pending bytes, spell the prompt's tail and the generated text
    at every step, and the ids are the ones its own tokenizer would give for what it committed."""
    service = cross_service
    prompt_ids = service.prompt_ids(prompt, plain=True)
    rule, weights = service.resolve_spec(None)
    states: list = []
    text = b""
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    for piece in decode(service.cross, prompt_ids, sampling, rule, weights, hold_back_prompt=True,
                        states_out=states):
        for state in states:  # this step's view: the text before the piece
            held = state.spelling.token_bytes[prompt_ids[state.index][-1]]
            assert state.text() == held + text
            assert state.ids[: state.start] == prompt_ids[state.index][:-1]
            committed = state.spelling.spell(state.ids[state.start:])
            if committed:  # the committed ids are valid ids of the expert's tokenizer for their text
                decoded = service.tokenizers[state.index].decode(state.ids[state.start:])
                assert decoded.encode() == committed or "\ufffd" in decoded
        text += piece.piece
    assert len(text) > 0


def test_cross_service_generates_scores_and_refuses_token_fields(cross_service):
    service = cross_service
    assert service.cross is not None
    result = service.complete("the quick brown", {"max_tokens": 8, "seed": 1, "temperature": 0.8})
    assert result.finish_reason in ("length", "stop") and result.text
    streamed = "".join(e.text for e in service.submit(FusionRequest("hello world", {"max_tokens": 6, "seed": 2})))
    assert isinstance(streamed, str)
    scored = service.score("what is 12 + 35 ?", " the answer is 47 .")
    assert scored.text == " the answer is 47 ." and "".join(scored.pieces) == scored.text
    assert scored.bits_per_byte is not None and 0 < scored.bits_per_byte < 30
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        service.submit(FusionRequest("x", {"logit_bias": {3: 1.0}}))
    with pytest.raises(InvalidArgumentError, match="token_healing"):
        service.submit(FusionRequest("the answer is ", {"token_healing": True}, plain=True))
    with pytest.raises(InvalidArgumentError, match="route rule needs experts of one tokenizer"):
        service.resolve_spec(_route_spec())


def _route_spec():
    from fusion.config import SpecOverrides

    return SpecOverrides(rule="route", params={"router": "auto"})


def test_text_level_scoring_agrees_with_token_level_for_one_expert(xdir):
    """One expert alone: the text-level log-probability of a text counts every spelling, so it is at
    least the token-level one of its canonical spelling, and close to it."""
    expert = load(xdir["x"])
    spelling = spelling_of(expert)
    fusion = CrossTokenizerFusion([expert], [spelling], CrossParams.exact(top_k=4))
    text = "12 plus 35 equals 47"
    prompt = expert.tokenizer("", add_special_tokens=True)["input_ids"] or [expert.tokenizer.eos_token_id]
    scored = score_text(fusion, [prompt], text.encode(), [(Mixture(["x"]), [1.0])])
    ids = expert.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = expert.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
    token_level = float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).sum())
    text_level = sum(scored.logprobs[0])
    assert b"".join(scored.pieces) == text.encode()
    assert text_level >= token_level - 1e-3


# -- remote experts over gRPC ---------------------------------------------------------------------
def test_remote_cross_tokenizer_fusion_matches_local(loop, xdir, cross_service):
    """Both experts behind expert servers (the Extend call), fused by a coordinator: the same text and
    scores as in-process."""
    from fusion.services.client import FusionClient
    from fusion.services.coordinator import create_coordinator_server
    from fusion.services.expert_server import create_expert_server

    config = cross_service.config
    servers = {e.name: loop.run(create_expert_server(LocalExpert.load(e), config.limits, metrics_port=0,
                                                     metrics_host="127.0.0.1")) for e in config.experts}
    data = config.model_dump()
    for expert in data["experts"]:
        expert["addresses"] = [f"127.0.0.1:{servers[expert['name']][1]}"]
    coordinator, port = loop.run(create_coordinator_server(parse_config(data), metrics_port=0,
                                                           metrics_host="127.0.0.1", http_address="127.0.0.1:0"))
    try:
        sampling = {"max_tokens": 10, "ignore_eos": True}
        local = cross_service.complete("the quick brown", sampling).text
        with FusionClient(f"127.0.0.1:{port}", timeout=HANG_S) as client:
            remote = "".join(e.text for e in client.generate("the quick brown", sampling))
            scored = client.score("what is 12 + 35 ?", " the answer is 47 .")
        assert remote == local
        # The same coordinator's OpenAI-compatible HTTP API, whole and streamed, greedy.
        greedy = cross_service.complete("the quick brown", {**sampling, "temperature": 0.0}).text
        assert greedy
        http = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{coordinator.http_port}/v1",
                             max_retries=0, timeout=HANG_S)
        chat = dict(model="fusion", messages=[{"role": "user", "content": "the quick brown"}], max_tokens=10,
                    temperature=0.0, extra_body={"ignore_eos": True})
        assert http.chat.completions.create(**chat).choices[0].message.content == greedy
        streamed = "".join(c.choices[0].delta.content or "" for c in http.chat.completions.create(**chat, stream=True)
                           if c.choices)
        assert streamed == greedy
        expected = cross_service.score("what is 12 + 35 ?", " the answer is 47 .")
        assert scored.pieces == expected.pieces
        assert scored.bits_per_byte == pytest.approx(expected.bits_per_byte, rel=1e-4)
    finally:
        loop.run(coordinator.stop(0))
        for server, _ in servers.values():
            loop.run(server.stop(0))


def test_cli_score_and_eval_report_bits_per_byte(cross_service, tmp_path):
    """`fusion score` and the eval's bits per byte, for experts of different tokenizers."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    from fusion.tools.evaluation import bits_per_byte as eval_bits_per_byte, default_rows

    config = tmp_path / "cross.yaml"
    config.write_text(yaml.safe_dump(cross_service.config.model_dump(exclude_defaults=True)))
    env = dict(os.environ, FUSION_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "fusion.tools.cli", "score", "--prompt", "what is 12 + 35 ?",
                          "--continuation", " the answer is 47 .", "--config", str(config), "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    expected = cross_service.score("what is 12 + 35 ?", " the answer is 47 .")
    assert payload["pieces"] == expected.pieces and payload["token_ids"] == []
    assert payload["bits_per_byte"] == pytest.approx(expected.bits_per_byte, rel=1e-3)
    rows = default_rows(cross_service)
    names = [name for name, _ in rows]
    assert "a alone" in names and "x alone" in names and not any("route" in n for n in names)
    texts = ["the quick brown fox", ("what is 12 + 35 ?", " the answer is 47 .")]
    bpb = eval_bits_per_byte(cross_service, [spec for _, spec in rows], texts)
    assert all(0 < b < 40 for b in bpb)


def test_exact_text_probability_does_not_depend_on_the_partition(xdir):
    """In exact mode a text's probability under one expert is the same whether the step's candidates
    come from it alone or from another tokenizer too (the events only partition it differently), and
    it is at least the probability of its canonical token spelling (it counts every spelling)."""
    from fusion.fuse.rules import Single

    a, x = load(xdir["a"], "a"), load(xdir["x"], "x")
    spellings = [spelling_of(a), spelling_of(x)]
    text = b"the quick brown fox"
    prompts = [[a.tokenizer.bos_token_id], [x.tokenizer.bos_token_id]]
    both = CrossTokenizerFusion([a, x], spellings, CrossParams.exact(top_k=4))
    joint = score_text(both, prompts, text, [(Single(["a", "x"], expert="a"), [1.0, 1.0]),
                                             (Mixture(["a", "x"]), [1.0, 1.0])])  # consults x too
    alone = CrossTokenizerFusion([a], spellings[:1], CrossParams.exact(top_k=4))
    solo = score_text(alone, prompts[:1], text, [(Single(["a"], expert="a"), [1.0])])
    assert joint.pieces != solo.pieces  # other candidates, other pieces
    assert sum(joint.logprobs[0]) == pytest.approx(sum(solo.logprobs[0]), rel=1e-4)
    ids = a.tokenizer(text.decode(), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = a.model(torch.tensor([prompts[0] + ids])).logits[0, :-1].double()
    token_level = float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).sum())
    assert sum(solo.logprobs[0]) >= token_level
