"""Code measured by running it (tools/executed_code.py): the sandbox passes right programs and fails
wrong, hung, networked or escaping ones; HumanEval's canonical solutions pass its tests and wrong bodies
fail them; completions come from a real service's rows."""

from __future__ import annotations

import socket

import pytest

from fusion.frontdoor.service import FusionRequest
from fusion.tools.executed_code import (EMPTY_BODY, STOP, asked_stops, complete_humaneval, cut_at_stop,
                                        humaneval_messages, humaneval_problems, humaneval_program, pass_at_1,
                                        run_sandboxed)


def test_a_right_program_passes_and_a_wrong_one_fails_with_its_error():
    assert run_sandboxed("assert sum([1, 2]) == 3\n").passed
    failed = run_sandboxed("def f():\n    return 2\nassert f() == 3, 'f is wrong'\n")
    assert not failed.passed and "AssertionError: f is wrong" in failed.reason


def test_a_hung_program_is_killed_at_its_limit():
    outcome = run_sandboxed("while True:\n    pass\n", timeout_s=1.0)
    assert not outcome.passed and outcome.reason in ("timed out", "exit status -9", "exit status -24")


def test_the_sandbox_has_no_network_no_environment_and_a_folder_of_its_own(tmp_path, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        reached = run_sandboxed(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n")
    assert not reached.passed and "network access is disabled" in reached.reason
    monkeypatch.setenv("FUSION_SECRET_FOR_TEST", "x")
    assert run_sandboxed("import os\nassert 'FUSION_SECRET_FOR_TEST' not in os.environ\n").passed
    monkeypatch.chdir(tmp_path)
    assert run_sandboxed("open('left-behind.txt', 'w').write('x')\n").passed
    assert not (tmp_path / "left-behind.txt").exists()  # it wrote in its own folder, removed after


def test_humaneval_canonical_solutions_pass_and_wrong_bodies_fail():
    problems = humaneval_problems(5)
    assert len(problems) == 5 and len(humaneval_problems()) == 164
    rate, outcomes = pass_at_1(problems, [p["canonical_solution"] for p in problems])
    assert rate == 1.0, [o.reason for o in outcomes]
    rate, outcomes = pass_at_1(problems, ["    return None\n"] * 5)
    assert rate == 0.0 and all(not o.passed for o in outcomes)
    assert EMPTY_BODY not in {o.reason for o in outcomes}  # a body that runs and is wrong
    # a blank body is named as such, not counted among wrong code
    rate, outcomes = pass_at_1(problems[:2], ["", "  \n"])
    assert rate == 0.0 and [o.reason for o in outcomes] == [EMPTY_BODY, EMPTY_BODY]


@pytest.mark.parametrize("style", ["plain", "chat"])
def test_completions_are_the_fused_continuation_of_the_prompt_cut_at_a_new_statement(tiny_service, style):
    """Plain: the prompt continued as is; chat: the answer opened with the code block and the prompt, in the
    chat turn. Either way healed (the prompt's last token, its newline, written again by the answer) and
    the fused continuation without stops, cut where the first stop begins."""
    problems = sorted(humaneval_problems(), key=lambda p: len(p["prompt"]))[:2]  # in the tiny models' context
    completions = complete_humaneval(tiny_service, None, problems, max_tokens=12, style=style, batch_size=1)
    assert complete_humaneval(tiny_service, None, problems, max_tokens=12, style=style) == completions  # batched
    stops = STOP + (["\n```"] if style == "chat" else [])
    assert asked_stops(style) == stops
    for problem, completion in zip(problems, completions):
        if style == "plain":
            request = FusionRequest(problem["prompt"], {"max_tokens": 12, "temperature": 0.0, "token_healing": True},
                                    plain=True)
        else:
            opened = [{"role": "user", "content": f"Complete the following Python function.\n```python\n"
                                                  f"{problem['prompt']}```"},
                      {"role": "assistant", "content": f"```python\n{problem['prompt']}"}]
            request = FusionRequest(opened, {"max_tokens": 12, "temperature": 0.0, "token_healing": True},
                                    continue_final_message=True)
        whole = "".join(event.text for event in tiny_service.submit(request))
        joined = "\n" + whole  # every HumanEval prompt ends with a newline: a stop may begin there
        assert problem["prompt"].endswith("\n")
        cut = min([joined.find(stop) for stop in stops if stop in joined] or [len(joined)])
        assert completion == whole[:max(cut - 1, 0)]
        assert humaneval_program(problem, completion).startswith(problem["prompt"] + completion)
    rate, outcomes = pass_at_1(problems, completions)
    assert 0.0 <= rate <= 1.0 and len(outcomes) == 2


def test_completions_take_the_sampling_asked(tiny_service):
    """A repetition guard over greedy reaches every request (the service's own penalty path decides)."""
    problems = sorted(humaneval_problems(), key=lambda p: len(p["prompt"]))[:2]
    guard = {"repetition_penalty": 5.0, "frequency_penalty": 2.0}
    guarded = complete_humaneval(tiny_service, None, problems, max_tokens=12, sampling=guard, style="plain")
    for problem, completion in zip(problems, guarded):
        asked = {"max_tokens": 12, "temperature": 0.0, "stop": asked_stops("plain"), "token_healing": True, **guard}
        whole = "".join(e.text for e in tiny_service.submit(FusionRequest(problem["prompt"], asked, plain=True)))
        assert completion == cut_at_stop(problem["prompt"], whole, asked_stops("plain"))
    assert guarded != complete_humaneval(tiny_service, None, problems, max_tokens=12, style="plain")


@pytest.mark.parametrize("problem", humaneval_problems(1))
def test_a_problem_program_runs_its_check_on_the_entry_point(problem):
    program = humaneval_program(problem, problem["canonical_solution"])
    assert program.rstrip().endswith(f"check({problem['entry_point']})")


@pytest.mark.parametrize(("completion", "expected"), [
    ("```\n\nThis function uses a list comprehension.", ""),  # closes the block at once: met "\n```"
    ("    return x\n```\nIt returns x.", "    return x"),
    ("def other():\n    pass", ""),  # a new function at once: met "\ndef "
    ("    return [y for y in x]\n", "    return [y for y in x]\n"),
])
def test_a_stop_is_matched_across_the_prompts_last_newline(completion, expected):
    assert cut_at_stop("def f(x):\n", completion, asked_stops("chat")) == expected
    assert cut_at_stop("", completion, asked_stops("chat")) == (completion if completion.startswith(("```", "def"))
                                                               else expected)
