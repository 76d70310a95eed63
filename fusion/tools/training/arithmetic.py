"""Arithmetic specialist data: chat-formatted questions answered with column-by-column working.

Answer format. A tiny model cannot carry in its head: trained on bare "47 + 38 = 85" answers it
stays near chance, because the first digit it writes depends on the whole sum. So each answer
restates the problem, then works one column at a time from the units up (every step needs only a
few earlier tokens: two digits and a carry), then states the result in ordinary form:

    47 + 38 -> "47+38: 7+8=15, carry 1; 4+3+1=8. So the answer is 85."
    38 - 47 -> "38-47: swap, 47-38; 17-8=9, borrow 1; 4-3-1=0. So the answer is -9."
    47 * 6  -> "47*6: 7*6=42, carry 4; 4*6+4=24+4=28. So the answer is 282."
    7 x 8   -> "7*8: 7*8=56. So the answer is 56."

SmolLM2's tokenizer splits numbers into single digits, so each digit is one token.

Ranges: + and - on 0..99 (negative differences allowed), * with one operand 0..9 and the other
0..99 (covers tables like 7 x 8 and 12 x 9).

Held-out split: each problem (op, a, b) belongs to training or to the held-out set by a hash of
its canonical form. Training never draws a held-out problem and `make_questions` draws only
held-out ones, so evaluation questions are unseen whatever the seeds (phrasings are shared).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import cache

import torch

from fusion.tools.training.loop import Batch
from fusion.text import end_of_turn_id

MAX_OPERAND = 99  # + and -: both operands in 0..MAX_OPERAND
MAX_MULTIPLIER = 9  # *: one operand in 0..MAX_MULTIPLIER, the other in 0..MAX_OPERAND
HELD_OUT_PERCENT = 10

TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "What is {a} + {b}?",
        "What is {a}+{b}?",
        "{a} + {b} = ?",
        "{a} + {b}",
        "Compute {a} + {b}.",
        "Calculate {a} + {b}.",
        "What is {a} plus {b}?",
        "{a} plus {b}?",
        "What is the sum of {a} and {b}?",
        "Add {a} and {b}.",
        "What's {a} + {b}?",
        "How much is {a} plus {b}?",
    ),
    "-": (
        "What is {a} - {b}?",
        "What is {a}-{b}?",
        "{a} - {b} = ?",
        "{a} - {b}",
        "Compute {a} - {b}.",
        "Calculate {a} - {b}.",
        "What is {a} minus {b}?",
        "{a} minus {b}?",
        "Subtract {b} from {a}.",
        "What's {a} - {b}?",
        "How much is {a} minus {b}?",
    ),
    "*": (
        "What is {a} x {b}?",
        "What is {a} * {b}?",
        "What is {a}*{b}?",
        "{a} * {b} = ?",
        "{a} x {b}",
        "Compute {a} * {b}.",
        "Calculate {a} × {b}.",
        "What is {a} times {b}?",
        "{a} times {b}?",
        "What is the product of {a} and {b}?",
        "Multiply {a} by {b}.",
        "What's {a} x {b}?",
        "How much is {a} times {b}?",
    ),
}


@dataclass(frozen=True)
class Problem:
    op: str  # "+", "-" or "*"
    a: int
    b: int

    @property
    def value(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    @property
    def canonical(self) -> str:
        return f"{self.a}{self.op}{self.b}"


def is_held_out(p: Problem) -> bool:
    """The fixed train/held-out split: a hash of the canonical form, independent of any seed."""
    digest = hashlib.sha256(p.canonical.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def _digits(n: int, width: int) -> list[int]:
    """Least significant first, zero-padded to `width`."""
    return [(n // 10**i) % 10 for i in range(width)]


def _add_working(a: int, b: int) -> str:
    width = max(len(str(a)), len(str(b)))
    da, db = _digits(a, width), _digits(b, width)
    steps, carry = [], 0
    for i in range(width):
        total = da[i] + db[i] + carry
        step = f"{da[i]}+{db[i]}" + (f"+{carry}" if i else "")
        if i == width - 1:
            steps.append(f"{step}={total}")
        else:
            carry = total // 10
            steps.append(f"{step}={total}, carry {carry}")
    return "; ".join(steps)


def _sub_working(a: int, b: int) -> str:
    """Column subtraction of a - b with a >= b."""
    width = len(str(a))
    da, db = _digits(a, width), _digits(b, width)
    steps, borrow = [], 0
    for i in range(width):
        out = 1 if da[i] - borrow < db[i] else 0
        top = f"1{da[i]}" if out else f"{da[i]}"
        step = f"{top}-{db[i]}" + (f"-{borrow}" if i else "")
        diff = da[i] + 10 * out - db[i] - borrow
        steps.append(f"{step}={diff}" + ("" if i == width - 1 else f", borrow {out}"))
        borrow = out
    return "; ".join(steps)


def _mul_working(top: int, m: int) -> str:
    """Column multiplication of `top` (any digits) by the single digit `m`."""
    width = len(str(top))
    dt = _digits(top, width)
    steps, carry = [], 0
    for i in range(width):
        product = dt[i] * m
        if i:
            total = product + carry
            step = f"{dt[i]}*{m}+{carry}={product}+{carry}={total}"
        else:
            total = product
            step = f"{dt[i]}*{m}={product}"
        if i < width - 1:
            carry = total // 10
            step += f", carry {carry}"
        steps.append(step)
    return "; ".join(steps)


def answer_text(p: Problem) -> str:
    """The full answer: restatement, column working, then "So the answer is N."."""
    if p.op == "+":
        work = _add_working(p.a, p.b)
    elif p.op == "-":
        work = _sub_working(p.a, p.b) if p.a >= p.b else f"swap, {p.b}-{p.a}; " + _sub_working(p.b, p.a)
    elif p.op == "*":
        top, m = (p.b, p.a) if p.a <= MAX_MULTIPLIER < p.b else (p.a, p.b)
        work = _mul_working(top, m)
    else:
        raise ValueError(f"unknown operator {p.op!r}")
    return f"{p.canonical}: {work}. So the answer is {p.value}."


def question_text(p: Problem, rng: random.Random) -> str:
    return rng.choice(TEMPLATES[p.op]).format(a=p.a, b=p.b)


def _random_operand(rng: random.Random, max_value: int) -> int:
    # One-digit operands are only a tenth of 0..99; draw them more often so short forms are learned.
    return rng.randint(0, 9) if rng.random() < 0.25 else rng.randint(0, max_value)


def random_problem(rng: random.Random) -> Problem:
    """Any problem in range, training or held-out."""
    op = rng.choice("+-*")
    if op == "*":
        big, small = _random_operand(rng, MAX_OPERAND), rng.randint(0, MAX_MULTIPLIER)
        a, b = (big, small) if rng.random() < 0.5 else (small, big)
        return Problem(op, a, b)
    return Problem(op, _random_operand(rng, MAX_OPERAND), _random_operand(rng, MAX_OPERAND))


def training_problem(rng: random.Random) -> Problem:
    while True:
        p = random_problem(rng)
        if not is_held_out(p):
            return p


@cache
def _held_out_pool() -> tuple[Problem, ...]:
    operands, multipliers = range(MAX_OPERAND + 1), range(MAX_MULTIPLIER + 1)
    pool = [Problem(op, a, b) for op in "+-" for a in operands for b in operands]
    pool += [Problem("*", a, m) for a in operands for m in multipliers]
    pool += [Problem("*", m, a) for a in operands if a > MAX_MULTIPLIER for m in multipliers]
    return tuple(p for p in pool if is_held_out(p))


def make_questions(n: int, seed: int) -> list[tuple[str, int]]:
    """`n` distinct held-out (question, answer) pairs; deterministic in `seed`.

    Operators are drawn evenly. Every problem comes from the held-out split, which training never
    draws, so these are disjoint from the training stream for any seed.
    """
    pool = _held_out_pool()
    by_op = {op: [p for p in pool if p.op == op] for op in "+-*"}
    if n < 0 or n > len(pool):
        raise ValueError(f"n={n} must be between 0 and {len(pool)} (held-out problems)")
    rng = random.Random(f"held-out:{seed}")
    order = {op: rng.sample(ps, len(ps)) for op, ps in by_op.items()}
    picked: list[Problem] = []
    while len(picked) < n:
        live = [op for op in "+-*" if order[op]]
        picked.append(order[rng.choice(live)].pop())
    return [(question_text(p, rng), p.value) for p in picked]


_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*", re.IGNORECASE)
# An integer, signed only when the minus is attached and not itself an operator ("47-38").
_INT = re.compile(r"(?<![\w)\]])[-−](?=\d)\d+|\d+")


def extract_answer(text: str) -> int | None:
    """The final number of a generated answer, or None if it has none.

    Rule: if the text says "answer is/:/=", the first integer after the last such phrase;
    otherwise the last integer in the text ("12 + 35 = 47" -> 47). Thousands separators
    ("1,234") are joined; a minus sign counts only when attached to the digits and not preceded
    by a word or digit ("-9" -> -9, "47-38" -> 38).
    """
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    cut = list(_ANSWER_IS.finditer(text))
    if cut:
        found = _INT.search(text, cut[-1].end())
        if found:
            return int(found.group().replace("−", "-"))
    found_all = _INT.findall(text)
    return int(found_all[-1].replace("−", "-")) if found_all else None


def chat_prompt(tokenizer, question: str) -> str:
    """The prompt exactly as the fusion engine formats it (the template's default system prompt)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


class ArithmeticStream:
    """Endless batches of (chat prompt + working answer + <|im_end|>), loss on the answer only.

    The chat template's system prompt is the same for every row, so it travels once as the
    batch's shared prefix instead of being recomputed per row.
    """

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = random.Random(f"train:{seed}")
        self.end_id = end_of_turn_id(tokenizer)
        one = self._encode(chat_prompt(tokenizer, "1 + 1"))
        two = self._encode(chat_prompt(tokenizer, "What is 2 x 3?"))
        n = 0
        while n < min(len(one), len(two)) and one[n] == two[n]:
            n += 1
        self.prefix = one[:n]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def example(self) -> tuple[list[int], list[int]]:
        """(prompt ids after the shared prefix, answer ids ending with the turn terminator)."""
        p = training_problem(self.rng)
        prompt = self._encode(chat_prompt(self.tokenizer, question_text(p, self.rng)))
        if prompt[: len(self.prefix)] != self.prefix:
            raise ValueError(f"chat prompt for {p.canonical!r} does not start with the shared prefix")
        return prompt[len(self.prefix) :], self._encode(answer_text(p)) + [self.end_id]

    def __call__(self, batch_size: int) -> Batch:
        rows = [self.example() for _ in range(batch_size)]
        width = max(len(q) + len(a) for q, a in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_id
        ids = torch.full((batch_size, width), pad, dtype=torch.long)  # [B, S]
        labels = torch.full((batch_size, width), -100, dtype=torch.long)  # [B, S]
        for r, (q, a) in enumerate(rows):
            seq = q + a
            ids[r, : len(seq)] = torch.tensor(seq)
            # Position t predicts token t+1: the last prompt token predicts the first answer token.
            labels[r, len(q) - 1 : len(seq) - 1] = torch.tensor(a)
        return Batch(input_ids=ids, labels=labels, prefix_ids=torch.tensor(self.prefix, dtype=torch.long))
