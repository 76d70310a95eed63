"""The evaluation's measurements against plain references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from fusion.tools import evaluation as ev
from fusion.config import FusionSpec
from fusion.tools.training.arithmetic import make_questions


def test_bits_per_byte_matches_plain_forward(tiny_dir, tiny_service):
    texts = ["the quick brown fox jumps over the lazy dog", "def add ( a , b ) : return a + b"]
    specs = [FusionSpec(rule="single", params={"expert": "a"}), FusionSpec(rule="mixture")]
    got = ev.bits_per_byte(tiny_service, specs, texts)
    tok = tiny_service.tokenizers[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32).eval()
    nats = 0.0
    for text in texts:  # lm-evaluation-harness's rolling convention: [eot] + the text encoded on its own
        ids = [tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        context = 1
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :, : tiny_service.engine.vocab_size], -1)
        nats -= sum(lp[i - 1, ids[i]].item() for i in range(context, len(ids)))
    expected = nats / math.log(2) / sum(len(t.encode()) for t in texts)
    assert got[0] == pytest.approx(expected, rel=1e-4)
    assert got[1] != got[0]


def test_arithmetic_accuracy_runs_batched(tiny_service):
    questions = [("What is 2 + 3?", 5), ("What is 7 x 8?", 56), ("What is 9 - 4?", 5)]
    acc, tps, records = ev.arithmetic_accuracy(tiny_service, FusionSpec(rule="mixture"), questions, batch_size=2,
                                               max_tokens=8)
    assert 0.0 <= acc <= 1.0 and tps > 0
    assert [r["question"] for r in records] == [q for q, _ in questions]
    assert acc == sum(r["got"] == r["answer"] for r in records) / 3


def test_table_and_rows(tiny_service):
    rows = ev.default_rows(tiny_service)
    names = [n for n, _ in rows]
    assert names[:3] == ["a alone", "b alone", "c alone"] and "confidence" in names
    table = ev.format_table([ev.EvalRow("x", {}, 0.5, {"general": 1.234}, 10.0)])
    assert "| x | 50.0% | – | – | 1.234 | 10.0 |" in table


def test_function_tasks_are_correct_and_unseen():
    from fusion.tools.code_tasks import TASKS, run_checks
    from fusion.tools.training.python_code import stdlib_files

    assert len(TASKS) >= 10 and len({t.name for t in TASKS}) == len(TASKS)
    for task in TASKS:
        run_checks(task)
        assert task.prompt.endswith('"""\n') and task.body.startswith("    ")
    # Neither a body nor a task's signature line is in the code specialist's training files.
    pieces = [t.body for t in TASKS] + [t.prompt.splitlines()[0] for t in TASKS]
    for path in stdlib_files(held_out=False):
        text = path.read_text(encoding="utf-8", errors="replace")
        assert not any(p in text for p in pieces), path


def test_evaluate_reports_in_and_out_of_template_side_by_side(tiny_service):
    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"})), ("mixture", FusionSpec(rule="mixture"))]
    results = ev.evaluate(tiny_service, rows=rows, questions=8, text_chunks=1, domains=["functions"])
    for r in results:
        assert None not in (r.arithmetic_accuracy, r.arithmetic_out, r.arithmetic_fresh)
        assert set(r.arithmetic_by_kind) == {"in", "out", "fresh"}
        assert {"+", "-", "*", "**"} == set(r.arithmetic_by_kind["in"]) == set(r.arithmetic_by_kind["out"]) \
            == set(r.arithmetic_by_kind["fresh"])
        assert r.bits_per_byte["functions"] > 0
    table = ev.format_table(results)
    header = table.splitlines()[0]
    assert "arith in-template | arith out-of-template | arith out-of-template 2" in header
    assert "2x2 digits in / out / out 2" in header and "bpb functions" in header
    assert len(table.splitlines()) == 2 + len(rows)
    assert "HumanEval" not in header  # not asked


