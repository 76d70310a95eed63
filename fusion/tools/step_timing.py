"""Helpers the step benchmarks (benchmarks/*.py) share: timing a shared base's members' decode step, and
printing and writing a benchmark's figures."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from fusion.compute import run_on_compute_thread
from fusion.expert import StepRequest


def members_step_ms(members: Sequence, which: Sequence[int], session: str, steps: int, history_len: int = 60,
                    warm_steps: int = 4) -> float:
    """Milliseconds per decode step of `members[m]` for m in `which` (adapter members of one shared base),
    one session each named `session` + m, stepped together (greedy) from a `history_len`-id history;
    the sessions are released afterwards. On the compute thread, as the engine steps them: elsewhere a
    step runs on one thread (`fusion.compute.single_team`)."""
    return run_on_compute_thread(_members_step_ms, members, which, session, steps, history_len, warm_steps)


def _members_step_ms(members: Sequence, which: Sequence[int], session: str, steps: int, history_len: int,
                     warm_steps: int) -> float:
    group = members[0].shared_base
    history = {m: [100 + (7 * k) % 900 for k in range(history_len)] for m in which}

    def step() -> None:
        out = group.step_members([(members[m], [StepRequest(f"{session}{m}", history[m])]) for m in which])
        for m, logits in zip(which, out):
            history[m].append(int(logits[0].argmax()))

    for _ in range(warm_steps):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - started) / steps * 1e3
    for m in which:
        members[m].release([f"{session}{m}"])
    return elapsed


def emit_figures(figures: dict, json_path: Path | None) -> None:
    """Print `figures` as JSON, and write them to `json_path` if given."""
    text = json.dumps(figures, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text + "\n")
