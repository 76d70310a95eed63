"""Python specialist data: the standard library's own source as plain next-token text.

Why plain language modelling and no chat wrapping: in a fused decode this expert's job is to
make code continuations likelier once code is being written; following the chat turn structure
is the lead expert's job, and local code context dominates its next-token prediction anyway.

Files are split into training and held-out by a hash of their path relative to the stdlib root,
so the held-out loss is measured on whole files the model never saw.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import torch

from fusion.tools.training.loop import Batch
from fusion.tools.training.split import hashed_out

HELD_OUT_PERCENT = 5
SEQ_LEN = 256


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    return hashed_out(rel_path, HELD_OUT_PERCENT)


def stdlib_files(*, held_out: bool) -> list[Path]:
    """The stdlib's .py files (no site-packages), sorted, from one side of the split."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/"):
            continue
        if is_held_out(rel) == held_out:
            files.append(path)
    return files


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


class CodeStream:
    """Endless [B, SEQ_LEN] windows over the training files, shuffled per pass by the seed."""

    def __init__(self, tokenizer, seed: int, seq_len: int = SEQ_LEN):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.files = stdlib_files(held_out=False)
        if not self.files:
            raise ValueError(f"no Python files found under {stdlib_root()}")
        self.rng = random.Random(f"code:{seed}")
        self.sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.order: list[Path] = []
        self.buffer: list[int] = []

    def _refill(self) -> None:
        if not self.order:
            self.order = self.rng.sample(self.files, len(self.files))
        text = _read(self.order.pop())
        self.buffer += self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.sep]

    def __call__(self, batch_size: int) -> Batch:
        need = batch_size * (self.seq_len + 1)
        while len(self.buffer) < need:
            self._refill()
        block = torch.tensor(self.buffer[:need]).view(batch_size, self.seq_len + 1)  # [B, S+1]
        del self.buffer[:need]
        return Batch(input_ids=block[:, :-1], labels=block[:, 1:])
