"""Arithmetic at any length: numbers of 1 to 6 digits, either order, negative results, multiplication by
numbers of several digits, chains of two or three operations and two-step word problems, each answered
with one worked procedure that is the same at every length.

The working. Every step reads only what the step before wrote: the last digit of each number still to
work on (written out after "left"), and the carry or borrow of the step before. The digits of the result
gather in front of the ones so far, so the answer is copied, not assembled:

    4821+375   -> "4821+375: 1+5+0=6, so 6, left 482+37; 2+7+0=9, so 96, left 48+3; 8+3+0=11, so 196,
                   left 4+0; 4+0+1=5, so 5196. So the answer is 5196."
    52-37      -> "52-37: 2-7-0 is below 0, 12-7-0=5, so 5, left 5-3; 5-3-1=1, so 15. So the answer is 15."
    37-52      -> "37-52: swap, 52-37, negative; ... so 15. So the answer is -15."
    4821*7     -> "4821*7: 1*7+0=7, so 7, left 482; 2*7+0=14, so 47, left 48; 8*7+1=57, so 747, left 4;
                   4*7+5=33, so 3747; 3 in front, so 33747. So the answer is 33747."
    48*37      -> "48*37: 48*7: ..., so 336; left 3; 48*3: ..., so 144, shifted 1440; 336+1440: ..., so 1776.
                   So the answer is 1776."
    12+345-67  -> "12+345-67: 12+345: ..., so 357; 357-67: ..., so 290. So the answer is 290."
    3+4*5      -> "3+4*5: 4*5 first: ..., so 20; 3+20: ..., so 23. So the answer is 23."

Splits. A problem belongs to training or to the held-out set by a hash of its canonical form (`is_held_out`;
the two-digit evaluation sets of fusion.tools.training.arithmetic, whose phrasing splits this module reuses,
keep only problems this split holds out too); and by size: no stage draws an operand of more than
`TRAIN_DIGITS` digits, so that `make_questions(..., digits=N)` past that asks lengths no training saw.
Training runs in stages (`Sizes`): the first draws +, - and one-digit * up to `TRAIN_DIGITS` digits, long
multiplication and chains up to 3; the second, from the first one's adapter, grows long multiplication and
chains to `TRAIN_DIGITS`. Within a stage the stream raises the longest operand it draws (a curriculum).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fusion.tools.training import arithmetic as phrasing
from fusion.tools.training.loop import PromptAnswerStream, chat_prompt

TRAIN_DIGITS = 6  # +, - and * by one digit: operands of 1..6 digits in training
LONG_TRAIN_DIGITS = 3  # long multiplication: both operands of 2..3 digits in the first stage
CHAIN_DIGITS = 3  # chains: operands of 1..3 digits, two or three operations, in the first stage
MULTIPLIER_DIGITS = 3  # long multiplication's shorter operand, at every stage
KINDS = ("+", "-", "*", "**", "chain")
PRECEDENCE = {"+": 0, "-": 0, "*": 1}


@dataclass(frozen=True)
class Sizes:
    """What a training stage draws: the longest operand by examples drawn so far (`curriculum`: pairs of
    (examples, digits), then the last), each kind's share, and the caps on long multiplication's longer
    operand and on chains' operands (never above the curriculum's)."""

    curriculum: tuple[tuple[int, int], ...]
    shares: tuple[tuple[str, float], ...]
    long_digits: int
    chain_digits: int
    name: str = ""  # a later stage's own draw of problems

    def max_digits_after(self, examples: int) -> int:
        return max(d for start, d in self.curriculum if examples >= start)


# The first stage: every kind from two digits up, sums, differences and products by one digit to 6 digits,
# long multiplication and chains to 3.
FIRST_STAGE = Sizes(curriculum=((0, 2), (1200, 3), (2400, 4), (3600, 5), (4800, 6)),
                    shares=(("+", 0.22), ("-", 0.24), ("*", 0.16), ("**", 0.2), ("chain", 0.18)),
                    long_digits=LONG_TRAIN_DIGITS, chain_digits=CHAIN_DIGITS)
# The second stage, from the first one's adapter: long multiplication (a longer operand of up to 6 digits by
# 2 or 3) and chains (operands of up to 6 digits) past the first stage's 3, with the other kinds kept in the
# mix so that what the first stage learned is still asked. It begins at 5 digits: the first stage's adapter
# already works 4 (its loss there starts near 0.0005).
LONGER_STAGE = Sizes(curriculum=((0, 5), (480, 6)),
                     shares=(("+", 0.12), ("-", 0.12), ("*", 0.1), ("**", 0.36), ("chain", 0.3)),
                     long_digits=TRAIN_DIGITS, chain_digits=TRAIN_DIGITS, name="longer")


@dataclass(frozen=True)
class Expr:
    """Numbers joined by operators, evaluated with * first, then left to right."""

    terms: tuple[int, ...]
    ops: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.terms) != len(self.ops) + 1 or not self.ops or any(op not in PRECEDENCE for op in self.ops):
            raise ValueError(f"an expression needs operators in + - * between its terms: {self}")
        if any(t < 0 for t in self.terms):
            raise ValueError(f"terms are natural numbers: {self.terms}")

    @property
    def canonical(self) -> str:
        return "".join(f"{t}{op}" for t, op in zip(self.terms, self.ops)) + str(self.terms[-1])

    @property
    def value(self) -> int:
        return evaluate(list(self.terms), list(self.ops))

    @property
    def kind(self) -> str:
        if len(self.ops) > 1:
            return "chain"
        if self.ops[0] == "*" and min(self.terms) >= 10:
            return "**"
        return self.ops[0]

    @property
    def digits(self) -> int:
        """The longest operand's digits: the size splits count this."""
        return max(len(str(t)) for t in self.terms)


