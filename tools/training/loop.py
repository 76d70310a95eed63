"""A small training loop for causal LMs (the specialists' LoRA adapters over a frozen base).

The loss is the full-vocabulary cross-entropy on the positions a batch labels (a chat answer's tokens,
every token of a code window). Matmuls run under bf16 autocast (fp32 master weights) where the hardware
multiplies bf16 itself (a GPU; a CPU with AVX-512 bf16 or AMX), in fp32 elsewhere. Everything is seeded:
the same seed and step count give the same weights on one machine.

Resumable: with a checkpoint path the loop saves the trained parameters, the optimizer and its counters
there every few minutes (and when it stops); started again, it loads them and draws the batches already
trained on again without training on them, so the stream (and a hash over it) goes on where it was.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fusion.frontdoor.text import end_of_turn_id
from fusion.tools.progress import progress_line

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] right-padded
    labels: torch.Tensor  # [B, S]: the token after input_ids[:, t], -100 where no loss
    prefix_ids: torch.Tensor | None = None  # [P]: tokens every row starts with, before input_ids


def chat_prompt(tokenizer, question: str) -> str:
    """The prompt exactly as the fusion engine formats it (the template's default system prompt)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def chat_prefix_ids(tokenizer) -> list[int]:
    """The ids every chat prompt starts with (the template's system prompt and the user turn's opening)."""
    one, two = (tokenizer(chat_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
                for q in ("1 + 1", "What is 2 x 3?"))
    n = 0
    while n < min(len(one), len(two)) and one[n] == two[n]:
        n += 1
    return one[:n]


class PromptAnswerStream:
    """Endless batches of (chat prompt, answer) id rows, right-padded, the loss on the answer only, the
    answer ending the turn; every row starts with `prefix`, the ids every chat prompt starts with (the
    template's system prompt), which the batch carries once. A subclass gives `example`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_id = end_of_turn_id(tokenizer)
        self.prefix = chat_prefix_ids(tokenizer)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _after_prefix(self, prompt: list[int], what: str) -> list[int]:
        """A whole prompt's ids after the shared `prefix` (the batch carries the prefix once)."""
        if prompt[: len(self.prefix)] != self.prefix:
            raise ValueError(f"the prompt for {what} does not start with the shared prefix")
        return prompt[len(self.prefix):]

    def example(self) -> tuple[list[int], list[int]]:
        """(prompt ids after the shared prefix, answer ids)."""
        raise NotImplementedError

    def rows(self, batch_size: int) -> list[tuple[list[int], list[int]]]:
        """The next batch's (prompt, answer) id rows."""
        return [self.example() for _ in range(batch_size)]

    def __call__(self, batch_size: int) -> Batch:
        rows = self.rows(batch_size)
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


class AlternatingStream:
    """Batches from several streams in turn (step k draws from stream k mod n): one recipe that trains two
    tasks, each batch still one stream's shape."""

    def __init__(self, *streams: Callable[[int], Batch]) -> None:
        if not streams:
            raise ValueError("AlternatingStream needs at least one stream")
        self.turns = itertools.cycle(streams)

    def __call__(self, batch_size: int) -> Batch:
        return next(self.turns)(batch_size)


@dataclass
class LoopSettings:
    steps: int | None  # stop after this many steps (None: only the time budget)
    minutes: float | None = None  # stop once this much wall time has passed
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.05  # cosine decay down to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.01
    log_every_s: float = 15.0
    checkpoint_every_s: float = 300.0
    max_tokens_per_pass: int = 2048  # a batch wider than this runs as several passes, its gradients summed

    def __post_init__(self) -> None:
        if self.steps is None and self.minutes is None:
            raise ValueError("LoopSettings needs steps or minutes (both are None)")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")


@dataclass
class LoopResult:
    steps: int
    initial_loss: float  # the first step's loss
    final_loss: float  # mean loss over the last steps
    seconds: float  # training time, over every run that resumed it
    tokens: int  # tokens processed (inputs, including the shared prefix once per row)
    resumed_at: int = 0  # the step a checkpoint resumed it from (0: trained from the start)


def _hidden_states(model, batch: Batch, device: torch.device) -> torch.Tensor:
    """Last hidden states [B, S, H] for batch.input_ids, after the shared prefix if any."""
    ids = batch.input_ids.to(device)
    if batch.prefix_ids is None or batch.prefix_ids.numel() == 0:
        return model.model(input_ids=ids).last_hidden_state
    # The prefix is identical for every row: run it once and share its KV cache (gradients flow
    # back through the repeat into the prefix computation).
    prefix_len = batch.prefix_ids.numel()
    out = model.model(input_ids=batch.prefix_ids[None].to(device), use_cache=True)
    kv = out.cache
    kv.batch_repeat_interleave(ids.shape[0])
    positions = torch.arange(prefix_len, prefix_len + ids.shape[1], device=device)[None].expand(ids.shape[0], -1)
    return model.model(input_ids=ids, cache=kv, position_ids=positions, use_cache=True).last_hidden_state


def _passes(batch: Batch, max_tokens: int) -> list[Batch]:
    """The batch as consecutive groups of rows of at most `max_tokens` input tokens each (one row at least)."""
    rows, width = batch.input_ids.shape
    per_pass = max(1, max_tokens // max(width, 1))
    if per_pass >= rows:
        return [batch]
    return [Batch(batch.input_ids[k:k + per_pass], batch.labels[k:k + per_pass], batch.prefix_ids)
            for k in range(0, rows, per_pass)]


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware. On a CPU without it (AVX2) torch emulates bf16, and a
    training step under bf16 autocast took minutes instead of seconds."""
    if device.type != "cpu":
        return True
    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_avx512_bf16_supported",
                                                                        "_is_amx_tile_supported"))


def _accumulate(model, batch: Batch, device: torch.device, max_tokens: int) -> torch.Tensor:
    """Backward the batch's mean next-token loss, in passes of at most `max_tokens` tokens (activations and
    the full-vocabulary logits of a long batch would not fit memory at once): each pass's summed loss over
    the whole batch's labelled positions. Returns the loss (a scalar)."""
    passes = _passes(batch, max_tokens)
    weight = model.get_output_embeddings().weight  # [V, H]
    total = int((batch.labels != -100).sum())
    loss = torch.zeros((), device=device)
    for part in passes:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=native_bf16(device)):
            hidden = _hidden_states(model, part, device)  # [b, S, H]
            labels = part.labels.to(device)
            mask = labels != -100  # [b, S]
            logits = (hidden[mask] @ weight.t()).float()  # [n, V]
            if len(passes) == 1:
                part_loss = F.cross_entropy(logits, labels[mask])
            else:
                part_loss = F.cross_entropy(logits, labels[mask], reduction="sum") / total
        part_loss.backward()
        loss = loss + part_loss.detach()
    return loss


def _lr_at(progress: float, settings: LoopSettings, step: int) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cos)


