"""Recipes for the builtin specialists, and `train_expert`, which runs one end to end.

Each specialist is a LoRA adapter over SmolLM2-135M-Instruct (`fusion.tools.training.lora`): it reads
through the base's pretrained layers, so wordings it never trained on still land near ones it did.
The shipped adapters (`fusion/adapters/`) were made by exactly these recipes; their manifests say
with which seed, data and base, and what they scored.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

from fusion.tools.training.long_arithmetic import LONGER_STAGE, LongArithmeticStream
from fusion.tools.training.loop import AlternatingStream
from fusion.tools.training.lora import LoraRecipe, already_trained, checkpoint_of, train_lora
from fusion.tools.training.python_code import CodeStream
from fusion.tools.training.python_functions import FunctionStream

logger = logging.getLogger(__name__)


def code_and_functions(tokenizer, seed: int) -> AlternatingStream:
    """Plain windows of the standard library's code and its functions' bodies, a batch of each in turn."""
    return AlternatingStream(CodeStream(tokenizer, seed), FunctionStream(tokenizer, seed))


RECIPES: dict[str, LoraRecipe] = {
    # Chat questions of any length (fusion.tools.training.long_arithmetic): numbers of 1-6 digits along a
    # curriculum, long multiplication, chains, two-step word problems, in the wide training phrasings, each
    # worked digit by digit with one procedure at every size; loss on the answer only.
    "arithmetic": LoraRecipe(stream=LongArithmeticStream, steps=1200, rank=16, alpha=32,
                             loop={"batch_size": 16, "lr": 1.5e-3, "warmup_steps": 30, "log_every_s": 60}),
    # The second stage, from the first one's adapter: long multiplication and chains grown from 3 digits to 6
    # (fusion.tools.training.long_arithmetic.LONGER_STAGE), the other kinds kept in the mix. The shipped
    # arith-lora: the first stage alone got long multiplication wrong from 6 digits on.
    "arithmetic-longer": LoraRecipe(stream=partial(LongArithmeticStream, sizes=LONGER_STAGE), steps=150, rank=16,
                                    alpha=32, start="arithmetic",
                                    loop={"batch_size": 16, "lr": 1e-3, "warmup_steps": 15, "log_every_s": 60}),
    # Plain next-token windows of the standard library's training files (held-out files never drawn).
    "python": LoraRecipe(stream=CodeStream, steps=400, rank=8, alpha=16,
                         loop={"batch_size": 8, "lr": 1e-3, "warmup_steps": 20, "log_every_s": 30}),
    # The standard library's documented functions, the body written after the signature and docstring
    # (fusion.tools.training.python_functions): the shape of HumanEval, measured by running the code. Not
    # shipped: with it in the trio HumanEval was no better and the text the plain-window adapter lowers
    # (Python files, prose) scored worse (docs/quality.md).
    "python-functions": LoraRecipe(stream=FunctionStream, steps=300, rank=16, alpha=32,
                                   loop={"batch_size": 16, "lr": 1e-3, "warmup_steps": 30, "log_every_s": 60}),
    # Both in turn: a plain window batch, then a function batch (the windows carry the bits-per-byte gains
    # on code and prose, the functions the bodies HumanEval runs). Not shipped: alone it solved 1 of
    # HumanEval's 164, and a trio with it none (benchmarks/results/mixed_code_adapter.json).
    "python-mixed": LoraRecipe(stream=code_and_functions, steps=700, rank=16, alpha=32,
                               loop={"batch_size": 8, "lr": 1e-3, "warmup_steps": 30, "log_every_s": 60}),
    # The second stage, from the plain-window adapter: a short run of both in turn at half its rate, so that
    # it writes a body after a docstring (with the first stage alone, about a fifth of HumanEval's answers
    # closed the code block at once, in the trio too) and keeps what the windows taught.
    "python-bodies": LoraRecipe(stream=code_and_functions, steps=80, rank=8, alpha=16, start="python",
                                loop={"batch_size": 8, "lr": 5e-4, "warmup_steps": 5, "log_every_s": 60}),
}
ADAPTER_NAMES = {"arithmetic-longer": "arith-lora", "python-bodies": "python-lora"}  # the builtin adapter each recipe makes


def train_expert(kind: str, out_dir: Path, *, base_dir: Path, seed: int = 0, steps: int | None = None,
                 minutes: float | None = None, base_ref: str | None = None, device: str = "cpu",
                 resume: bool = True) -> Path:
    """Train the `kind` specialist as a LoRA adapter over the base at `base_dir`; save it into `out_dir`.

    Deterministic given `seed` and `steps` on one machine (the recipe's step count when neither `steps`
    nor `minutes` is given; with `minutes` too, the run stops there and the next one resumes). `base_ref` is
    what the adapter records as its base (default: the folder).
    """
    if kind not in RECIPES:
        raise ValueError(f"unknown expert kind {kind!r}; known: {', '.join(sorted(RECIPES))}")
    recipe, out_dir, start = RECIPES[kind], Path(out_dir), None
    if resume and finished(kind, out_dir, seed=seed, steps=steps):
        # Before the stage it starts from: a finished stage (a shipped adapter copied in, or a run whose
        # start folder was cleared) needs nothing of it, and that stage may be hours of training.
        logger.info("%s: %s already holds this recipe's %d steps with seed %d (--fresh trains it again)", kind,
                    out_dir, recipe.steps if steps is None else steps, seed)
        return out_dir
    if recipe.start is not None:
        # The stage before, trained first (or found finished) beside `out_dir`, with the same seed; a budget
        # spent on it leaves its checkpoint and this stage waits for the next run.
        start, began = start_of(out_dir, recipe.start), time.monotonic()
        train_expert(recipe.start, start, base_dir=base_dir, seed=seed, minutes=minutes, base_ref=base_ref,
                     device=device)  # `resume` False starts this stage over, not the finished one before it
        if minutes is not None:
            minutes -= (time.monotonic() - began) / 60
        if checkpoint_of(start).exists() or (minutes is not None and minutes <= 0):
            return out_dir
    return train_lora(kind, recipe, out_dir, base_dir=Path(base_dir), seed=seed, steps=steps,
                      minutes=minutes, base_ref=base_ref, device=device, resume=resume, start=start)


def finished(kind: str, out_dir: Path, *, seed: int = 0, steps: int | None = None) -> bool:
    """Whether `out_dir` holds the `kind` recipe's adapter trained to the end (`steps`: the recipe's)."""
    recipe = RECIPES[kind]
    return already_trained(Path(out_dir), kind, recipe, recipe.steps if steps is None else steps, seed)


def start_of(out_dir: Path, stage: str) -> Path:
    """Where training into `out_dir` keeps the finished adapter of the stage it starts from."""
    return Path(out_dir).with_name(f"{Path(out_dir).name}.from-{stage}")