def evaluate(terms: list[int], ops: list[str]) -> int:
    terms, ops = list(terms), list(ops)
    while "*" in ops:
        i = ops.index("*")
        terms[i : i + 2] = [terms[i] * terms[i + 1]]
        del ops[i]
    value = terms[0]
    for op, term in zip(ops, terms[1:]):
        value = value + term if op == "+" else value - term
    return value


def is_held_out(expr: Expr) -> bool:
    return phrasing.any_size_held_out(expr.canonical)


# -- the working -----------------------------------------------------------------------------------

def _finished(steps: list[str], so_far: str, carry: int = 0) -> tuple[str, int]:
    """A column working's steps joined and its value: a last carry goes in front of the digits so far."""
    if carry:
        so_far = f"{carry}{so_far}"
        steps.append(f"{carry} in front, so {so_far}")
    return "; ".join(steps), int(so_far)


def _add(a: int, b: int) -> tuple[str, int]:
    left_a, left_b, carry, so_far, steps = str(a), str(b), 0, "", []
    while left_a or left_b:
        da, db = int(left_a[-1]) if left_a else 0, int(left_b[-1]) if left_b else 0
        left_a, left_b = left_a[:-1], left_b[:-1]
        total = da + db + carry
        carry, so_far = total // 10, str(total % 10) + so_far
        step = f"{da}+{db}+{total - da - db}={total}, so {so_far}"
        if left_a or left_b:
            step += f", left {left_a or 0}+{left_b or 0}"
        steps.append(step)
    return _finished(steps, so_far, carry)


def _subtract(a: int, b: int) -> tuple[str, int]:
    """a - b for a >= b."""
    left_a, left_b, borrow, so_far, steps = str(a), str(b), 0, "", []
    while left_a:
        da, db = int(left_a[-1]), int(left_b[-1]) if left_b else 0
        left_a, left_b = left_a[:-1], left_b[:-1]
        if da - db - borrow < 0:
            digit = 10 + da - db - borrow
            step = f"{da}-{db}-{borrow} is below 0, 1{da}-{db}-{borrow}={digit}"
            borrow = 1
        else:
            digit = da - db - borrow
            step = f"{da}-{db}-{borrow}={digit}"
            borrow = 0
        so_far = str(digit) + so_far
        step += f", so {so_far}"
        if left_a:
            step += f", left {left_a}-{left_b or 0}"
        steps.append(step)
    return _finished(steps, so_far)


