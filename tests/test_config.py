"""Configuration: YAML and pydantic errors naming the field, weights, and the one merge rule."""

from __future__ import annotations

import pytest

from fusion.config import FusionSpec, SpecOverrides, layer_spec, load_config, parse_config
from fusion.errors import ConfigError, InvalidArgumentError


def test_config_errors_name_field_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"experts\.0\.dtype.*'float64'"):
        parse_config({"experts": [{"name": "a", "model": "m", "dtype": "float64"}]})
    with pytest.raises(ConfigError, match=r"sampling\.top_p.*1\.5"):
        parse_config({"experts": [{"name": "a", "model": "m"}], "sampling": {"top_p": 1.5}})
    with pytest.raises(ConfigError, match="duplicate expert names"):
        parse_config({"experts": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]})
    with pytest.raises(ConfigError, match="unknown profile 'p'"):
        parse_config({"experts": [{"name": "a", "model": "m"}], "fusion": {"profile": "p"}})
    with pytest.raises(ConfigError, match="profile 'x' names unknown experts"):
        parse_config({"experts": [{"name": "a", "model": "m"}], "profiles": {"x": {"zz": 1}}})
    with pytest.raises(ConfigError, match=r"experts\.0\.colour.*Extra inputs"):
        parse_config({"experts": [{"name": "a", "model": "m", "colour": "red"}]})


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("experts: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_weights_from_profile_request_and_defaults():
    config = parse_config({
        "experts": [{"name": "a", "model": "m", "weight": 2}, {"name": "b", "model": "n"}],
        "profiles": {"math": {"b": 3}},
    })
    assert config.weights_for(FusionSpec()) == [2.0, 1.0]
    assert config.weights_for(FusionSpec(profile="math")) == [0.0, 3.0]
    assert config.weights_for(FusionSpec(weights={"a": 0.5})) == [0.5, 0.0]


def test_one_merge_rule_layers_a_request_over_the_config():
    default = FusionSpec(rule="confidence", params={"tau": 0.7}, profile="math")
    assert layer_spec(default, None) == default
    assert layer_spec(default, SpecOverrides()) == default
    # The config's own rule: its params stay unless overridden, one by one.
    assert layer_spec(default, SpecOverrides(params={"combine": "mixture"})).params == {"tau": 0.7, "combine": "mixture"}
    assert layer_spec(default, SpecOverrides(rule="confidence", params={"tau": 0.2})).params == {"tau": 0.2}
    # Another rule starts from its own params alone.
    assert layer_spec(default, SpecOverrides(rule="mixture")) == FusionSpec(rule="mixture", profile="math")
    # Weights or a profile replace the config's weight source; neither keeps it.
    assert layer_spec(default, SpecOverrides(weights={"a": 1.0})).weights == {"a": 1.0}
    assert layer_spec(default, SpecOverrides(weights={"a": 1.0})).profile is None
    assert layer_spec(default, SpecOverrides(profile="code")).profile == "code"
    # A whole spec is layered the same way (all its fields set).
    whole = FusionSpec(rule="confidence", params={"combine": "mixture"}, weights={"a": 1.0})
    assert layer_spec(default, whole) == FusionSpec(rule="confidence", params={"tau": 0.7, "combine": "mixture"},
                                                    weights={"a": 1.0})
    with pytest.raises(InvalidArgumentError, match="spec: .*weights or profile"):
        layer_spec(default, SpecOverrides(weights={"a": 1.0}, profile="code"))


def test_remote_deadlines_failover_and_expert_limits():
    config = parse_config({"experts": [{"name": "a", "model": "m"}]})
    expert = config.expert("a")
    assert (expert.step_timeout_s, expert.prefill_timeout_s) == (10.0, 60.0)  # decode short, prompt work long
    assert expert.failures_before_down == 3 and expert.health_check_timeout_s == 2.0
    limits = config.limits
    assert limits.max_sessions_per_step >= limits.max_concurrent_sessions  # a coordinator's whole batch fits
    assert limits.max_queued_steps >= limits.max_sessions_per_step and limits.max_concurrent_rpcs > 0
    for field, value in [("prefill_timeout_s", 0), ("failures_before_down", 0), ("health_check_timeout_s", -1)]:
        with pytest.raises(ConfigError, match=rf"experts\.0\.{field}"):
            parse_config({"experts": [{"name": "a", "model": "m", field: value}]})
    for field in ("max_concurrent_rpcs", "max_queued_steps", "max_sessions_per_step"):
        with pytest.raises(ConfigError, match=rf"limits\.{field}"):
            parse_config({"experts": [{"name": "a", "model": "m"}], "limits": {field: 0}})


def test_a_retired_key_is_refused_with_why_and_a_retired_decode_with_what_remains():
    with pytest.raises(ConfigError, match=r"^config: fusion_step: retired: .* remove the key$"):
        parse_config({"experts": [{"name": "a", "model": "m"}], "fusion_step": "compiled"})
    with pytest.raises(ConfigError, match=r"experts.0.decode: Input should be 'transformers', 'fast' or 'static'"):
        parse_config({"experts": [{"name": "a", "model": "m", "decode": "regional"}]})


def test_the_shipped_configs_parse_and_the_gpu_one_is_the_default_trio_on_cuda():
    """Every config in fusion/configs parses; the GPU one has the default trio's experts, rule and profiles,
    on CUDA with its decode step and dense weights (the 4-bit codes are a CPU format)."""
    import yaml

    from fusion.models import ADAPTERS_DIR

    folder = ADAPTERS_DIR.parent / "configs"
    configs = {path.name: parse_config(yaml.safe_load(path.read_text())) for path in folder.glob("*.yaml")}
    assert {"default.yaml", "default-gpu.yaml", "cross-family.yaml"} <= set(configs)
    cpu, gpu = configs["default.yaml"], configs["default-gpu.yaml"]
    assert [(e.name, e.model, e.adapter) for e in gpu.experts] == [(e.name, e.model, e.adapter) for e in cpu.experts]
    assert gpu.fusion == cpu.fusion and gpu.profiles == cpu.profiles
    assert all(e.device == "cuda" and e.decode == "fast" and e.weights == "dense" for e in gpu.experts)
    assert all(e.weights == "int4" and e.device == "cpu" for e in cpu.experts)


def test_quantized_weights_are_refused_off_a_cpu():
    with pytest.raises(ConfigError, match="weights: int4 runs on a CPU .* on cuda use weights: dense"):
        parse_config({"experts": [{"name": "a", "model": "m", "weights": "int4", "device": "cuda"}]})