def test_evaluate_runs_each_rows_humaneval_completions(tiny_service):
    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"})), ("mixture", FusionSpec(rule="mixture"))]
    results = ev.evaluate(tiny_service, rows=rows, questions=0, domains=[], humaneval=3, humaneval_tokens=8,
                          humaneval_prompt="plain")  # the chat form outgrows the tiny models' 512 positions
    for r in results:  # random tiny experts solve nothing: every failure is recorded with its reason
        assert r.humaneval_pass1 == 0.0 and len(r.humaneval_failures) == 3
        assert all(task.startswith("HumanEval/") and reason for task, reason in r.humaneval_failures.items())
    assert "HumanEval pass@1" in ev.format_table(results).splitlines()[0]
    assert all(r.humaneval_records == [] for r in results)  # kept only when asked
    assert all(r.humaneval_passes == [0] * 3 and r.humaneval_samples == 1 for r in results)
    # problem by problem against each expert alone, as the arithmetic sets are: set outcomes to check counts
    results[0].humaneval_passes, results[1].humaneval_passes = [1, 0, 0], [0, 1, 1]
    (pair,) = [c for c in ev.paired_comparisons(results) if c.asked == "HumanEval"]
    assert (pair.fused, pair.member, pair.questions, pair.only_fused, pair.only_member) == ("mixture", "a alone", 3, 2, 1)
    assert "| HumanEval | mixture | a alone | 3 | 2 | 1 | 1.000 |" in ev.format_paired_table(results)
    # with several samples a problem, the row that solves it more often wins it; a tie counts for neither
    results[0].humaneval_passes, results[1].humaneval_passes = [3, 1, 2], [1, 1, 4]
    (pair,) = [c for c in ev.paired_comparisons(results) if c.asked == "HumanEval"]
    assert (pair.only_fused, pair.only_member) == (1, 1)


def test_sampled_humaneval_draws_sample_j_with_seed_j(tiny_service):
    """Several samples a problem: sample j is the request sampled with seed j (the same completions as asked
    directly), the rate is the share of all samples that pass, and each record names its sample."""
    from fusion.tools.executed_code import complete_humaneval, humaneval_problems, pass_at_1

    spec, problems, sampling = FusionSpec(rule="mixture"), humaneval_problems(2), {"temperature": 1.0}
    records: list[dict] = []
    rate, passes, failures = ev.sampled_humaneval(tiny_service, spec, problems, 8, sampling, "plain", 3, records)
    drawn = [complete_humaneval(tiny_service, spec, problems, 8, sampling={**sampling, "seed": j}, style="plain")
             for j in range(3)]
    assert [r["completion"] for r in records] == [c for sample in drawn for c in sample]
    assert [(r["task_id"], r["sample"]) for r in records] == [(p["task_id"], j) for j in range(3) for p in problems]
    assert len({tuple(sample) for sample in drawn}) > 1  # the seeds draw different answers at temperature 1
    expected = [sum(o.passed for o in column) for column in zip(*(pass_at_1(problems, c)[1] for c in drawn))]
    assert passes == expected and rate == sum(expected) / 6
    assert set(failures) == {p["task_id"] for p, n in zip(problems, passes) if n == 0}


def test_humaneval_records_keep_each_completion_token_by_token(tiny_service):
    """With `records`, each completion with every token of it: the text, each expert's weight (the rule's) and
    each expert's own probability of the token; the completions are the ones asked without records."""
    from fusion.tools.executed_code import complete_humaneval, humaneval_problems

    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"})), ("mixture", FusionSpec(rule="mixture"))]
    results = ev.evaluate(tiny_service, rows=rows, questions=0, domains=[], humaneval=2, humaneval_tokens=8,
                          humaneval_prompt="plain", records=True)
    problems = humaneval_problems(2)
    for (name, spec), r in zip(rows, results):
        plain = complete_humaneval(tiny_service, spec, problems, 8, style="plain")
        assert [x["task_id"] for x in r.humaneval_records] == [p["task_id"] for p in problems]
        assert [x["completion"] for x in r.humaneval_records] == plain
        for record in r.humaneval_records:
            assert record["tokens"] and "".join(t["text"] for t in record["tokens"]).startswith(record["completion"])
            for token in record["tokens"]:
                assert set(token["weights"]) == set(token["probs"]) == set(tiny_service.expert_names)
                assert sum(token["weights"].values()) == pytest.approx(1.0, abs=2e-3)
                if name == "a alone":
                    assert token["weights"]["a"] == 1.0
                assert all(p is None or 0.0 <= p <= 1.0 for p in token["probs"].values())


def test_the_reserve_set_is_asked_only_when_wanted(tiny_service):
    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"}))]
    result = ev.evaluate(tiny_service, rows=rows, questions=4, domains=[], reserve=True)[0]
    assert None not in (result.arithmetic_novel, result.arithmetic_spare, result.arithmetic_fifth)
    assert set(result.arithmetic_by_kind) == {"in", "out", "fresh", "novel", "spare", "fifth"}
    header = ev.format_table([result]).splitlines()[0]
    assert "arith out-of-template 3 | arith out-of-template 4" in header and "in / out / out 2 / out 3 / out 4" in header
    assert result.arithmetic_sixth is None  # asked only by name
    unasked = ev.evaluate(tiny_service, rows=rows, questions=4, domains=[])[0]
    assert unasked.arithmetic_novel is None and unasked.arithmetic_spare is None and unasked.arithmetic_fifth is None