def _times_digit(a: int, m: int) -> tuple[str, int]:
    left, carry, so_far, steps = str(a), 0, "", []
    while left:
        d = int(left[-1])
        left = left[:-1]
        total = d * m + carry
        step = f"{d}*{m}+{carry}={total}"
        carry, so_far = total // 10, str(total % 10) + so_far
        step += f", so {so_far}" + (f", left {left}" if left else "")
        steps.append(step)
    return _finished(steps, so_far, carry)


def _multiply(a: int, b: int) -> tuple[str, int]:
    """a * b: by one digit, or long multiplication by each digit of b from the units, each partial product
    shifted and added to the sum so far."""
    if b < 10:
        return _times_digit(a, b)
    if a < 10:  # the one-digit operand second
        work, value = _times_digit(b, a)
        return f"swap, {b}*{a}; {work}", value
    parts, total, left = [], None, str(b)
    for shift in range(len(str(b))):
        m, left = int(left[-1]), left[:-1]
        work, partial = _times_digit(a, m)
        part = f"{a}*{m}: {work}"
        if shift:
            partial *= 10**shift
            part += f", shifted {partial}"
        parts.append(part)
        if total is None:
            total = partial
        else:
            added, new_total = _add(total, partial)
            parts.append(f"{total}+{partial}: {_stated(added, new_total)}")
            total = new_total
        if left:
            parts.append(f"left {left}")
    return "; ".join(parts), total


def _binary(a: int, op: str, b: int) -> tuple[str, int]:
    if op == "+":
        return _add(a, b)
    if op == "*":
        return _multiply(a, b)
    if a >= b:
        return _subtract(a, b)
    work, value = _subtract(b, a)
    return f"swap, {b}-{a}, negative; {work}", -value


def _stated(work: str, value: int) -> str:
    """A working that ends "so DIGITS", followed by its value where that reads otherwise (a sign, leading zeros)."""
    return work if work.endswith(f"so {value}") else f"{work}, so {value}"


def _number(n: int) -> str:
    return str(n) if n >= 0 else f"({n})"


def answer_text(expr: Expr) -> str:
    """The whole worked answer, ending "So the answer is N."."""
    if len(expr.ops) == 1:
        work, value = _binary(expr.terms[0], expr.ops[0], expr.terms[1])
        return f"{expr.canonical}: {work}. So the answer is {value}."
    terms, ops, parts = list(expr.terms), list(expr.ops), []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, op, b = terms[i], ops[i], terms[i + 1]
        first = " first" if i > 0 else ""
        if a < 0:  # a negative sum so far: a - b = -(|a| + b), a + b = b - |a|
            work, value = (_binary(-a, "+", b) if op == "-" else _binary(b, "-", -a))
            value = -value if op == "-" else value
            parts.append(f"{_number(a)}{op}{b}{first}: {_stated(work, value)}")
        else:
            work, value = _binary(a, op, b)
            parts.append(f"{a}{op}{b}{first}: {_stated(work, value)}")
        terms[i : i + 2] = [value]
        del ops[i]
    return f"{expr.canonical}: " + "; ".join(parts) + f". So the answer is {terms[0]}."


# -- drawing problems -------------------------------------------------------------------------------

def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def random_expr(rng: random.Random, kind: str, max_digits: int, digits: int | None = None, *,
                long_digits: int = LONG_TRAIN_DIGITS, chain_digits: int = CHAIN_DIGITS) -> Expr:
    """A problem of `kind`; its longest operand has `digits` digits when given, else at most `max_digits`
    (each operand's length drawn evenly; long multiplication's longer operand at most `long_digits`, chains'
    operands at most `chain_digits`)."""
    def length() -> int:
        return rng.randint(1, max_digits)

    if kind in "+-":
        sizes = [length(), length()]
        if digits is not None:
            sizes = [digits, rng.randint(1, digits)]
            rng.shuffle(sizes)
        return Expr((_operand(rng, sizes[0]), _operand(rng, sizes[1])), (kind,))
    if kind == "*":
        big = _operand(rng, digits if digits is not None else length())
        small = rng.randint(0, 9)
        return Expr((big, small) if rng.random() < 0.75 else (small, big), ("*",))
    if kind == "**":
        top = min(max_digits, long_digits) if digits is None else digits
        a = _operand(rng, rng.randint(2, max(2, top)) if digits is None else digits)
        b = _operand(rng, rng.randint(2, min(max(2, top), MULTIPLIER_DIGITS)))
        return Expr((a, b) if rng.random() < 0.5 or digits is not None else (b, a), ("*",))
    if kind == "chain":
        count = rng.choice((2, 2, 3))
        top = min(max_digits, chain_digits) if digits is None else digits
        ops = tuple(rng.choice("++--*") for _ in range(count))
        terms = []
        for k in range(count + 1):  # factors of a product kept to one digit
            times = (k > 0 and ops[k - 1] == "*") or (k < count and ops[k] == "*")
            terms.append(_operand(rng, 1 if times else rng.randint(1, top)))
        if digits is not None:
            plain = [k for k in range(count + 1) if not ((k > 0 and ops[k - 1] == "*") or (k < count and ops[k] == "*"))]
            terms[plain[0] if plain else 0] = _operand(rng, digits)
        return Expr(tuple(terms), ops)
    raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")


