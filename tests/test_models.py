"""The model cache (`fusion.models`): refs to folders, never preparing; staging; the default place."""

from pathlib import Path

import pytest

from fusion.errors import AssetError
from fusion.models import BUILTIN_MODELS, default_cache_dir, resolve_model, staged_dir
from fusion.tools import assets


def test_unknown_builtin_lists_known_names(tmp_path):
    with pytest.raises(AssetError) as err:
        resolve_model("builtin:gpt-9", tmp_path)
    assert "'gpt-9'" in str(err.value)
    for name in BUILTIN_MODELS:
        assert name in str(err.value)


@pytest.mark.parametrize("ref", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/models/qwen", "./local", "builtin"])
def test_other_refs_are_returned_unchanged(tmp_path, ref):
    assert resolve_model(ref, tmp_path) == ref


def test_resolving_never_prepares_a_missing_builtin(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "pip_download", lambda *a: pytest.fail("must not download"))
    with pytest.raises(AssetError, match=r"unknown builtin model 'arith-specialist'"):
        resolve_model("builtin:arith-specialist", tmp_path)
    with pytest.raises(AssetError, match="run `fusion models fetch`"):
        resolve_model("builtin:smollm2-135m-instruct", tmp_path)
    assert not (tmp_path / "models").exists()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "fusion"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "fusion"


def test_staged_dir_is_all_or_nothing(tmp_path):
    target = tmp_path / "m"
    with pytest.raises(RuntimeError):
        with staged_dir(target) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with staged_dir(target) as tmp:
        (tmp / "done").write_text("x")
    assert (target / "done").read_text() == "x"
    with staged_dir(target, replace=True) as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
