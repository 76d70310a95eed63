"""Quality evaluation: does the fused trio beat each of its members?

Rows: every expert alone (`single` rule) and each fusion rule. Columns: exact-match accuracy on
held-out arithmetic problems (problems training never draws) asked twice, in training phrasings
(in-template) and in two sets of phrasings no training has seen (out-of-template: held-out
expressions, frames and instruction styles; the second set has never informed the training lists),
overall and by kind (+, -, * by one digit, two digits by two digits);
bits-per-byte on held-out text of each domain; and tokens/s while answering (batched).

Domains for bits-per-byte, all available offline on any Python install:
  arithmetic  worked answers to held-out questions, each scored after its chat prompt (as generated)
  python      held-out standard-library source files (the code specialist never trained on them)
  functions   unseen function-completion tasks (`fusion.tools.code_tasks`): each reference body
              scored after its signature and docstring (lm-evaluation-harness's convention)
  general     English documentation prose: IDLE's help page and Python's licence history
Plain texts are scored on their own after the BOS (or the eos), as lm-eval's rolling log-likelihood.
Experts' teacher-forced logits are computed once per text chunk and every rule is applied to them.
"""

from __future__ import annotations

import html
import logging
import math
import re
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from fusion.config import FusionSpec, SamplingParams
from fusion.fuse.router import FAIL_SAFE
from fusion.frontdoor.service import FusionRequest, FusionService
from fusion.frontdoor.text import TextSample

logger = logging.getLogger(__name__)

DOMAINS = ("arithmetic", "python", "functions", "general")
KIND_LABELS = {"+": "+", "-": "-", "*": "x 1 digit", "**": "2x2 digits", "chain": "chains"}
LENGTH_KINDS = ("+", "-", "*", "**", "chain")  # the kinds of the length split (long_arithmetic.KINDS)
Sample = TextSample | str | tuple[str, str]  # a chat answer, a plain text, or a plain (prompt, continuation)


@dataclass
class EvalRow:
    name: str
    spec: dict
    arithmetic_accuracy: float | None = None  # in-template
    bits_per_byte: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float | None = None
    arithmetic_out: float | None = None  # out-of-template: the same problems in unseen phrasings
    arithmetic_fresh: float | None = None  # out-of-template, second set (never informed training)
    arithmetic_novel: float | None = None  # out-of-template, the third set (asked with `reserve=True`)
    arithmetic_spare: float | None = None  # out-of-template, the fourth set (asked with `reserve=True`)
    arithmetic_fifth: float | None = None  # out-of-template, the fifth set (asked with `reserve=True`)
    arithmetic_sixth: float | None = None  # out-of-template, the sixth set (asked only when `sets` names it)
    arithmetic_seventh: float | None = None  # out-of-template, the seventh set (asked only when `sets` names it)
    arithmetic_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # {split: {kind: acc}}
    # HumanEval's problems solved, each completion run (executed_code); with several samples a problem, the
    # unbiased pass@1 estimate: the mean over problems of the share of its samples that pass
    humaneval_pass1: float | None = None
    humaneval_samples: int = 1  # completions asked of each problem (1: greedy, as asked by default)
    humaneval_failures: dict[str, str] = field(default_factory=dict)  # task id -> why it failed (never passed)
    humaneval_passes: list[int] = field(default_factory=list)  # each problem's passing samples, in HumanEval's order
    # With `records`: each HumanEval completion, token by token (`executed_code.token_record`)
    humaneval_records: list[dict] = field(default_factory=list)
    # Arithmetic by the size of its longest operand (fusion.tools.training.long_arithmetic): {digits: acc} and
    # {digits: {kind: acc}}, asked in training phrasings
    arithmetic_by_length: dict[str, float] = field(default_factory=dict)
    arithmetic_by_length_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    # With `records`: each two-digit question of each set, {split: [record]} (`arithmetic_accuracy`'s)
    arithmetic_records: dict[str, list[dict]] = field(default_factory=dict)
    # Whether each question was answered right, in the order asked, per set ("in", "out", ...) and per size
    # ("7", "7 out"): rows asked the same questions compare question by question (`paired_comparisons`)
    arithmetic_correct: dict[str, list[bool]] = field(default_factory=dict)