def max_digits_after(examples: int) -> int:
    """The first stage's curriculum: the longest operand training draws after `examples` examples."""
    return FIRST_STAGE.max_digits_after(examples)


def training_expr(rng: random.Random, max_digits: int = TRAIN_DIGITS, sizes: Sizes = FIRST_STAGE) -> Expr:
    kinds, shares = zip(*sizes.shares)
    while True:
        expr = random_expr(rng, rng.choices(kinds, shares)[0], max_digits, long_digits=sizes.long_digits,
                           chain_digits=sizes.chain_digits)
        if not is_held_out(expr):
            return expr


def held_out_exprs(n: int, seed: int, digits: int | None = None, kinds: tuple[str, ...] = KINDS) -> list[Expr]:
    """`n` distinct held-out problems, the kinds in turn; of training's sizes (digits None) or with the longest
    operand of exactly `digits` digits. Deterministic in `seed`."""
    if n < 0:
        raise ValueError(f"n={n} must not be negative")
    rng = random.Random(f"long-held-out:{seed}:{digits}")
    picked: list[Expr] = []
    seen: set[str] = set()
    tries = 0
    while len(picked) < n:
        kind = kinds[len(picked) % len(kinds)]
        top = {"**": LONG_TRAIN_DIGITS, "chain": CHAIN_DIGITS}.get(kind, TRAIN_DIGITS)
        expr = random_expr(rng, kind, top, digits)
        tries += 1
        if tries > 1000 * (n + 1):
            raise ValueError(f"cannot draw {n} distinct held-out problems of {digits} digits")
        if is_held_out(expr) and expr.canonical not in seen:
            seen.add(expr.canonical)
            picked.append(expr)
    return picked


# -- questions --------------------------------------------------------------------------------------

SYMBOLS = {"+": " + ", "-": " - ", "*": " x "}
# Two-step word problems, per split: {a} {b} {c} are the terms of a two-operation chain of the ops given.
WORD_CHAINS: dict[str, dict[str, tuple[str, ...]]] = {
    "train": {
        "+-": ("Sam has {a} apples, buys {b} more and gives {c} away. How many apples does Sam have now?",
               "A bus carries {a} people; {b} get on and {c} get off. How many people are on the bus?"),
        "--": ("A shop had {a} pens, sold {b} in the morning and {c} in the afternoon. How many pens are left?",),
        "++": ("Mia read {a} pages on Monday, {b} on Tuesday and {c} on Wednesday. How many pages did she read?",),
        "+*": ("A box holds {a} loose buttons plus {b} cards with {c} buttons on each. How many buttons is that?",),
    },
    "held_out": {
        "+-": ("A library had {a} books, received {b} new ones and lent out {c}. How many books are on the shelves?",),
        "--": ("A tank held {a} litres; {b} litres leaked and {c} litres were drained. How many litres remain?",),
        "++": ("A farm picked {a} pears, then {b}, then {c} more. How many pears were picked in all?",),
        "+*": ("A stall has {a} single eggs and {b} trays of {c} eggs. How many eggs does it have?",),
    },
}


