"""Helpers the step benchmarks (benchmarks/*.py) share: timing a shared base's members' decode step, and
printing and writing a benchmark's figures."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

from fusion.compute import run_on_compute_thread
from fusion.experts.expert import StepRequest


def members_step_ms(members: Sequence, which: Sequence[int], session: str, steps: int, history_len: int = 60,
                    warm_steps: int = 4, sessions: int = 1, on_start: Callable[[], None] | None = None,
                    before_each: Callable[[], None] | None = None) -> float:
    """Milliseconds per decode step of `members[m]` for m in `which` (adapter members of one shared base),
    `sessions` sessions each (named `session` + m, then "-s" past the first), stepped together (greedy)
    from `history_len`-id histories; the sessions are released afterwards. On the compute thread, as the
    engine steps them: elsewhere a step runs on one thread (`fusion.compute.single_team`). `on_start` is
    called after the warm steps, just before the timed ones (to clear a benchmark's own counters);
    `before_each` before each timed step, untimed (to set up what the step meets)."""
    return run_on_compute_thread(_members_step_ms, members, which, session, steps, history_len, warm_steps,
                                 sessions, on_start, before_each)


def _members_step_ms(members: Sequence, which: Sequence[int], session: str, steps: int, history_len: int,
                     warm_steps: int, sessions: int, on_start: Callable[[], None] | None,
                     before_each: Callable[[], None] | None) -> float:
    group = members[0].shared_base
    names = {(m, s): f"{session}{m}" + (f"-{s}" if s else "") for m in which for s in range(sessions)}
    history = {key: [100 + (7 * k + key[1]) % 900 for k in range(history_len)] for key in names}

    def step() -> None:
        out = group.step_members([(members[m], [StepRequest(names[m, s], history[m, s]) for s in range(sessions)])
                                  for m in which])
        for m, logits in zip(which, out):
            for s in range(sessions):
                history[m, s].append(int(logits[s].argmax()))

    for _ in range(warm_steps):
        step()
    if on_start is not None:
        on_start()
    elapsed = 0.0
    for _ in range(steps):
        if before_each is not None:
            before_each()
        started = time.perf_counter()
        step()
        elapsed += time.perf_counter() - started
    elapsed = elapsed / steps * 1e3
    for m in which:
        members[m].release([names[m, s] for s in range(sessions)])
    return elapsed


Timings = dict[str, list[float]]  # part -> ms of each timed call


def wrap(owner: object, name: str, label: str, timings: Timings) -> Callable[[], None]:
    """Time every call of `owner.name` into `timings[label]` (ms); returns the undo."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            timings[label].append((time.perf_counter() - start) * 1e3)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, inner)


def emit_figures(figures: dict, json_path: Path | None) -> None:
    """Print `figures` as JSON, and write them to `json_path` if given."""
    text = json.dumps(figures, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text + "\n")