# Each arithmetic set's accuracy field of an `EvalRow` (the held-out phrasing it is asked in: see
# `fusion.tools.training.arithmetic.PHRASINGS`); the reserve sets are asked only with `reserve`.
SPLIT_FIELDS = {"in": "arithmetic_accuracy", "out": "arithmetic_out", "fresh": "arithmetic_fresh",
                "novel": "arithmetic_novel", "spare": "arithmetic_spare", "fifth": "arithmetic_fifth",
                "sixth": "arithmetic_sixth", "seventh": "arithmetic_seventh"}
SPLIT_PHRASINGS = {"in": "train", "out": "held_out", "fresh": "fresh", "novel": "novel", "spare": "spare",
                   "fifth": "fifth", "sixth": "sixth", "seventh": "seventh"}
SPLIT_LABELS = {"in": "in", "out": "out", "fresh": "out 2", "novel": "out 3", "spare": "out 4", "fifth": "out 5",
                "sixth": "out 6", "seventh": "out 7"}
DEFAULT_SPLITS = ("in", "out", "fresh")
RESERVE_SPLITS = ("novel", "spare", "fifth")
# The sixth and seventh sets are asked only by name (`sets`): choices made while comparing runs on the other
# sets never show their figures. The seventh is the one that informed nothing (the sixth's losses, read
# question by question, informed the route rule's confidence scaling, `tau`).


def chosen_splits(reserve: bool = False, sets: Sequence[str] | None = None) -> tuple[str, ...]:
    """The arithmetic sets to ask: `sets` as named (in `SPLIT_FIELDS` order), else the first three and,
    with `reserve`, the reserve sets."""
    if sets is not None:
        unknown = sorted(set(sets) - set(SPLIT_FIELDS))
        if unknown:
            raise ValueError(f"sets: unknown set(s) {unknown}; known: {list(SPLIT_FIELDS)}")
        return tuple(split for split in SPLIT_FIELDS if split in sets)
    return DEFAULT_SPLITS + (RESERVE_SPLITS if reserve else ())


def route_variant(spec: FusionSpec, **params) -> FusionSpec:
    """A `route` spec with some of its router's switches changed."""
    return spec.model_copy(update={"params": {**spec.params, **params}})


TAU_ON = 1.0  # the confidence scaling `default_rows` compares a route config without one against


def pure_routing(spec: FusionSpec) -> FusionSpec:
    """A `route` spec's router without its complementary logit: pure routing."""
    return route_variant(spec, complementary=False)


def default_rows(service: FusionService, extra: Sequence[tuple[str, FusionSpec]] = ()) -> list[tuple[str, FusionSpec]]:
    config = service.config
    weights = {e.name: e.weight for e in config.experts}
    rows = [(f"{name} alone", FusionSpec(rule="single", params={"expert": name})) for name in service.expert_names]
    rows += [
        ("weighted_logits", FusionSpec(rule="weighted_logits", weights=weights)),
        ("mixture", FusionSpec(rule="mixture", weights=weights)),
        ("confidence", FusionSpec(rule="confidence", params={"tau": 0.5}, weights=weights)),
    ]
    configured = config.fusion
    resolved = service.resolve_spec(configured)

    def same(spec: FusionSpec) -> bool:  # the same rule, parameters and effective weights
        rule, weights = service.resolve_spec(spec)
        return (spec.rule, spec.params, weights) == (configured.rule, configured.params, resolved[1])

    if not any(same(spec) for _, spec in rows):
        rows.append((f"{configured.rule} (config)", configured))
    if configured.rule == "route" and service.cross is None:  # each switch flipped on its own
        params = configured.params
        rows.append(("route (config, pure)", pure_routing(configured)))
        hard = bool(params.get("hard", False))
        rows.append((f"route (config, {'soft' if hard else 'hard'})", route_variant(configured, hard=not hard)))
        safe = bool(params.get("fail_safe", FAIL_SAFE))
        rows.append((f"route (config, fail-safe {'off' if safe else 'on'})",
                     route_variant(configured, fail_safe=not safe)))
        if resolved[0].tau is None:  # the config's tau, else the one its router was trained under
            rows.append((f"route (config, tau {TAU_ON:g})", route_variant(configured, tau=TAU_ON)))
        else:
            rows.append(("route (config, tau off)", route_variant(configured, tau=None)))
    rows += list(extra)
    return rows


