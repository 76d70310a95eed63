"""Kept prefixes (fusion.experts.prefix_pool): the pool's own rules, and experts whose new sessions start from a
released session's columns computing only the rest, with the logits of a fresh prefill."""

from __future__ import annotations

import pytest
import torch

from fusion.config import ExpertConfig, parse_config
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.experts.prefix_pool import MIN_SHARED, PrefixPool
from fusion.experts.shared_base import load_local_experts
from tests.conftest import batch_invariant_config_dict
from tests.test_shared_base import save_adapter


def columns(n: int, fill: float = 1.0, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) (1, 1, n, 2): column j holds fill * j."""
    col = fill * torch.arange(n, dtype=torch.float32)[None, None, :, None].expand(1, 1, n, 2)
    return [(col.clone(), -col.clone()) for _ in range(layers)]


# -- the pool ---------------------------------------------------------------------------------------
def test_the_longest_shared_run_of_the_namespace_is_adopted_up_to_all_but_the_last_id():
    pool = PrefixPool(max_tokens=200)
    system = list(range(100, 130))
    assert pool.keep("", system + [1, 2, 3], columns(33))
    assert pool.keep("", system[:20] + [9] * 20, columns(40, fill=2.0))
    assert pool.keep("other", system + [1, 2, 3, 4], columns(34, fill=3.0))
    length, layers = pool.adopt("", system + [1, 2, 7, 8])  # shares 32 with the first, 20 with the second
    assert length == 32 and layers[0][0].shape == (1, 1, 32, 2)
    torch.testing.assert_close(layers[1][1], -columns(33)[0][0][..., :32, :])  # the first one's columns
    assert pool.adopt("", system + [1, 2, 3])[0] == 32  # a kept history repeated whole: all but its last id
    assert pool.adopt("", system[:MIN_SHARED - 1] + [0] * 30) is None  # too short a run
    assert pool.adopt("nobody", system + [1, 2, 3, 9]) is None  # another namespace's columns never serve
    assert pool.adopted_tokens == 64


def test_kept_columns_are_copies_and_the_budget_drops_the_least_recently_used():
    pool = PrefixPool(max_tokens=70)
    source = columns(30)
    pool.keep("", list(range(30)), source)
    source[0][0].fill_(99.0)  # the session's buffers move on; the pool's copy does not
    assert float(pool.adopt("", list(range(31)))[1][0][0].max()) == 29.0
    pool.keep("", list(range(100, 130)), columns(30))
    pool.adopt("", list(range(31)))  # the first is now the more recently used
    pool.keep("", list(range(200, 230)), columns(30))  # 90 > 70: the second goes
    assert pool.kept_tokens == 60 and pool.adopt("", list(range(100, 131))) is None
    assert pool.adopt("", list(range(200, 231)))[0] == 30
    # a history extending a kept one replaces it; one a kept one begins with adds nothing
    pool.keep("", list(range(40)), columns(40))
    assert len(pool) == 2 and pool.kept_tokens == 70
    pool.keep("", list(range(20)), columns(20))
    assert len(pool) == 2 and pool.kept_tokens == 70
    assert not pool.keep("", list(range(MIN_SHARED - 1)), columns(MIN_SHARED - 1))  # too short to serve
    assert not pool.keep("", list(range(71)), columns(71))  # more than the whole budget
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        PrefixPool(-1)


# -- experts --------------------------------------------------------------------------------------------
def load(path, **fields) -> LocalExpert:
    return LocalExpert.load(ExpertConfig(name="e", model=str(path), dtype="float32", **fields))


def test_a_new_session_computes_only_what_a_released_one_did_not_share(tiny_dir):
    expert, fresh = load(tiny_dir / "a"), load(tiny_dir / "a", prefix_cache_tokens=0)
    system = list(range(40, 75))
    expert.step([StepRequest("first", system + [5, 6, 7])])
    expert.release(["first"])
    assert len(expert.prefixes) == 1 and len(expert.cache) == 0
    before = expert.cache.misses
    history = system + [8, 9]
    got = expert.step([StepRequest("second", history)])
    assert expert.cache.misses - before == 2  # the system prompt's 35 ids came from the pool
    assert expert.cache_stats()["prefix_adopted_tokens"] == 35 and expert.cache_stats()["prefix_kept_tokens"] == 38
    torch.testing.assert_close(got, fresh.step([StepRequest("s", history)]), rtol=1e-5, atol=1e-5)
    for n in range(3):  # and the session decodes on from there as a fresh one does
        token = int(got[0, :250].argmax())
        history = history + [token]
        got = expert.step([StepRequest("second", history)])
        torch.testing.assert_close(got, fresh.step([StepRequest("s", history)]), rtol=1e-5, atol=1e-5)
    # scoring starts from kept columns too
    expert.release(["second"])
    before = expert.cache.misses
    scored = expert.score("third", system + [5, 6, 7, 1], 2)
    assert expert.cache.misses - before == 2  # only the two positions whose logits are asked for
    torch.testing.assert_close(scored, fresh.score("t", system + [5, 6, 7, 1], 2), rtol=1e-5, atol=1e-5)
    assert fresh.prefixes is None


def test_several_new_sessions_of_one_step_each_adopt(tiny_dir):
    expert, fresh = load(tiny_dir / "b"), load(tiny_dir / "b", prefix_cache_tokens=0)
    system = list(range(60, 90))
    expert.step([StepRequest("x", system + [1])])
    expert.release(["x"])
    histories = {"p": system + [2, 3], "q": system + [4], "r": [7] * 20}
    before = expert.cache.misses
    got = expert.step([StepRequest(s, h) for s, h in histories.items()])
    assert expert.cache.misses - before == 2 + 1 + 20
    want = fresh.step([StepRequest(s, h) for s, h in histories.items()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_shared_bases_member_adopts_only_its_own_columns_and_stays_bit_exact(tiny_dir, tmp_path):
    """Batch-invariant members (every forward row by row through the C step): a member's logits from kept
    columns are bit for bit those of a fresh prefill, and no member starts from another's columns."""
    plain = batch_invariant_config_dict(tiny_dir, names=("a",))["experts"][0]
    adapters = [None, save_adapter(tiny_dir, tmp_path / "one", seed=11), save_adapter(tiny_dir, tmp_path / "two", seed=12)]

    def members(**extra):
        experts = [{**plain, "name": f"m{k}", "adapter": None if a is None else str(a), **extra}
                   for k, a in enumerate(adapters)]
        return load_local_experts(parse_config({"experts": experts}).experts, str)

    pooled, fresh = members(), members(prefix_cache_tokens=0)
    group = pooled[0].shared_base
    system = list(range(30, 60))
    pooled[1].step([StepRequest("s", system + [1, 2])])
    pooled[1].release(["s"])
    before = group.cache.misses
    pooled[2].step([StepRequest("t", system + [3])])  # the other adapter: nothing to adopt
    assert group.cache.misses - before == len(system) + 1
    before = group.cache.misses
    got = pooled[1].step([StepRequest("u", system + [3])])
    assert group.cache.misses - before == 1
    assert torch.equal(got, fresh[1].step([StepRequest("u", system + [3])]))
    assert fresh[0].shared_base.prefixes is None