def test_sets_name_exactly_the_arithmetic_sets_asked(tiny_service):
    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"}))]
    result = ev.evaluate(tiny_service, rows=rows, questions=4, domains=[], sets=["seventh", "sixth", "in"])[0]
    assert set(result.arithmetic_by_kind) == {"in", "sixth", "seventh"}
    assert result.arithmetic_sixth is not None and result.arithmetic_seventh is not None
    assert result.arithmetic_out is None
    header = ev.format_table([result]).splitlines()[0]
    assert "arith in-template | arith out-of-template 6 | arith out-of-template 7" in header
    assert "2x2 digits in / out 6 / out 7" in header
    with pytest.raises(ValueError, match="eighth"):
        ev.evaluate(tiny_service, rows=rows, questions=4, domains=[], sets=["eighth"])


def test_records_keep_each_question_and_the_weights_at_its_opening(tiny_service):
    rows = [("mixture", FusionSpec(rule="mixture", weights={"a": 0.5, "b": 0.3, "c": 0.2}))]
    plain = ev.evaluate(tiny_service, rows=rows, questions=4, domains=[], sets=["in"])[0]
    assert plain.arithmetic_records == {}
    kept = ev.evaluate(tiny_service, rows=rows, questions=4, domains=[], sets=["in"], records=True)[0]
    asked = kept.arithmetic_records["in"]
    assert [r["question"] for r in asked] == [q for q, _ in make_questions(4, 0, phrasing="train")]
    assert kept.arithmetic_accuracy == sum(r["got"] == r["answer"] for r in asked) / 4
    for record in asked:
        assert 0 < len(record["opening"]) <= ev.OPENING_TOKENS
        assert record["text"].startswith("".join(t["text"] for t in record["opening"]))
        for token in record["opening"]:  # the request's weights, normalised, at every step
            assert token["weights"] == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2}, abs=1e-3)


def test_function_bits_per_byte_is_the_score_convention(tiny_service):
    """The functions column is `FusionService.score` summed over the tasks, per byte it covers."""
    spec = FusionSpec(rule="mixture")
    pairs = ev.function_tasks()[:3]
    got = ev.bits_per_byte(tiny_service, [spec], pairs)[0]
    scored = [tiny_service.score(p, c, spec) for p, c in pairs]
    expected = -sum(r.total_logprob for r in scored) / math.log(2) / sum(len(r.text.encode()) for r in scored)
    assert got == pytest.approx(expected, rel=1e-4)


CODE_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def twice(x):\n    y = x * 2\n    return y\n",
    "for i in range(3):\n    if i:\n        print(i)\n",
] * 6


@pytest.fixture(scope="module")
def code_service(tmp_path_factory):
    """One tiny expert whose BPE merges a newline with the indentation after it ("\n   ")."""
    from fusion.config import parse_config
    from fusion.frontdoor.service import FusionService
    from tests.tiny_models import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("code")
    tok = make_tokenizer(root / "tok", vocab_size=320, corpus=CODE_CORPUS)
    make_model(root / "m", tok, seed=5)
    config = parse_config({"experts": [{"name": "m", "model": str(root / "m"), "dtype": "float32"}]})
    service = FusionService.from_config(config)
    yield root / "m", service
    service.close()