def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # a stop mid-write leaves the previous checkpoint whole


def train_loop(model, next_batch: Callable[[int], Batch], settings: LoopSettings, *, seed: int,
               checkpoint: Path | None = None) -> LoopResult:
    """Train `model` (a *ForCausalLM with tied or untied lm_head, on the device it is on) in place; return a
    summary. `checkpoint`: a file to resume from when it exists and to save to (module docstring)."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # frozen bases train nothing
    decay = [p for n, p in trained if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in trained if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.98),
    )
    budget_s = settings.minutes * 60 if settings.minutes is not None else math.inf
    model.train()
    recent: list[float] = []
    initial = float("nan")
    step = tokens = tokens_at_log = 0
    earlier_s = 0.0  # training time of the runs before a resume
    if checkpoint is not None and Path(checkpoint).exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        if state["seed"] != seed or state["batch_size"] != settings.batch_size:
            raise ValueError(f"checkpoint {checkpoint} is of another run (seed {state['seed']}, batch size "
                             f"{state['batch_size']}); delete it to start over")
        for (name, param), saved in zip(trained, state["parameters"]):
            param.data.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        step, tokens, earlier_s, initial, recent = (state["step"], state["tokens"], state["seconds"],
                                                    state["initial_loss"], list(state["recent"]))
        for _ in range(step):  # the stream where it was: the batches trained on, drawn again
            next_batch(settings.batch_size)
        logger.info("resumed from %s at step %d (%.0f s trained before)", checkpoint, step, earlier_s)
    resumed_at, tokens_at_log = step, tokens
    started = last_log = last_save = time.monotonic()

    def save() -> None:
        _save(Path(checkpoint), {
            "seed": seed, "batch_size": settings.batch_size, "step": step, "tokens": tokens,
            "seconds": earlier_s + time.monotonic() - started, "initial_loss": initial, "recent": recent,
            "parameters": [param.detach() for _, param in trained], "optimizer": opt.state_dict()})

    while True:
        elapsed = time.monotonic() - started
        if (settings.steps is not None and step >= settings.steps) or elapsed >= budget_s:
            break
        progress = step / settings.steps if settings.steps else elapsed / budget_s
        lr = _lr_at(progress, settings, step)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next_batch(settings.batch_size)
        opt.zero_grad(set_to_none=True)
        loss = _accumulate(model, batch, device, settings.max_tokens_per_pass)
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        step += 1
        prefix = 0 if batch.prefix_ids is None else batch.prefix_ids.numel()
        tokens += batch.input_ids.numel() + prefix * batch.input_ids.shape[0]
        recent = (recent + [loss.item()])[-20:]
        if step == 1:
            initial = recent[0]
        now = time.monotonic()
        if now - last_log >= settings.log_every_s or step == settings.steps:
            logger.info(
                "%s  step %d%s loss %.4f lr %.2e %.0f tok/s",
                # this run's share of what it has to do (the steps left when it started, or its time)
                progress_line(max((step - resumed_at) / (settings.steps - resumed_at) if settings.steps else 0.0,
                                  (now - started) / budget_s), now - started),
                step,
                f"/{settings.steps}" if settings.steps else "",
                sum(recent) / len(recent),
                lr,
                (tokens - tokens_at_log) / max(now - last_log, 1e-9),
            )
            last_log, tokens_at_log = now, tokens
        if checkpoint is not None and now - last_save >= settings.checkpoint_every_s:
            save()
            last_save = now
    if checkpoint is not None and step > resumed_at:
        save()
    model.eval()
    final = sum(recent) / len(recent) if recent else float("nan")
    seconds = earlier_s + time.monotonic() - started
    return LoopResult(steps=step, initial_loss=initial, final_loss=final, seconds=seconds, tokens=tokens,
                      resumed_at=resumed_at)
