"""`fusion/experts/shared_base.py` and `fusion/experts/multi_lora.py`: experts that are adapters over one base run their
rows in one batch, each row with its own adapter, and give the logits of each adapter merged into its
own copy of the base (the reference), on every path: batched prefill, batched fast decode, one session
alone, transformers' decode, Score, lookahead extensions, and a whole fused generation."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from fusion.config import SamplingParams, parse_config
from fusion.engine.core import FusionEngine
from fusion.engine.types import GenerationRequest
from fusion.errors import AssetError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.experts.multi_lora import AdapterRows, AdapterStack, LoraPair
from fusion.fuse.registry import make_rule
from fusion.experts.shared_base import AdapterMember, load_local_experts
from tests.conftest import tiny_config_dict

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(tiny_dir, out, seed: int, targets=ALL_LINEAR, rank: int = 4, **extra):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    get_peft_model(base, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return (save_adapter(tiny_dir, root / "one", seed=11),
            save_adapter(tiny_dir, root / "two", seed=12, targets=["q_proj", "v_proj", "down_proj"], rank=2))


def trio_configs(tiny_dir, adapters, decode: str = "fast", share: bool = True):
    data = tiny_config_dict(tiny_dir, names=("a",))
    base = data["experts"][0]
    data["experts"] = [
        {**base, "name": "plain", "decode": decode, "share_base": share},
        {**base, "name": "one", "adapter": str(adapters[0]), "decode": decode, "share_base": share},
        {**base, "name": "two", "adapter": str(adapters[1]), "decode": decode, "share_base": share},
    ]
    return parse_config(data).experts


@pytest.fixture(scope="module")
def shared(tiny_dir, adapters):
    return load_local_experts(trio_configs(tiny_dir, adapters), str)


@pytest.fixture(scope="module")
def merged(tiny_dir, adapters):
    return load_local_experts(trio_configs(tiny_dir, adapters, share=False), str)


def test_members_share_one_base_and_merged_experts_do_not(shared, merged):
    assert all(isinstance(e, AdapterMember) for e in shared)
    assert len({id(e.shared_base) for e in shared}) == 1
    assert len({id(p) for e in shared for p in [e.model.model.embed_tokens.weight]}) == 1
    assert all(isinstance(e, LocalExpert) for e in merged)
    assert [e.info.name for e in shared] == ["plain", "one", "two"]


def histories(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (int(k),), generator=gen).tolist() for k in torch.randint(3, 9, (n,), generator=gen)]


def test_a_joint_step_equals_each_merged_expert(shared, merged):
    """Prefill of six sessions (two per member) in one batch, then four batched decode steps (the fast
    step over the group's cohort), then one session alone: each row equals its merged expert's."""
    _joint_steps_equal_merged(shared, merged)


def test_the_static_step_runs_every_members_rows_in_one_step_with_its_adapter(tiny_dir, adapters, merged):
    """decode: static (what decode: fast is on CUDA): the members' decoding rows step together in their KV
    slots, each row through its own adapter (the base's rows through none), equal to each merged expert."""
    configs = [c.model_copy(update={"kv_slots": 16, "kv_slot_tokens": 256})
               for c in trio_configs(tiny_dir, adapters, decode="static")]
    static = load_local_experts(configs, str)
    group = static[0].shared_base
    assert group._static is not None and group._static.decoder.adapters is group.multi
    _joint_steps_equal_merged(static, merged)
    assert max(bucket for bucket, _ in group._static.shapes) >= 6  # six sessions, three members, one step


def _joint_steps_equal_merged(shared, merged):
    group = shared[0].shared_base
    prompts = histories(6, seed=1)
    sessions = [f"s{k}" for k in range(6)]
    owner = [0, 1, 2, 0, 1, 2]
    fast_before = group.fast_decode_steps
    for step in range(5):
        parts = [(shared[m], [StepRequest(sessions[k], prompts[k]) for k in range(6) if owner[k] == m]) for m in range(3)]
        got = group.step_members(parts)
        for m, (_, requests) in enumerate(parts):
            want = merged[m].step(requests)
            assert torch.allclose(got[m], want, atol=1e-4), (step, m)
        for k in range(6):
            prompts[k] = prompts[k] + [(7 * step + k) % 50 + 3]
    assert group.fast_decode_steps > fast_before  # the joint decode steps took the fast step
    alone = shared[1].step([StepRequest("s1", prompts[1])])
    assert torch.allclose(alone, merged[1].step([StepRequest("s1", prompts[1])]), atol=1e-4)
    for m in range(3):
        shared[m].release(sessions)
        merged[m].release(sessions)
    assert all(e.active_sessions == 0 for e in shared)


def test_base_rows_alone_skip_the_adapters_and_equal_the_plain_base(shared, merged, monkeypatch):
    # a step whose rows run no adapter (the base member alone) computes no adapter product: its deltas
    # would be zero; the logits stay exactly the plain base's, on the fast step and in prefill
    from fusion.experts.multi_lora import AdapterStack

    products = []
    original = AdapterStack.forward
    monkeypatch.setattr(AdapterStack, "forward", lambda self, x, rows: products.append(1) or original(self, x, rows))
    group = shared[0].shared_base
    history = histories(1, seed=7)[0]
    fast_before = group.fast_decode_steps
    for token in (5, 9, 13):
        history = history + [token]
        got = group.step_members([(shared[0], [StepRequest("base-only", history)])])[0]
        assert torch.allclose(got, merged[0].step([StepRequest("base-only", history)]), atol=1e-4)
    assert group.fast_decode_steps > fast_before and products == []
    # a row with an adapter in the step: the products run again
    group.step_members([(shared[0], [StepRequest("base-only", history + [4])]),
                        (shared[1], [StepRequest("adapted", history)])])
    assert products
    shared[0].release(["base-only"])
    shared[1].release(["adapted"])
    merged[0].release(["base-only"])


def test_score_and_extensions_match_the_merged_expert(shared, merged):
    ids = [5, 17, 42, 9, 3, 11, 8]
    for m in range(3):
        assert torch.allclose(shared[m].score("q", ids, 4), merged[m].score("q", ids, 4), atol=1e-4)
        got = shared[m].extend("x", ids, [[4], [9], [4, 7], []])
        want = merged[m].extend("x", ids, [[4], [9], [4, 7], []])
        assert torch.allclose(got, want, atol=1e-4)
        shared[m].release(["q", "x"])
        merged[m].release(["q", "x"])


def test_transformers_decode_path_matches_too(tiny_dir, adapters, merged):
    plain_forward = load_local_experts(trio_configs(tiny_dir, adapters, decode="transformers"), str)
    assert plain_forward[0].shared_base._fast_step is None
    prompts = histories(3, seed=5)
    for _ in range(3):
        parts = [(plain_forward[m], [StepRequest("t", prompts[m])]) for m in range(3)]
        got = plain_forward[0].shared_base.step_members(parts)
        for m in range(3):
            assert torch.allclose(got[m], merged[m].step([StepRequest("t", prompts[m])]), atol=1e-4)
            prompts[m] = prompts[m] + [9]
    for m in range(3):
        merged[m].release(["t"])


def test_a_fused_generation_is_the_same_as_with_merged_experts(shared, merged):
    """The engine steps the members jointly (one call per step) and decodes the same tokens."""
    group = shared[0].shared_base
    calls = []
    original = group.step_members
    group.step_members = lambda parts: calls.append(len(parts)) or original(parts)
    try:
        outputs = []
        for experts in (shared, merged):
            engine = FusionEngine(experts)
            rule = make_rule("weighted_logits", {}, ["plain", "one", "two"])
            request = GenerationRequest([[5, 17, 42]] * 3, SamplingParams(max_tokens=8, ignore_eos=True), rule,
                                        [1.0, 0.7, 0.4])
            outputs.append([e.token_id for e in engine.generate(request)])
            engine.close()
    finally:
        group.step_members = original
    assert outputs[0] == outputs[1]
    assert calls and all(n == 3 for n in calls)  # every step: the three members in one call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_delta_is_the_row_owners_lora(dtype):
    """Alone, and as two stacks of one layout sharing their rows' own-columns (computed once per rows)."""
    torch.manual_seed(0)
    pairs = [LoraPair(torch.randn(2, 5), torch.randn(3, 2), 0.5), LoraPair(torch.randn(4, 5), torch.randn(3, 4), 2.0)]
    shared_rows = AdapterRows(torch.device("cpu"))
    alone = AdapterStack.of([[pairs[0]], [pairs[1]]], [3], 5, "cpu")
    twins = [AdapterStack.of([[pairs[0]], [pairs[1]]], [3], 5, "cpu", shared_rows) for _ in range(2)]
    assert twins[0].owner is twins[1].owner
    x = torch.randn(4, 5).to(dtype)
    shared_rows.set([1, -1, 0, 1])
    rows = shared_rows.rows
    for stack in (alone, *twins, twins[0]):
        got = stack(x, rows)
        assert got.dtype == dtype
        for b, k in enumerate(rows.tolist()):
            want = torch.zeros(3) if k < 0 else pairs[k].scale * (pairs[k].b @ (pairs[k].a @ x[b].float()))
            torch.testing.assert_close(got[b].float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                       atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    shared_rows.set([0, 0, 1, -1])  # new rows: the shared columns follow
    for b, k in enumerate([0, 0, 1, -1]):
        want = torch.zeros(3) if k < 0 else pairs[k].scale * (pairs[k].b @ (pairs[k].a @ x[b].float()))
        torch.testing.assert_close(twins[1](x, shared_rows.rows)[b].float(), want, rtol=2e-2, atol=2e-2)


def test_an_adapter_it_cannot_run_per_row_is_refused_with_the_way_out(tiny_dir, tmp_path):
    dora = save_adapter(tiny_dir, tmp_path / "dora", seed=3, use_dora=True)
    configs = trio_configs(tiny_dir, (dora, dora))
    with pytest.raises(AssetError, match="DoRA.*share_base: false"):
        load_local_experts(configs, str)


def test_a_forward_of_the_model_after_a_step_runs_the_bare_base(shared, merged):
    """What a benchmark's plain forward relies on: after the members' step (three rows, two with adapters),
    `select_base_rows` makes the next forward of the shared model the bare base's, at another batch size."""
    group = shared[0].shared_base
    group.step_members([(member, [StepRequest(f"r{i}", [1, 2, 3, 4])]) for i, member in enumerate(shared)])
    group.select_base_rows()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        got = shared[0].model(input_ids=ids).logits
        want = merged[0].model(input_ids=ids).logits
    for i, member in enumerate(shared):
        member.release([f"r{i}"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
