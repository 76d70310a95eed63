"""Arithmetic questions in words, and the two-digit problems the evaluation holds out; answer extraction and
the chat prompt.

Phrasings. Questions are composed from parts split into training's lists and held-out sets (below), so
that the evaluation can ask the same problems in training's wordings (in-template) and in wordings no
training composes (out-of-template): the second measures reading the numbers and the operation out of
words, not recalling a template. The any-size specialist's stream and the router's texts word their
questions from the training lists only (through `long_arithmetic.question_text`).

Held-out problems. `make_questions` asks two-digit problems, the kinds in turn: + and - on 0..99, * with
one operand 0..9, and long multiplication of two two-digit numbers. A problem (op, a, b) belongs to the
held-out set when a hash of its canonical form puts it in the held-out tenth and the any-size training's
split (`any_size_held_out`, which `long_arithmetic.is_held_out` keeps) holds it out too: about one problem
in a hundred, the same for every seed, and none that the specialist's or the router's training draws.

`extract_answer` reads the final number of a generated answer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cache

from fusion.tools.training import split

MAX_OPERAND = 99  # + and -: both operands in 0..MAX_OPERAND
MAX_MULTIPLIER = 9  # * by one digit: one operand in 0..MAX_MULTIPLIER, the other in 0..MAX_OPERAND
LONG_MIN = 10  # long multiplication: both operands in LONG_MIN..MAX_OPERAND
HELD_OUT_PERCENT = 10

# Phrasings are composed of three parts, each split into a training and a held-out list: the
# expression (how the operation is worded), the frame around it (the question's verb and
# punctuation) and the instruction style (what the user wraps the question in). Training (of the
# specialist and of the router) composes training parts only; `make_questions(..., phrasing="held_out")`
# composes held-out parts only, so an out-of-template question shares no wording beyond the numbers
# and common words with anything trained on. Whole imperative templates ("Add {a} and {b}.") count as
# training expressions framed by themselves.
EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} + {b}", "{a}+{b}", "{a} plus {b}", "the sum of {a} and {b}"),
    "-": ("{a} - {b}", "{a}-{b}", "{a} minus {b}", "the difference {a} - {b}", "{a} take away {b}"),
    "*": ("{a} x {b}", "{a} * {b}", "{a}*{b}", "{a} × {b}", "{a} times {b}", "the product of {a} and {b}"),
}
HELD_OUT_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} and {b} added together", "the total of {a} and {b}"),
    "-": ("{b} subtracted from {a}", "{a} less {b}"),
    "*": ("{a} multiplied by {b}", "{a} lots of {b}"),
}
IMPERATIVES: dict[str, tuple[str, ...]] = {
    "+": ("Add {a} and {b}.",),
    "-": ("Subtract {b} from {a}.",),
    "*": ("Multiply {a} by {b}.",),
}
FRAMES = (
    "What is {e}?", "What's {e}?", "{e} = ?", "{e}", "{e}?", "Compute {e}.", "Calculate {e}.", "Work out {e}.",
    "Find {e}.", "Evaluate {e}.", "How much is {e}?", "Tell me {e}.", "Can you compute {e}?",
    "Please calculate {e}.", "What do you get for {e}?", "Solve {e}.",
)
HELD_OUT_FRAMES = (
    "Would you mind working out {e}?", "I wonder what {e} comes to.", "{e} equals what?",
    "Give me the result of {e}.", "Determine {e}, please.",
)
STYLES = (
    "{q}", "{q}", "{q}", "{q}", "Please answer: {q}", "Question: {q}", "Solve this: {q}", "{q} Show your working.",
    "Math question. {q}", "Help me with this one: {q}", "Q: {q}", "Arithmetic: {q}",
)
HELD_OUT_STYLES = (
    "My kid asked me this and I forgot how: {q}", "{q} Explain step by step.", "Homework check -> {q}",
    "Hi! Quick one for you. {q} Thanks.",
)


# A second out-of-template set, written after the first set's results were known. It has informed
# nothing: no training list and no default was chosen with it in view, so it checks that the first
# set's figures are not an accident of the few wordings it happens to hold. Its pieces match no
# training question either (a test checks).
FRESH_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{b} added onto {a}", "{a} with {b} more on top", "{a} and {b} put together"),
    "-": ("{a} subtract {b}", "{a} with {b} taken off", "{b} deducted from {a}"),
    "*": ("{a} rows of {b}", "{a} multiplied with {b}", "product of {a} with {b}"),
}
FRESH_FRAMES = (
    "Any idea what {e} is?", "What comes out of {e}?", "Let me know {e}.", "{e}: what do we get?",
    "Help me find {e}.",
)
FRESH_STYLES = (
    "Teacher here, checking answers. {q}", "{q} Walk me through it.", "urgent!! {q}", "Puzzle for you - {q} Cheers!",
)


# A third set, written before any of its results was seen; it informs no default either. `fusion eval`
# does not ask it by default (its time goes to the first two): it is a reserve for checking the first
# two sets' figures again once they have informed choices.
NOVEL_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} and {b} added up", "{a} along with {b}", "{b} tacked onto {a}"),
    "-": ("{a} having lost {b}", "{a} after spending {b}", "{a} with {b} subtracted"),
    "*": ("{a} stacks of {b}", "{a} weeks of {b} per week", "{a} times the number {b}"),
}
NOVEL_FRAMES = ("I'd love to know {e}.", "{e} - any thoughts?", "Tell me what {e} is.", "What might {e} be?",
                "Curious about {e}.")
NOVEL_STYLES = ("Grandma wants to know: {q}", "{q} Don't rush.", "Exam prep. {q}", "{q} Thanks heaps!")


# A fourth set, the spare, written once the third set's results were known and before any adapter had
# answered it. It informs nothing: with the third set now seen (it informed a retraining that was not
# kept), the spare is the one that checks the out-of-template figures. `fusion eval
# --reserve` asks it beside the third.
SPARE_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} and {b} summed", "{a} with another {b} added", "{b} in addition to {a}"),
    "-": ("{a} lessened by {b}", "{b} knocked off {a}", "{a} cut by {b}"),
    "*": ("{a} crates of {b}", "{a} copies of {b}", "{b} repeated {a} times"),
}
SPARE_FRAMES = ("Mind telling me {e}?", "{e} -> ?", "Need a hand: {e}.", "How big is {e}?", "{e} - can't work it out.")
SPARE_STYLES = ("Dad here. {q}", "{q} Cheers, mate.", "Revision time: {q}", "{q} (asking for a friend)")


# A fifth set, written once the spare set's results were known (its misses informed the training
# lists' operand-order wordings below) and before any adapter trained on those lists had answered
# anything. It informs nothing; `fusion eval --reserve` asks it beside the third and the fourth.
FIFTH_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} together with {b}", "{b} piled on top of {a}", "{a} topped up by {b}"),
    "-": ("{b} shaved off {a}", "{a} after losing {b}", "{b} docked from {a}"),
    "*": ("{a} packs of {b}", "{b} counted {a} times", "{a} bundles of {b}"),
}
FIFTH_FRAMES = ("Any chance you know {e}?", "Quick sum: {e}.", "{e} -- what's that?", "Reckon you can do {e}?",
                "Answer me this: {e}.")
FIFTH_STYLES = ("Uncle Bob asks: {q}", "{q} Ta.", "Lunch break puzzle. {q}", "{q} (for my notes)")


# A sixth set, written once the fifth set's results were known and before any router or fail-safe
# setting was chosen for an adapter trained after them: choices made on sets one to five leave it the
# one that informed nothing. `fusion eval --sets ...,sixth` asks it (not `--reserve`, so that choosing
# among runs on the other sets never shows its figures).
SIXTH_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} raised by {b}", "{b} tossed in with {a}", "{a} boosted by {b}"),
    "-": ("{a} trimmed by {b}", "{b} lopped off {a}", "{a} after giving away {b}"),
    "*": ("{a} trays of {b}", "{a} cartons holding {b} each", "{b}, {a} times over"),
}
SIXTH_FRAMES = ("Settle this: {e}?", "{e} makes how many?", "Hit me with {e}.", "Got a moment for {e}?",
                "Out of interest, {e}?")
SIXTH_STYLES = ("Aunt May wonders: {q}", "{q} Much obliged.", "Train ride riddle. {q}", "{q} (double-checking)")


# A seventh set, written once the sixth set's losses were read question by question (they informed the
# route rule's confidence scaling, `tau`) and before any setting of it was measured here. It informs nothing;
# like the sixth it is asked only by name (`fusion eval --sets ...,seventh`).
SEVENTH_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} padded out with {b}", "{b} stacked beside {a}", "{a} grown by {b}"),
    "-": ("{a} shrunk by {b}", "{b} shed from {a}", "{a} drained by {b}"),
    "*": ("{a} shelves of {b}", "{a} baskets with {b} in each", "{a} rounds of {b}"),
}
SEVENTH_FRAMES = ("Help me out: {e}?", "{e} comes to what?", "Be a star and work {e} out.", "Wondering about {e}.",
                  "Any idea what {e} gives?")
SEVENTH_STYLES = ("Cousin Jo asks: {q}", "{q} Many thanks.", "Pub quiz question. {q}", "{q} (just to be sure)")


# Word problems: whole questions in which the numbers are things counted, per split like the
# templates above. A "-" word problem is asked only when the difference is not negative (nobody
# sells 40 of 12 pens); other questions go to the templates.
WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?",
          "A bus carries {a} people and {b} more get on. How many people are on the bus?",
          "There are {a} red balls and {b} blue balls in a bag. How many balls are in the bag?",
          "Mia read {a} pages on Monday and {b} pages on Tuesday. How many pages did she read in all?"),
    "-": ("A shop had {a} pens and sold {b}. How many pens are left?",
          "Tom had {a} stickers and gave {b} to his friend. How many stickers does Tom have now?",
          "A tank holds {a} litres and {b} litres leak out. How many litres remain?",
          "There were {a} birds on a tree and {b} flew away. How many birds are still on the tree?"),
    "*": ("There are {a} boxes with {b} pencils in each. How many pencils are there in total?",
          "A farmer plants {a} lines with {b} trees in each line. How many trees does he plant?",
          "Each ticket costs {b} dollars. How much do {a} tickets cost?",
          "A book has {a} chapters of {b} pages each. How many pages does it have?"),
}
HELD_OUT_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("Lena saved {a} coins last month and {b} coins this month. What is her total now?",
          "A library got {a} new novels and {b} new comics. How many new books arrived?"),
    "-": ("A baker made {a} rolls and {b} were eaten at lunch. How many rolls are still there?",
          "Out of {a} seats in the hall, {b} are taken. How many seats are free?"),
    "*": ("A crate has {a} layers, each with {b} eggs. How many eggs fit in the crate?",
          "If one parcel weighs {b} kilograms, what do {a} such parcels weigh together?"),
}
FRESH_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("Our team scored {a} points in the first half and {b} in the second. What was the final score?",),
    "-": ("The ferry left with {a} cars and dropped {b} at the first stop. How many cars are on board?",),
    "*": ("{a} children each bring {b} marbles to school. How many marbles are there altogether?",),
}
NOVEL_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("A hiker walks {a} km one day and {b} km the next. How far did she walk?",),
    "-": ("Of {a} emails in the inbox, {b} were deleted. How many emails stay?",),
    "*": ("A theatre sells {a} rows with {b} seats per row. How many seats does it sell?",),
}
SPARE_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("A jar held {a} sweets and {b} more were poured in. How many sweets are in the jar?",),
    "-": ("A train had {a} passengers and {b} got off. How many passengers are left on the train?",),
    "*": ("A garden has {a} beds with {b} tulips in each bed. How many tulips are there?",),
}
FIFTH_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("A box had {a} crayons and {b} were added later. How many crayons are in the box?",),
    "-": ("A farmer had {a} sheep and sold {b} at the market. How many sheep does he keep?",),
    "*": ("A school orders {a} packs with {b} rulers in each pack. How many rulers is that?",),
}
SIXTH_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("A pond had {a} ducks and {b} more landed on it. How many ducks are on the pond?",),
    "-": ("A van carried {a} boxes and unloaded {b} of them. How many boxes are still in the van?",),
    "*": ("A hotel has {a} floors with {b} rooms on each floor. How many rooms are there?",),
}
SEVENTH_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("A bakery sold {a} loaves in the morning and {b} in the evening. How many loaves did it sell?",),
    "-": ("A cinema had {a} tickets and {b} were sold. How many tickets are unsold?",),
    "*": ("A classroom has {a} desks with {b} books on each desk. How many books are on the desks?",),
}


def _templates(frames: tuple[str, ...], expressions: dict[str, tuple[str, ...]],
               imperatives: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    return {op: tuple(f.replace("{e}", e) for f in frames for e in expressions[op]) + imperatives.get(op, ())
            for op in expressions}


TEMPLATES = _templates(FRAMES, EXPRESSIONS, IMPERATIVES)  # training: frames x expressions + imperatives
HELD_OUT_TEMPLATES = _templates(HELD_OUT_FRAMES, HELD_OUT_EXPRESSIONS, {})  # held-out frames x expressions
FRESH_TEMPLATES = _templates(FRESH_FRAMES, FRESH_EXPRESSIONS, {})
NOVEL_TEMPLATES = _templates(NOVEL_FRAMES, NOVEL_EXPRESSIONS, {})
SPARE_TEMPLATES = _templates(SPARE_FRAMES, SPARE_EXPRESSIONS, {})
FIFTH_TEMPLATES = _templates(FIFTH_FRAMES, FIFTH_EXPRESSIONS, {})
SIXTH_TEMPLATES = _templates(SIXTH_FRAMES, SIXTH_EXPRESSIONS, {})
SEVENTH_TEMPLATES = _templates(SEVENTH_FRAMES, SEVENTH_EXPRESSIONS, {})
PHRASINGS = {"train": (TEMPLATES, STYLES), "held_out": (HELD_OUT_TEMPLATES, HELD_OUT_STYLES),
             "fresh": (FRESH_TEMPLATES, FRESH_STYLES), "novel": (NOVEL_TEMPLATES, NOVEL_STYLES),
             "spare": (SPARE_TEMPLATES, SPARE_STYLES), "fifth": (FIFTH_TEMPLATES, FIFTH_STYLES),
             "sixth": (SIXTH_TEMPLATES, SIXTH_STYLES), "seventh": (SEVENTH_TEMPLATES, SEVENTH_STYLES)}
WORD_PHRASINGS = {"train": WORD_PROBLEMS, "held_out": HELD_OUT_WORD_PROBLEMS, "fresh": FRESH_WORD_PROBLEMS,
                  "novel": NOVEL_WORD_PROBLEMS, "spare": SPARE_WORD_PROBLEMS, "fifth": FIFTH_WORD_PROBLEMS,
                  "sixth": SIXTH_WORD_PROBLEMS, "seventh": SEVENTH_WORD_PROBLEMS}
WORD_SHARE = 0.2  # of questions whose problem suits a word problem

# Training draws from wider lists than the in-template evaluation asks in: more wordings of each
# operation, polite and indirect frames, instructions about the answer's form, and openers and
# closers around the question, so that the specialist learns to read the numbers and the operation
# out of words it was not built around. None of these is a held-out piece of either set (a test
# checks), and the held-out operation words (added together, total, subtracted from, less, multiplied
# by, lots of; added onto, put together, deducted, taken off, rows of, multiplied with) never appear:
# a specialist that reads embeddings borrowed from the generalist has to get them from
# their neighbours ("multiply", "subtract", "groups of").
EXTRA_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "+": ("{a} increased by {b}", "{a} more than {b}", "{a} and {b} combined", "{a}, plus {b}",
          "{a} + {b} (addition)", "the result of adding {a} and {b}"),
    "-": ("{a} decreased by {b}", "{a} reduced by {b}", "the result of subtracting {b} from {a}",
          "{a} - {b} (subtraction)", "{a}, minus {b}", "{a} with {b} removed",
          # Wordings that name the smaller operand first, so that the order of the words and not of
          # the numbers says which is taken from which.
          "{b} taken from {a}", "{b} taken away from {a}", "{b} removed from {a}", "{a} once {b} is gone",
          "what is left of {a} after {b}", "{b} fewer than {a}"),
    "*": ("{a} groups of {b}", "{a} sets of {b}", "{a} x {b} (multiplication)", "the result of multiplying {a} by {b}",
          "{a}, times {b}", "{a} multiply {b}"),
}
# Operand order read from the preposition rather than from a fixed phrase: "{b} <verb> from/off/out of
# {a}" asks for a - b and "{b} <verb> to/onto/into {a}" for a + b, for many verbs, so that a wording
# naming the amount taken (or added) first with a verb training never saw still reads the right way
# round. `training_question` draws them with `ORDER_SHARE`; none shares a word with a held-out set's
# expressions (subtracted, deducted, knocked, shaved, docked, tacked, added, taken, ...; a test checks).
ORDER_VERBS: dict[str, tuple[str, ...]] = {
    "+": ("brought", "put", "stuck", "glued", "joined", "attached", "thrown", "heaped", "fixed", "moved"),
    "-": ("scooped", "removed", "pulled", "dropped", "cut", "lifted", "wiped", "struck", "withdrawn", "borrowed"),
}
ORDER_PREPOSITIONS: dict[str, tuple[str, ...]] = {"+": ("to", "onto", "into"), "-": ("from", "off", "out of")}
ORDER_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    op: tuple(f"{{b}} {verb} {prep} {{a}}" for verb in verbs for prep in ORDER_PREPOSITIONS[op])
    for op, verbs in ORDER_VERBS.items()
}
ORDER_SHARE = 0.2  # of + and - template questions
# More word problems for training only (the in-template set asks `WORD_PROBLEMS`), in other verbs and
# orders, some naming the smaller amount first.
EXTRA_WORD_PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("Ben had {a} marbles and found {b} more. How many marbles does Ben have?",
          "A farm has {a} cows and buys another {b}. How many cows does the farm have now?",
          "{a} people came in the morning and {b} in the afternoon. How many people came that day?",
          "A shelf holds {a} books, then {b} more are placed on it. How many books are on the shelf?"),
    "-": ("Kim had {a} sweets and ate {b}. How many sweets are left?",
          "A class has {a} pupils and {b} are away today. How many pupils are in class?",
          "{b} of the {a} cookies were eaten. How many cookies remain?",
          "A rope is {a} metres long and {b} metres are cut from it. How long is the rope now?"),
    "*": ("{a} bags hold {b} oranges each. How many oranges are there in all?",
          "A car park has {a} lanes with {b} cars in each. How many cars are parked?",
          "Each of {a} tables seats {b} guests. How many guests can sit down?",
          "A worker earns {b} dollars an hour for {a} hours. How much does she earn?"),
}
EXTRA_IMPERATIVES: dict[str, tuple[str, ...]] = {
    "+": ("Add {b} to {a}.", "Sum {a} and {b}.", "Find the sum of {a} and {b}."),
    "-": ("Take {b} away from {a}.", "Work out {a} take away {b}.", "Subtract {b} from {a}, please.",
          "From {a}, take away {b}.", "Remove {b} from {a}.", "Start at {a} and count back {b}."),
    "*": ("Multiply {a} and {b}.", "Find the product of {a} and {b}.", "Work out {a} times {b}, please."),
}
EXTRA_FRAMES = (
    "Could you tell me {e}?", "Can you work out {e} for me?", "I need {e}.", "What does {e} come to?",
    "Do you know {e}?", "What would {e} be?", "Quick question: what is {e}?", "{e}, what is it?",
    "Please tell me the value of {e}.", "So what is {e}?", "And {e}?", "Figure out {e}.",
    "What is the answer to {e}?", "Result of {e}?", "I'd like to know {e}.", "Give the value of {e}.",
)
EXTRA_STYLES = (
    "{q} Answer with just the number.", "{q} Reply with the result only.", "{q} Keep it short.",
    "{q} Show the steps.", "{q} Be careful with the carries.", "{q} No need to explain.",
    "Here is a problem. {q}", "I'm stuck on this: {q}", "Can you help me? {q}", "Exercise: {q}",
    "Practice problem: {q}", "For my worksheet: {q}", "Check this for me: {q}", "Mental maths: {q}",
)
OPENERS = ("Hello.", "Hey there!", "Good morning.", "Hi there,", "Sorry to bother you.", "OK,", "Next one.",
           "One more.", "I'm checking my homework.", "This is for a quiz.", "We are counting apples at the market.",
           "My teacher gave us this.", "Hello, assistant.", "Let's try another.")
CLOSERS = ("Thank you!", "Cheers.", "Much appreciated.", "Thank you so much.", "Please be quick.",
           "I need it for class.", "Double-check it.", "Just the final number, please.", "Take your time.")
TRAINING_TEMPLATES = {op: TEMPLATES[op] + _templates(FRAMES + EXTRA_FRAMES, EXTRA_EXPRESSIONS, EXTRA_IMPERATIVES)[op]
                      + _templates(EXTRA_FRAMES, EXPRESSIONS, {})[op] for op in TEMPLATES}
TRAINING_STYLES = STYLES + EXTRA_STYLES


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

    @property
    def kind(self) -> str:
        """"+", "-", "*" (by one digit) or "**" (long: two digits by two digits)."""
        if self.op == "*" and min(self.a, self.b) >= LONG_MIN:
            return "**"
        return self.op


def hashed_out(key: str) -> bool:
    """Whether `key` falls in the held-out tenth (fusion.tools.training.split)."""
    return split.hashed_out(key, HELD_OUT_PERCENT)


def any_size_held_out(canonical: str) -> bool:
    """The split of the any-size specialist's problems (fusion.tools.training.long_arithmetic), which draws
    two-digit problems too."""
    return hashed_out(f"long:{canonical}")


def is_held_out(p: Problem) -> bool:
    """Whether `p` is in the two-digit held-out set: held out by its own hash and by the any-size training's
    split, so that no specialist or router training draws it."""
    return hashed_out(p.canonical) and any_size_held_out(p.canonical)


def suits_word_problem(p: Problem) -> bool:
    return p.op != "-" or p.a >= p.b


def question_text(p: Problem, rng: random.Random, phrasing: str = "train") -> str:
    """A question for `p` in a random template and instruction style of the `phrasing` split ("train":
    training's templates and styles, the in-template wording; the others: templates and styles no
    training composes)."""
    templates, styles = PHRASINGS[phrasing]
    if rng.random() < WORD_SHARE and suits_word_problem(p):
        return rng.choice(WORD_PHRASINGS[phrasing][p.op]).format(a=p.a, b=p.b)
    question = rng.choice(templates[p.op]).format(a=p.a, b=p.b)
    text = rng.choice(styles).replace("{q}", question)
    if rng.random() < 0.15:  # casual lower case
        text = text[0].lower() + text[1:]
    return text


def training_question(p: Problem, rng: random.Random) -> str:
    """A question for `p` as training sees it: any training template and style (the in-template ones
    and the wider lists), sometimes with an opener or a closer around it."""
    if rng.random() < WORD_SHARE and suits_word_problem(p):
        text = rng.choice(WORD_PROBLEMS[p.op] + EXTRA_WORD_PROBLEMS[p.op]).format(a=p.a, b=p.b)
        return rng.choice(EXTRA_STYLES[:6]).replace("{q}", text) if rng.random() < 0.3 else text
    if p.op in ORDER_EXPRESSIONS and rng.random() < ORDER_SHARE:
        template = rng.choice(FRAMES + EXTRA_FRAMES).replace("{e}", rng.choice(ORDER_EXPRESSIONS[p.op]))
    else:
        template = rng.choice(TRAINING_TEMPLATES[p.op])
    question = template.format(a=p.a, b=p.b)
    text = rng.choice(TRAINING_STYLES).replace("{q}", question)
    if rng.random() < 0.25:
        text = f"{rng.choice(OPENERS)} {text}"
    if rng.random() < 0.2:
        text = f"{text} {rng.choice(CLOSERS)}"
    if rng.random() < 0.15:  # casual lower case
        text = text[0].lower() + text[1:]
    return text


@cache
def _held_out_pool() -> tuple[Problem, ...]:
    operands, multipliers = range(MAX_OPERAND + 1), range(MAX_MULTIPLIER + 1)
    pool = [Problem(op, a, b) for op in "+-" for a in operands for b in operands]
    pool += [Problem("*", a, m) for a in operands for m in multipliers]
    pool += [Problem("*", m, a) for a in operands if a > MAX_MULTIPLIER for m in multipliers]
    pool += [Problem("*", a, b) for a in range(LONG_MIN, MAX_OPERAND + 1) for b in range(LONG_MIN, MAX_OPERAND + 1)]
    return tuple(p for p in pool if is_held_out(p))


KINDS = ("+", "-", "*", "**")


def held_out_count() -> int:
    """How many distinct problems the held-out sets can ask."""
    return len(_held_out_pool())


def held_out_problems(n: int, seed: int) -> list[Problem]:
    """`n` distinct held-out problems, the kinds in turn (as even as `n` allows); deterministic in `seed`."""
    pool = _held_out_pool()
    by_kind = {k: [p for p in pool if p.kind == k] for k in KINDS}
    if n < 0 or n > len(pool):
        raise ValueError(f"n={n} must be between 0 and {len(pool)} (held-out problems)")
    rng = random.Random(f"held-out:{seed}")
    order = {k: rng.sample(ps, len(ps)) for k, ps in by_kind.items()}
    picked: list[Problem] = []
    while len(picked) < n:  # round by round, each kind once per round (in a shuffled order)
        live = [k for k in KINDS if order[k]]
        for kind in rng.sample(live, len(live))[: n - len(picked)]:
            picked.append(order[kind].pop())
    return picked


def make_questions(n: int, seed: int, phrasing: str = "train") -> list[tuple[str, int]]:
    """`n` distinct held-out (question, answer) pairs; deterministic in `seed`.

    Kinds (+, -, * by one digit, two digits by two digits) take turns, every problem from the
    held-out split (`is_held_out`). `phrasing`: "train" words them in training templates and styles
    (in-template); "held_out", "fresh", "novel", "spare", "fifth", "sixth" and "seventh" in templates and
    styles no training composes (out-of-template); the same `seed` gives the same problems in every phrasing.
    """
    problems = held_out_problems(n, seed)
    rng = random.Random(f"phrasing:{phrasing}:{seed}")
    return [(question_text(p, rng, phrasing), p.value) for p in problems]


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