def lm_eval_logprob(model, tok, context: str, continuation: str, vocab: int) -> tuple[list[int], float]:
    """lm-evaluation-harness's loglikelihood, written out plainly: `_encode_pair`, then one forward."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    context_enc = tok(context, add_special_tokens=False)["input_ids"]
    continuation_enc = whole[len(context_enc):]
    ids = context_enc + continuation_enc
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :, :vocab].float(), -1)
    return continuation_enc, sum(lp[i - 1, ids[i]].item() for i in range(len(context_enc), len(ids)))


@pytest.mark.parametrize("prompt, continuation", [
    ("def add(a, b):\n", "    return a + b\n"),  # the boundary BPE merges: "\n" + indentation
    ("def twice(x):\n    y = x * 2", "\n    return y\n"),
    ("for i in range(3):", " print(i)"),
])
def test_score_follows_lm_eval_convention(code_service, prompt, continuation):
    model_dir, service = code_service
    tok = service.tokenizers[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, expected = lm_eval_logprob(model, tok, prompt, continuation, service.engine.vocab_size)
    result = service.score(prompt, continuation, FusionSpec(rule="single", params={"expert": "m"}))
    assert result.token_ids == ids
    assert result.total_logprob == pytest.approx(expected, abs=1e-4)
    moved = prompt[len(prompt.rstrip()):]
    assert result.text == moved + continuation


def test_score_boundary_is_not_two_encodings(code_service):
    """The case the convention exists for: encoded apart, "\n" and "    return" are not the ids the
    tokenizer gives the whole text."""
    _, service = code_service
    tok = service.tokenizers[0]
    prompt, continuation = "def add(a, b):\n", "    return a + b\n"
    apart = tok(prompt)["input_ids"] + tok(continuation, add_special_tokens=False)["input_ids"]
    whole = tok(prompt + continuation)["input_ids"]
    assert apart != whole
    result = service.score(prompt, continuation)
    assert result.prompt_tokens + len(result.token_ids) == len(whole)
    assert tok(prompt.rstrip())["input_ids"] + result.token_ids == whole


def test_score_whitespace_prompt_starts_a_document(code_service):
    _, service = code_service
    tok = service.tokenizers[0]
    result = service.score("\n", "def add(a, b):")
    assert result.text == "\ndef add(a, b):" and result.prompt_tokens == 1
    assert result.token_ids == tok("\ndef add(a, b):", add_special_tokens=False)["input_ids"]


def test_the_length_split_asks_every_kind_at_each_size(tiny_service, monkeypatch):
    """`lengths`: the same number of held-out problems at each operand size, every kind among them, reported
    per size and per kind; the answers' token budget grows with the size."""
    budgets = []
    asked = ev.arithmetic_accuracy

    def recording(service, spec, questions, **options):
        budgets.append(options.get("max_tokens"))
        return asked(service, spec, questions, max_tokens=16)  # random tiny experts: short answers will do

    monkeypatch.setattr(ev, "arithmetic_accuracy", recording)
    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"}))]
    result = ev.evaluate(tiny_service, rows=rows, questions=5, domains=[], lengths=(3, 7),
                         sets=["in"], length_wordings=("in", "out"))[0]
    assert set(result.arithmetic_by_length) == {"3", "3 out", "7", "7 out"}
    assert all(set(kinds) == {"+", "-", "*", "**", "chain"} for kinds in result.arithmetic_by_length_kind.values())
    assert budgets[-4:] == [ev.length_budget(3)] * 2 + [ev.length_budget(7)] * 2
    assert ev.length_budget(7) > ev.length_budget(3)
    table = ev.format_length_table([result])
    assert table.splitlines()[0].startswith("| row | 3 digits | 3 digits out | 7 digits | 7 digits out | "
                                            "+ 3 / 3 out / 7 / 7 out |")
    assert ev.format_length_table([ev.EvalRow("x", {})]) == ""


def test_sign_test_is_the_exact_binomial_tail():
    assert ev.sign_test_p(0, 0) == 1.0
    assert ev.sign_test_p(0, 5) == pytest.approx(2 / 32)  # all five discordant questions one way
    assert ev.sign_test_p(2, 4) == ev.sign_test_p(4, 2) == pytest.approx(2 * (1 + 6 + 15) / 64)
    assert ev.sign_test_p(3, 3) == 1.0  # an even split: the tail holds more than half, capped at 1
    assert ev.sign_test_p(0, 12) < 0.001


def test_fused_rows_compare_with_each_member_question_by_question(tiny_service):
    rows = [("a alone", FusionSpec(rule="single", params={"expert": "a"})),
            ("b alone", FusionSpec(rule="single", params={"expert": "b"})),
            ("mixture", FusionSpec(rule="mixture"))]
    results = ev.evaluate(tiny_service, rows=rows, questions=4, domains=[], sets=["in", "sixth"], records=True)
    for r in results:  # each answer's correctness, in the order asked, as its records have it
        assert r.arithmetic_correct == {s: [x["got"] == x["answer"] for x in r.arithmetic_records[s]]
                                        for s in ("in", "sixth")}
    # the tiny random experts answer nothing right: set the outcomes to check the counts
    results[0].arithmetic_correct["sixth"] = [True, True, False, False]
    results[2].arithmetic_correct["sixth"] = [True, False, True, True]
    pairs = {(c.asked, c.member): c for c in ev.paired_comparisons(results)}
    assert set(pairs) == {(s, m) for s in ("in", "sixth") for m in ("a alone", "b alone")}
    against_a = pairs["sixth", "a alone"]
    assert (against_a.fused, against_a.questions, against_a.only_fused, against_a.only_member) == ("mixture", 4, 2, 1)
    assert against_a.p_value == pytest.approx(ev.sign_test_p(2, 1)) == 1.0
    assert (pairs["sixth", "b alone"].only_fused, pairs["sixth", "b alone"].only_member) == (3, 0)
    table = ev.format_paired_table(results).splitlines()
    assert table[0].startswith("| set | fused row | expert alone |") and len(table) == 2 + 4
    assert "| sixth | mixture | a alone | 4 | 2 | 1 | 1.000 |" in table
    assert ev.format_paired_table(results[:2]) == ""  # no fused row