# -- arithmetic ------------------------------------------------------------------------------
OPENING_TOKENS = 8  # an answer's first tokens whose routing weights a question's record keeps


def arithmetic_accuracy(
    service: FusionService, spec: FusionSpec, questions: list[tuple[str, int]], *, batch_size: int = 16,
    max_tokens: int = 320,  # a worked two-digit long multiplication is up to ~190 SmolLM2 tokens
) -> tuple[float, float, list[dict]]:
    """Greedy exact match on `questions`; returns (accuracy, tokens/s, per-question records: the question, its
    answer, the one extracted, the text, and the answer's first `OPENING_TOKENS` tokens with each expert's
    weight, where a router decides an answer's course)."""
    from fusion.tools.training.arithmetic import extract_answer

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    correct, tokens, records = 0, 0, []
    start = time.perf_counter()
    for offset in range(0, len(questions), batch_size):
        chunk = questions[offset:offset + batch_size]
        # Submitted together, the chunk decodes as one batch in the service's scheduler.
        streams = [service.submit(FusionRequest(q, sampling, spec)) for q, _ in chunk]
        for (question, answer), stream in zip(chunk, streams):
            events = list(stream)
            tokens += len(events)
            text = "".join(e.text for e in events)
            got = extract_answer(text)
            correct += got == answer
            opening = [{"text": e.text, "weights": {a.expert: round(a.weight, 3) for a in e.token.attribution}}
                       for e in events[:OPENING_TOKENS]]
            records.append({"question": question, "answer": answer, "got": got, "text": text, "opening": opening})
    elapsed = time.perf_counter() - start
    return correct / max(1, len(questions)), tokens / elapsed, records


# -- held-out text ----------------------------------------------------------------------------
def _html_text(path: Path) -> str:
    raw = path.read_text(encoding="utf-8", errors="replace")
    raw = re.sub(r"(?is)<(script|style).*?</\1>", " ", raw)
    text = html.unescape(re.sub(r"(?s)<[^>]+>", " ", raw))
    return re.sub(r"[ \t]+", " ", re.sub(r"\n\s*\n+", "\n\n", text)).strip()


def general_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    help_page = stdlib / "idlelib" / "help.html"
    if help_page.exists():
        parts.append(_html_text(help_page))
    licence = stdlib / "LICENSE.txt"
    if licence.exists():
        parts.append(licence.read_text(encoding="utf-8", errors="replace"))
    if not parts:
        raise FileNotFoundError("no general English text found in the standard library (idlelib/help.html)")
    return "\n\n".join(parts)


def python_text() -> str:
    from fusion.tools.training.python_code import stdlib_files

    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(held_out=True)[:40])


def arithmetic_answers(n: int, seed: int) -> list[TextSample]:
    """`n` held-out questions, each with its worked answer (ending the turn) after the chat prompt."""
    import random

    from fusion.tools.training.long_arithmetic import answer_text, held_out_exprs, question_text

    rng = random.Random(f"bpb:{seed}")
    return [TextSample(answer_text(e), prompt=question_text(e, rng, "train"), end_turn=True)
            for e in held_out_exprs(n, seed)]