def _expression(expr: Expr) -> str:
    return "".join(f"{t}{SYMBOLS[op]}" for t, op in zip(expr.terms, expr.ops)) + str(expr.terms[-1])


def question_text(expr: Expr, rng: random.Random, split: str = "train") -> str:
    """A question for `expr` in the phrasings of `split` (the binary problems in
    fusion.tools.training.arithmetic's templates, styles and word problems of that split, training's in its
    wider lists; chains in its frames, or as a two-step word problem)."""
    templates, styles = phrasing.PHRASINGS[split]
    if len(expr.ops) == 1 and split == "train":
        return phrasing.training_question(phrasing.Problem(expr.ops[0], *expr.terms), rng)
    if len(expr.ops) == 1:
        a, b = expr.terms
        op = expr.ops[0]
        if rng.random() < phrasing.WORD_SHARE and (op != "-" or a >= b):
            return rng.choice(phrasing.WORD_PHRASINGS[split][op]).format(a=a, b=b)
        return rng.choice(styles).replace("{q}", rng.choice(templates[op]).format(a=a, b=b))
    word = WORD_CHAINS.get(split, WORD_CHAINS["held_out"]).get("".join(expr.ops))
    if word and len(expr.ops) == 2 and expr.value >= 0 and rng.random() < 0.4:
        a, b, c = expr.terms
        return rng.choice(word).format(a=a, b=b, c=c)
    if split == "train":
        frames, styles = phrasing.FRAMES + phrasing.EXTRA_FRAMES, phrasing.TRAINING_STYLES
    else:
        frames = phrasing.HELD_OUT_FRAMES
    return rng.choice(styles).replace("{q}", rng.choice(frames).replace("{e}", _expression(expr)))


def make_questions(n: int, seed: int, split: str = "train", digits: int | None = None,
                   kinds: tuple[str, ...] = KINDS) -> list[tuple[str, int]]:
    """`n` held-out (question, answer) pairs (see `held_out_exprs`), worded in `split`'s phrasings."""
    rng = random.Random(f"long-phrasing:{split}:{seed}:{digits}")
    return [(question_text(e, rng, split), e.value) for e in held_out_exprs(n, seed, digits, kinds)]


class LongArithmeticStream(PromptAnswerStream):
    """Endless batches of (chat prompt + worked answer + turn terminator), loss on the answer only, the
    operands growing along the stage's curriculum (`sizes`). The chat template's system prompt is the same for
    every row, so it travels once as the batch's shared prefix instead of being recomputed per row. Worked
    answers range from 30 to about 1,500 tokens (the longer stage's 6-digit long multiplications), so rows are
    drawn `POOL` batches at a time and batched by length (the batches handed out in a drawn order): a batch
    pads to its own longest row, not to the pool's."""

    POOL = 4

    def __init__(self, tokenizer, seed: int, sizes: Sizes = FIRST_STAGE):
        super().__init__(tokenizer)
        self.rng = random.Random(f"long-train:{sizes.name}:{seed}" if sizes.name else f"long-train:{seed}")
        self.sizes = sizes
        self.examples = 0
        self._ready: list[list[tuple[list[int], list[int]]]] = []

    def rows(self, batch_size: int) -> list[tuple[list[int], list[int]]]:
        if not self._ready:
            pool = sorted((self.example() for _ in range(self.POOL * batch_size)), key=lambda r: len(r[0]) + len(r[1]))
            self._ready = [pool[k:k + batch_size] for k in range(0, len(pool), batch_size)]
            self.rng.shuffle(self._ready)
        return self._ready.pop()

    def question(self) -> tuple[Expr, str]:
        """The next training problem (of the curriculum's sizes, never held out by `is_held_out`) and its
        question in training's wordings."""
        expr = training_expr(self.rng, self.sizes.max_digits_after(self.examples), self.sizes)
        self.examples += 1
        return expr, question_text(expr, self.rng, "train")

    def example(self) -> tuple[list[int], list[int]]:
        """(prompt ids after the shared prefix, worked answer ids ending with the turn terminator)."""
        expr, question = self.question()
        prompt = self._after_prefix(self._encode(chat_prompt(self.tokenizer, question)), repr(expr.canonical))
        return prompt, self._encode(answer_text(expr)) + [self.end_id]
