"""The static-shape decode step over KV slots (fusion/forward/static_step.py), run eagerly on the CPU at the
shapes its CUDA graphs are captured at: held to transformers' uncached forward, to the eager fast step, and,
through the whole service, to transformers' own decode; slots claimed, evicted and outgrown. Capture and
replay themselves are the `cuda` tests at the end (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import threading

import pytest
import torch

from fusion.config import parse_config
from fusion.errors import ConfigError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward import static_step
from fusion.forward.kv_cache import GrowingLayer
from fusion.forward.static_step import StaticStep, buckets_for, widths_for
from tests.test_fast_decode import _greedy_tokens, _plain_last_logits


def _static_expert(path, device: str = "cpu", **fields) -> LocalExpert:
    expert = {"name": "x", "model": str(path), "dtype": "float32", "device": device, "decode": "static",
              "kv_slot_tokens": 48, "kv_slots": 4, **fields}
    return LocalExpert.load(parse_config({"experts": [expert]}).experts[0])


@pytest.fixture
def narrow_widths(monkeypatch):
    """Graph widths from 8 columns, so that short test histories cross several (8, 16, 32, 48)."""
    monkeypatch.setattr(static_step, "MIN_WIDTH", 8)


def test_buckets_and_widths_cover_every_shape_once():
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(6) == [1, 2, 4, 6]
    assert buckets_for(1) == [1]
    assert widths_for(4096, 256) == [256, 512, 1024, 2048, 4096]
    assert widths_for(48, 8) == [8, 16, 32, 48]
    assert widths_for(100, 256) == [100]


def test_a_step_pads_rows_to_a_bucket_and_reads_a_width_past_the_longest_history(tiny_dir, narrow_widths):
    step: StaticStep = _static_expert(tiny_dir / "a", kv_slots=8)._static
    assert step.max_batch == 7 and step.buckets == [1, 2, 4, 7]
    assert step.shape_for(1, 0) == (1, 8)
    assert step.shape_for(3, 8) == (4, 16)  # columns 0..7 read, column 8 written: the next width
    assert step.shape_for(5, 47) == (7, 48)
    with pytest.raises(ValueError, match="no column for the new id"):
        step.shape_for(1, 48)
    with pytest.raises(ValueError, match="1 to 7 rows"):
        step.shape_for(8, 3)


@pytest.mark.parametrize("model_name", ["llama", "qwen2", "qwen3", "llama3-rope", "mistral"])
def test_static_steps_equal_plain_forwards_across_buckets_widths_and_slots(
        model_name, tiny_dir, qwen_dir, qwen3_dir, llama3_rope_dir, mistral_dir, narrow_widths):
    """Sessions of different lengths step together and alone, through width changes, with more sessions
    than slots (the least recently stepped one is copied out, and back in when it steps again), and one that
    outgrows its slot (it steps eagerly after): every step's logits equal an uncached forward's."""
    path = {"llama": tiny_dir / "a", "qwen2": qwen_dir, "qwen3": qwen3_dir, "llama3-rope": llama3_rope_dir,
            "mistral": mistral_dir}[model_name]
    expert = _static_expert(path)  # 3 slots for sessions (one is scratch), 48 columns each
    step = expert._static
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 44)), "s3": [8, 9], "s4": [11, 12, 13, 14, 15]}
    schedule = [["s1", "s2", "s3"]] * 4 + [["s4", "s1"]] * 3 + [["s3"]] * 2 + [["s2", "s3", "s4"]] * 3 + [["s1"]]
    for names in schedule:
        got = expert.step([StepRequest(s, histories[s]) for s in names])
        want = _plain_last_logits(expert.model, [histories[s] for s in names])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]
    assert {bucket for bucket, _ in step.shapes} == {1, 2, 3} and {width for _, width in step.shapes} == {8, 16, 32}
    assert sum(step.shapes.values()) == len(schedule) - 1  # (the first step of each session is its prompt)
    claimed = [step.slots.slot_of(expert.cache.peek(s).kv) for s in ("s1", "s2", "s3", "s4")]
    assert sorted(c for c in claimed if c is not None) == sorted(set(c for c in claimed if c is not None))
    assert claimed.count(None) >= 1  # four sessions, three slots: one was moved out
    # A history past the slot's columns steps eagerly, with the same logits.
    long = list(range(3, 3 + 47))
    for _ in range(3):
        got = expert.step([StepRequest("long", long)])
        torch.testing.assert_close(got, _plain_last_logits(expert.model, [long]), rtol=1e-4, atol=1e-4)
        long = long + [int(got[0, :250].argmax())]
    assert step.slots.slot_of(expert.cache.peek("long").kv) is None


def test_a_claimed_cache_is_a_view_of_its_slot_and_prompt_chunks_land_there(tiny_dir, narrow_widths):
    """A decoding session's layers view its slot's row; transformers' forward of a later chunk writes into
    the slot in place, and the next step reads it there."""
    expert = _static_expert(tiny_dir / "a")
    history = [5, 17, 42, 7]
    expert.step([StepRequest("s", history)])
    history = history + [9]
    expert.step([StepRequest("s", history)])  # steady decoding: claims a slot
    kv = expert.cache.peek("s").kv
    slot = expert._static.slots.slot_of(kv)
    assert slot is not None and slot != static_step.SCRATCH
    layer = kv.layers[0]
    assert type(layer) is GrowingLayer and layer.keys.data_ptr() == expert._static.slots.keys[0][slot].data_ptr()
    history = history + [3, 4, 5, 6]  # a chunk of new ids: transformers' forward appends in place
    got = expert.step([StepRequest("s", history)])
    assert expert._static.slots.slot_of(kv) == slot
    torch.testing.assert_close(got, _plain_last_logits(expert.model, [history]), rtol=1e-4, atol=1e-4)
    history = history + [8]
    got = expert.step([StepRequest("s", history)])
    torch.testing.assert_close(got, _plain_last_logits(expert.model, [history]), rtol=1e-4, atol=1e-4)
    expert.release(["s"])
    assert expert._static.slots.slot_of(kv) is None or expert.cache.peek("s") is None


def test_the_static_step_generates_the_tokens_of_transformers_decode(tiny_dir):
    prompts = [[5, 17, 42, 7], list(range(40, 70)), [9]]
    assert _greedy_tokens(tiny_dir, "static", prompts) == _greedy_tokens(tiny_dir, "transformers", prompts)


def test_the_retired_compiled_decode_names_its_replacement():
    with pytest.raises(ConfigError, match="decode: compiled was retired: decode: fast captures CUDA graphs"):
        parse_config({"experts": [{"name": "x", "model": "m", "decode": "compiled"}]})


def test_fast_on_a_cpu_keeps_the_eager_step_and_static_is_refused_where_no_step_runs(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fast = LocalExpert.load(parse_config({"experts": [{"name": "x", "model": str(tiny_dir / "a"),
                                                       "dtype": "float32"}]}).experts[0])
    assert fast._fast_step is not None and fast._static is None
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.save_pretrained(tmp_path / "dynamic")
    AutoTokenizer.from_pretrained(tiny_dir / "tok").save_pretrained(tmp_path / "dynamic")
    with pytest.raises(ValueError, match="decode: static is not available for this model: rope type 'dynamic'"):
        _static_expert(tmp_path / "dynamic")


def test_slots_sized_from_a_memory_fraction_capped_by_free_memory(tiny_dir, monkeypatch):
    decoder = _static_expert(tiny_dir / "a")._fast_step.decoder
    config = decoder.embed  # (the tiny model: 2 layers, float32)
    per_slot = static_step.bytes_per_slot(decoder, 48)
    assert per_slot == 2 * 2 * decoder.num_kv_heads * 48 * decoder.head_dim * config.element_size()
    total, free = 1000 * per_slot, 400 * per_slot
    monkeypatch.setattr(static_step, "device_memory", lambda device: (free, total))
    assert static_step.slots_that_fit(decoder, 48, 0.0105) == 10
    assert static_step.slots_that_fit(decoder, 48, 0.9) == 360  # 90% of the free memory, not 90% of all
    assert static_step.slots_that_fit(decoder, 48, 0.0001) == 2  # scratch and one session at least
    monkeypatch.setattr(static_step, "device_memory", lambda device: (10**15, 10**15))
    assert static_step.slots_that_fit(decoder, 48, 1.0) == static_step.MAX_SLOTS


# -- on a CUDA device (benchmarks/gpu_check.sh; deselected elsewhere: the tests above run the same step eagerly)
@pytest.mark.cuda
@pytest.mark.parametrize("model_name", ["llama", "qwen3"])
def test_captured_graphs_replay_the_eager_steps_logits(model_name, tiny_dir, qwen3_dir, narrow_widths):
    """decode: fast on CUDA captures a graph per (bucket, width) at load; its replays give the logits of an
    uncached forward, batched and alone, across widths and slot evictions."""
    path = tiny_dir / "a" if model_name == "llama" else qwen3_dir
    expert = LocalExpert.load(parse_config({"experts": [{
        "name": "x", "model": str(path), "dtype": "float32", "device": "cuda", "decode": "fast",
        "kv_slot_tokens": 48, "kv_slots": 4}]}).experts[0])
    step = expert._static
    assert step.captured == len(step.buckets) * len(step.widths)
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 44)), "s3": [8, 9], "s4": [11, 12, 13]}
    for names in [["s1", "s2", "s3"]] * 4 + [["s4", "s1"]] * 3 + [["s2", "s3", "s4"]] * 3:
        got = expert.step([StepRequest(s, histories[s]) for s in names])
        want = _plain_last_logits(expert.model, [histories[s] for s in names]).to(got.device)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]
    assert step.replays >= 8


@pytest.mark.cuda
def test_graphs_replay_from_any_thread(tiny_dir, narrow_widths):
    """Graphs captured on the loading thread replay from other threads, on each one's own stream."""
    expert = LocalExpert.load(parse_config({"experts": [{
        "name": "x", "model": str(tiny_dir / "a"), "dtype": "float32", "device": "cuda", "decode": "fast",
        "kv_slot_tokens": 48, "kv_slots": 8}]}).experts[0])
    histories = {f"t{k}": [5 + k, 17, 42] for k in range(4)}
    errors: list[BaseException] = []

    def decode(name: str) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(6):
                    got = expert.step([StepRequest(name, histories[name])])
                    want = _plain_last_logits(expert.model, [histories[name]]).to(got.device)
                    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
                    histories[name] = histories[name] + [int(got[0, :250].argmax())]
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=decode, args=(name,)) for name in histories]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert expert._static.replays >= 20