def chunks(text: str, tokenizer, *, count: int, tokens: int) -> list[str]:
    """`count` evenly spaced windows of about `tokens` tokens, cut at line starts."""
    lines = text.splitlines(keepends=True)
    ids_per_line = [len(tokenizer(line, add_special_tokens=False)["input_ids"]) for line in lines]
    windows, current, size = [], [], 0
    for line, n in zip(lines, ids_per_line):
        current.append(line)
        size += n
        if size >= tokens:
            windows.append("".join(current))
            current, size = [], 0
    if not windows and current:
        windows.append("".join(current))
    step = max(1, len(windows) // count)
    return windows[::step][:count]


def function_tasks() -> list[tuple[str, str]]:
    """(signature and docstring, reference body) of every unseen function-completion task."""
    from fusion.tools.code_tasks import TASKS

    return [(task.prompt, task.body) for task in TASKS]


def held_out_samples(domain: str, tokenizer, *, seed: int = 0, text_chunks: int = 8, chunk_tokens: int = 192
                     ) -> list[Sample]:
    """The held-out texts of one bits-per-byte domain (module docstring)."""
    if domain == "arithmetic":
        return arithmetic_answers(8 * text_chunks, seed)
    if domain == "functions":
        return function_tasks()
    text = {"python": python_text, "general": general_text}[domain]()
    return chunks(text, tokenizer, count=text_chunks, tokens=chunk_tokens)


def bits_per_byte(service: FusionService, specs: list[FusionSpec], samples: Sequence[Sample]) -> list[float]:
    """Bits per UTF-8 byte of the samples' text (an end-of-turn token is scored but adds no bytes) under
    each spec. A (prompt, continuation) pair is scored as `FusionService.score` does (lm-evaluation-
    harness's convention), over the bytes its log-probabilities cover. Each expert runs once per
    sample; every rule is applied to the same teacher-forced logits. Experts of different tokenizers
    are scored over text (`FusionService.score_texts`): the same bytes for every row."""
    if service.cross is not None:
        totals, _, num_bytes = service.score_texts(list(samples), specs)
        return [-t / math.log(2) / max(num_bytes, 1) for t in totals]
    nats = [0.0] * len(specs)
    total_bytes = 0
    resolved = [service.resolve_spec(s) for s in specs]
    for sample in samples:
        prompt_ids, ids, text = scored_ids(service, sample)
        logits = service.engine.continuation_logits(prompt_ids, ids)  # (E, n, V)
        nats = [a + b for a, b in zip(nats, fused_nats(service, logits, ids, resolved, prompt_ids[0]))]
        total_bytes += len(text.encode("utf-8"))
    return [n / math.log(2) / total_bytes for n in nats]


def scored_ids(service: FusionService, sample: Sample) -> tuple[list[list[int]], list[int], str]:
    """(one prompt per expert, the ids scored, the text they cover) of a sample."""
    if isinstance(sample, tuple):
        return service.pair_ids(*sample)
    prompt_ids, ids = service.sample_ids(sample)
    return prompt_ids, ids, sample.text if isinstance(sample, TextSample) else sample


def fused_nats(service: FusionService, logits, ids: list[int], resolved, prefix_ids) -> list[float]:
    """Negative log-likelihood of `ids` under each resolved (rule, weights), from the experts' logits
    (E, n, V)."""
    return [-sum(service.engine.fused_logprobs(logits, ids, rule, weights, prefix_ids)) for rule, weights in resolved]


def evaluate(
    service: FusionService,
    *,
    rows: list[tuple[str, FusionSpec]] | None = None,
    questions: int = 100,
    seed: int = 0,
    text_chunks: int = 8,
    chunk_tokens: int = 192,
    domains: Sequence[str] = DOMAINS,
    reserve: bool = False,
    sets: Sequence[str] | None = None,
    humaneval: int = 0,
    humaneval_tokens: int = 384,
    humaneval_prompt: str = "chat",
    humaneval_sampling: dict | None = None,
    humaneval_samples: int = 1,
    lengths: Sequence[int] = (),
    length_wordings: Sequence[str] = ("in",),
    records: bool = False,
) -> list[EvalRow]:
    """Every row on the held-out arithmetic sets (in-template and the two out-of-template sets; with
    `reserve`, the third, fourth and fifth sets too, kept for checking figures once the first ones have
    informed choices; `sets` names the sets instead), bits per byte on the held-out texts of `domains`,
    and pass@1 on the first `humaneval` of HumanEval's problems, every completion run in a sandbox
    (`humaneval_samples` completions of each, see `sampled_humaneval`); with
    `lengths`, `questions` problems of each of those operand sizes (every kind: + - * ** chain), asked in the
    wordings of `length_wordings` ("in": training's; "out": the first held-out set's). With `records`, each row
    keeps every two-digit question's record (`arithmetic_records`) and every HumanEval completion's, token by
    token (`humaneval_records`)."""
    from fusion.tools.training.arithmetic import held_out_problems, make_questions

    rows = rows or default_rows(service)
    results = [EvalRow(name, spec.model_dump()) for name, spec in rows]
    if service.uses_auto_router:  # a router trained here shadows the shipped one: the figures say whose they are
        logger.info("router: auto reads %s", service.auto_router_checkpoint())
    if questions > 0:
        kinds = [p.kind for p in held_out_problems(questions, seed)]  # the problems of both phrasings
        asked = {split: make_questions(questions, seed, phrasing=SPLIT_PHRASINGS[split])
                 for split in chosen_splits(reserve, sets)}
        for result, (name, spec) in zip(results, rows):
            for split, qs in asked.items():
                logger.info("arithmetic %s-template: %s (%d questions)", split, name, len(qs))
                acc, tps, asked_records = arithmetic_accuracy(service, spec, qs)
                result.arithmetic_correct[split] = [r["got"] == r["answer"] for r in asked_records]
                result.arithmetic_by_kind[split] = by_kind(result.arithmetic_correct[split], kinds)
                if records:
                    result.arithmetic_records[split] = asked_records
                setattr(result, SPLIT_FIELDS[split], acc)
                if split == "in":
                    result.tokens_per_s = tps
                logger.info("arithmetic %s-template: %s: %.1f%% exact, %.1f tokens/s", split, name, 100 * acc, tps)
    for digits in lengths:
        from fusion.tools.training import long_arithmetic

        exprs = long_arithmetic.held_out_exprs(questions, seed, digits)
        budget = length_budget(digits)
        for wording in length_wordings:
            key = str(digits) if wording == "in" else f"{digits} {wording}"
            qs = long_arithmetic.make_questions(questions, seed, SPLIT_PHRASINGS[wording], digits)
            for result, (name, spec) in zip(results, rows):
                logger.info("arithmetic, %s digits: %s (%d questions, %d tokens each at most)", key, name, len(qs),
                            budget)
                acc, _, length_records = arithmetic_accuracy(service, spec, qs, max_tokens=budget)
                result.arithmetic_by_length[key] = acc
                correct = result.arithmetic_correct[key] = [r["got"] == r["answer"] for r in length_records]
                result.arithmetic_by_length_kind[key] = by_kind(correct, [e.kind for e in exprs])
                logger.info("arithmetic, %s digits: %s: %.1f%% exact", key, name, 100 * acc)
    if humaneval > 0:
        from fusion.tools.executed_code import humaneval_problems

        problems = humaneval_problems(humaneval)
        for result, (name, spec) in zip(results, rows):
            logger.info("humaneval: %s (%d problems, %d completions each)", name, len(problems), humaneval_samples)
            kept = result.humaneval_records if records else None
            rate, passes, failures = sampled_humaneval(service, spec, problems, humaneval_tokens, humaneval_sampling,
                                                       humaneval_prompt, humaneval_samples, kept)
            result.humaneval_pass1, result.humaneval_passes, result.humaneval_failures = rate, passes, failures
            result.humaneval_samples = humaneval_samples
            logger.info("humaneval: %s: pass@1 %.1f%%", name, 100 * rate)
    for domain in domains:
        texts = held_out_samples(domain, service.tokenizers[0], seed=seed, text_chunks=text_chunks,
                                 chunk_tokens=chunk_tokens)
        logger.info("bits-per-byte: %s (%d samples)", domain, len(texts))
        for result, bpb in zip(results, bits_per_byte(service, [spec for _, spec in rows], texts)):
            result.bits_per_byte[domain] = bpb
    return results


def length_budget(digits: int) -> int:
    """Tokens a worked answer with operands of `digits` digits may take: long multiplication by three digits
    grows by about 150 SmolLM2 tokens a digit."""
    return 320 + 160 * digits


def by_kind(correct: list[bool], kinds: Sequence[str]) -> dict[str, float]:
    """Exact-match accuracy per problem kind: `correct` and `kinds` per question, in the order asked."""
    hits: dict[str, list[bool]] = {}
    for right, kind in zip(correct, kinds):
        hits.setdefault(kind, []).append(right)
    return {kind: sum(v) / len(v) for kind, v in sorted(hits.items(), key=lambda kv: list(KIND_LABELS).index(kv[0]))}


def _pct(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "–"


def format_table(results: list[EvalRow]) -> str:
    """Markdown: in- and out-of-template accuracy (every set asked) side by side, then per kind
    "in / out / out 2 / ...", then bits per byte per domain and tokens/s."""
    domains = [d for d in DOMAINS if any(d in r.bits_per_byte for r in results)]
    kinds = [k for k in KIND_LABELS if any(k in r.arithmetic_by_kind.get("in", {}) for r in results)]
    # the sets any row was asked (`evaluate` records each by kind); rows made by hand show the default three
    splits = [split for split in SPLIT_FIELDS if any(split in r.arithmetic_by_kind for r in results)] or list(DEFAULT_SPLITS)
    header = ["row"] + [{"in": "arith in-template"}.get(s, "arith " + SPLIT_LABELS[s].replace("out", "out-of-template"))
                        for s in splits]
    header += [f"{KIND_LABELS[k]} " + " / ".join(SPLIT_LABELS[s] for s in splits) for k in kinds]
    humaneval = any(r.humaneval_pass1 is not None for r in results)
    samples = max((r.humaneval_samples for r in results if r.humaneval_pass1 is not None), default=1)
    pass1 = "HumanEval pass@1" + (f" ({samples} samples)" if samples > 1 else "")
    header += [f"bpb {d}" for d in domains] + ([pass1] if humaneval else []) + ["tokens/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        split = r.arithmetic_by_kind
        per_kind = [" / ".join(_pct(split.get(s, {}).get(k)) for s in splits) for k in kinds]
        bpbs = [f"{r.bits_per_byte[d]:.3f}" if d in r.bits_per_byte else "–" for d in domains]
        tps = f"{r.tokens_per_s:.1f}" if r.tokens_per_s is not None else "–"
        accuracies = [getattr(r, SPLIT_FIELDS[split]) for split in splits]
        passed = [_pct(r.humaneval_pass1)] if humaneval else []
        lines.append("| " + " | ".join([r.name, *map(_pct, accuracies), *per_kind, *bpbs, *passed, tps]) + " |")
    return "\n".join(lines)


# -- paired comparison ------------------------------------------------------------------------
@dataclass(frozen=True)
class PairedComparison:
    """A fused row against one expert alone on the same questions of one set: the questions only one of them
    answers right decide which is better, and how surely."""

    asked: str  # the set ("sixth") or size ("7 out")
    fused: str
    member: str
    questions: int
    only_fused: int  # questions the fused row answers right and the member alone does not (or solves more often)
    only_member: int
    p_value: float  # `sign_test_p(only_fused, only_member)`


def sampled_humaneval(service: FusionService, spec: FusionSpec, problems: Sequence[dict], max_tokens: int,
                      sampling: dict | None, style: str, samples: int,
                      records: list[dict] | None = None) -> tuple[float, list[int], dict[str, str]]:
    """Pass@1 on `problems`, each completion run in a sandbox: (the rate, each problem's passing samples, and why
    each problem no sample solved failed, its first sample's reason).

    One sample is the request as `sampling` asks it (greedy by default). With `samples` > 1, sample j of every
    problem is drawn with seed j, so that every row is asked the same seeded draws, and the rate is the
    unbiased pass@1 estimate (Chen et al. 2021): the mean over problems of the share of samples that
    pass. Greedy pass@1 moves by whole problems where a fork is a near tie; the mean over samples does not, so
    two rows' per-problem counts tell them apart on fewer problems. Each record gains its sample's index."""
    from fusion.tools.executed_code import complete_humaneval, pass_at_1

    passes, reasons = [0] * len(problems), {}
    for sample in range(samples):
        asked = {**(sampling or {}), "seed": sample} if samples > 1 else sampling
        kept = [] if records is not None else None
        _, outcomes = pass_at_1(problems, complete_humaneval(service, spec, problems, max_tokens, sampling=asked,
                                                             style=style, records=kept))
        for i, (problem, outcome) in enumerate(zip(problems, outcomes)):
            passes[i] += outcome.passed
            if not outcome.passed:
                reasons.setdefault(problem["task_id"], outcome.reason)
        if records is not None:
            records.extend({**record, "sample": sample} if samples > 1 else record for record in kept)
        if samples > 1:
            logger.info("humaneval: sample %d of %d: %d problems solved", sample + 1, samples,
                        sum(o.passed for o in outcomes))
    failures = {p["task_id"]: reasons[p["task_id"]] for p, passed in zip(problems, passes) if not passed}
    return sum(passes) / (samples * max(len(problems), 1)), passes, failures


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test on the discordant questions (McNemar's exact test): the chance of a split at
    least this uneven if either row were as likely as the other to be the one right."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparisons(results: list[EvalRow]) -> list[PairedComparison]:
    """Every fused row against every single-expert row, on each set both were asked (HumanEval's problems
    too: solved or not, or with several samples a problem, solved by more of its samples)."""
    members = [r for r in results if r.spec.get("rule") == "single"]
    fused = [r for r in results if r.spec.get("rule") != "single"]

    def outcomes(row: EvalRow) -> dict[str, list[int]]:  # right or not per question (bools), passes per problem
        return {**row.arithmetic_correct, **({"HumanEval": row.humaneval_passes} if row.humaneval_passes else {})}

    comparisons = []
    for f in fused:
        for m in members:
            theirs = outcomes(m)
            for asked, right in outcomes(f).items():
                other = theirs.get(asked)
                if other is None or len(other) != len(right):
                    continue
                # right or not (bools), or a HumanEval problem's passing samples (ints): who did better on it
                wins = sum(a > b for a, b in zip(right, other))
                losses = sum(b > a for a, b in zip(right, other))
                comparisons.append(PairedComparison(asked, f.name, m.name, len(right), wins, losses,
                                                    sign_test_p(wins, losses)))
    return comparisons


def format_paired_table(results: list[EvalRow]) -> str:
    """Markdown: each fused row against each expert alone, question by question; "" without such pairs."""
    comparisons = paired_comparisons(results)
    if not comparisons:
        return ""
    lines = ["| set | fused row | expert alone | questions | only the fused row right | only the expert right | p |",
             "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.asked} | {c.fused} | {c.member} | {c.questions} | {c.only_fused} | {c.only_member} | "
                     f"{c.p_value:.3f} |")
    return "\n".join(lines)


def to_json(results: list[EvalRow]) -> list[dict]:
    return [asdict(r) for r in results]


def plot(results: list[EvalRow], path: Path) -> None:
    """A bar chart: arithmetic accuracy and bits-per-byte per domain, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = [d for d in DOMAINS if any(d in r.bits_per_byte for r in results)]
    panels = (["arithmetic exact match"] if any(r.arithmetic_accuracy is not None for r in results) else [])
    panels += (["arithmetic out-of-template"] if any(r.arithmetic_out is not None for r in results) else [])
    panels += (["arithmetic out-of-template 2"] if any(r.arithmetic_fresh is not None for r in results) else [])
    panels += [f"bits/byte: {d}" for d in domains]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    names = [r.name for r in results]
    for ax, panel in zip(axes[0], panels):
        if panel.startswith("arithmetic out-of-template"):
            values = [100 * ((r.arithmetic_fresh if panel.endswith("2") else r.arithmetic_out) or 0) for r in results]
            ax.set_ylabel("% exact (higher is better)")
        elif panel.startswith("arithmetic"):
            values = [100 * (r.arithmetic_accuracy or 0) for r in results]
            ax.set_ylabel("% exact (higher is better)")
        else:
            domain = panel.split(": ")[1]
            values = [r.bits_per_byte.get(domain, float("nan")) for r in results]
            ax.set_ylabel("bits per byte (lower is better)")
        ax.bar(range(len(values)), values, color=["#8da0cb" if "alone" in n else "#fc8d62" for n in names])
        ax.set_xticks(range(len(values)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(panel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- weights formats --------------------------------------------------------------------------
@dataclass
class WeightsRow:
    """One weights format (fusion.forward.quantized) of every expert: bits per byte of each expert alone and of
    the config's fusion per domain, and each expert's KL(dense ‖ this format) per token."""
    weights: str
    bits_per_byte: dict[str, dict[str, float]] = field(default_factory=dict)  # {row: {domain: bpb}}
    kl_per_token: dict[str, dict[str, float]] = field(default_factory=dict)  # {expert: {domain: nats}}


def with_weights(config, weights: str):
    """`config` with every in-process expert's weights set to `weights`."""
    experts = [e if e.addresses else e.model_copy(update={"weights": weights}) for e in config.experts]
    return config.model_copy(update={"experts": experts})


def compare_weights(config, load, formats: Sequence[str], domains: Sequence[str] = ("python", "functions", "general"),
                    *, seed: int = 0, text_chunks: int = 8, chunk_tokens: int = 192) -> list[WeightsRow]:
    """Teacher-forced quality of the experts at each weights format against dense weights, on the same
    held-out texts: bits per byte of each expert alone and of the config's fusion, and per expert the KL
    divergence of its next-token distribution from the dense one's, per token; every product from the
    codes, as in a decode step (long texts would otherwise take the dense weight). `load(config)` builds a
    service (the dense one stays loaded while each other format is scored beside it)."""
    import torch

    from fusion.forward.quantized import codes_only

    reference = load(with_weights(config, "dense"))
    rows: list[WeightsRow] = []
    try:
        names = reference.expert_names
        specs = [(f"{n} alone", FusionSpec(rule="single", params={"expert": n})) for n in names]
        specs.append((f"{config.fusion.rule} (config)", config.fusion))
        texts = {d: held_out_samples(d, reference.tokenizers[0], seed=seed, text_chunks=text_chunks,
                                     chunk_tokens=chunk_tokens) for d in domains}
        for weights in formats:
            service = reference if weights == "dense" else load(with_weights(config, weights))
            try:
                row = WeightsRow(weights)
                resolved = [service.resolve_spec(spec) for _, spec in specs]
                for domain, samples in texts.items():
                    logger.info("weights %s: %s (%d samples)", weights, domain, len(samples))
                    nats, kl, tokens, total_bytes = [0.0] * len(specs), [0.0] * len(names), 0, 0
                    for sample in samples:
                        prompt_ids, ids, text = scored_ids(service, sample)
                        with codes_only():  # the codes' quality, as decode steps see it
                            logits = service.engine.continuation_logits(prompt_ids, ids)  # (E, n, V)
                        nats = [a + b for a, b in zip(nats, fused_nats(service, logits, ids, resolved, prompt_ids[0]))]
                        dense = logits if service is reference else reference.engine.continuation_logits(prompt_ids, ids)
                        p_log = torch.log_softmax(dense.float(), -1)  # (E, n, V)
                        q_log = torch.log_softmax(logits.float(), -1)
                        per_expert = (p_log.exp() * (p_log - q_log)).sum(-1).sum(-1)  # (E,)
                        kl = [a + float(b) for a, b in zip(kl, per_expert)]
                        tokens += len(ids)
                        total_bytes += len(text.encode("utf-8"))
                    for (name, _), n in zip(specs, nats):
                        row.bits_per_byte.setdefault(name, {})[domain] = n / math.log(2) / total_bytes
                    for name, k in zip(names, kl):
                        row.kl_per_token.setdefault(name, {})[domain] = k / tokens
                rows.append(row)
            finally:
                if service is not reference:
                    service.close()
    finally:
        reference.close()
    return rows


def format_weights_table(rows: list[WeightsRow]) -> str:
    """Markdown: one line per (row, weights format): bits per byte per domain, then the KL per token of
    an expert's own row, with the change in bits per byte against dense."""
    domains = list(next(iter(rows[0].bits_per_byte.values())))
    dense = next((r for r in rows if r.weights == "dense"), None)
    header = ["row", "weights"] + [f"bpb {d}" for d in domains] + [f"KL/token {d}" for d in domains]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in rows[0].bits_per_byte:
        for row in rows:
            cells = []
            for d in domains:
                value = row.bits_per_byte[name][d]
                change = "" if dense is None or row is dense else \
                    f" ({100 * (value / dense.bits_per_byte[name][d] - 1):+.1f}%)"
                cells.append(f"{value:.3f}{change}")
            expert = name.removesuffix(" alone")
            kls = [f"{row.kl_per_token[expert][d]:.4f}" if expert in row.kl_per_token else "–" for d in domains]
            lines.append("| " + " | ".join([name, row.weights, *cells, *kls]) + " |")
    return "\n".join(lines)


def format_length_table(results: list[EvalRow]) -> str:
    """Markdown: exact match by operand size, then by kind at each size ("" where no row was asked any)."""
    sizes = sorted({d for r in results for d in r.arithmetic_by_length},
                   key=lambda d: (int(d.split()[0]), d))  # "7" before "7 out"
    if not sizes:
        return ""
    kinds = [k for k in LENGTH_KINDS if any(k in r.arithmetic_by_length_kind.get(d, {}) for r in results for d in sizes)]
    header = ["row"] + [f"{d.split()[0]} digits{d[len(d.split()[0]):]}" for d in sizes]
    header += [f"{k} " + " / ".join(sizes) for k in kinds]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        per_kind = [" / ".join(_pct(r.arithmetic_by_length_kind.get(d, {}).get(k)) for d in sizes) for k in kinds]
        lines.append("| " + " | ".join([r.name, *(_pct(r.arithmetic_by_length.get(d)) for d in sizes), *per_kind]) + " |")
    return "\n".join(lines)
