"""LocalExpert (fusion.experts.expert, with its loading, batched forwards and `extend`) against plain
references: every row of logits it returns equals the model's own uncached forward over the same ids,
whatever the expert cached, batched, adopted, evicted or released on the way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from fusion.config import ExpertConfig, parse_config
from fusion.errors import AssetError, InvalidArgumentError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.experts.extensions import MAX_EXTENSION_TOKENS, MAX_EXTENSIONS
from fusion.experts.loading import codes_folder, eos_ids, tokenizer_fingerprint
from fusion.forward.kv_cache import new_cache


def load(path, name="e", **fields):
    return LocalExpert.load(ExpertConfig(name=name, model=str(path), dtype="float32", **fields))


def plain_last_logits(expert, ids):
    """The next-token logits after `ids` from the expert's model alone, uncached: (V,)."""
    with torch.no_grad():
        return expert.model(torch.tensor([ids])).logits[0, -1].float()


# -- loading and what the expert reports ----------------------------------------------------------
def test_info_describes_the_model_and_its_tokenizer(tiny_dir):
    """The logits width is the model's output rows (padded ones included), the tokenizer's size and
    fingerprint are its own, and the end-of-sequence ids are the model's and the tokenizer's."""
    padded, plain, other = load(tiny_dir / "c", "c"), load(tiny_dir / "a", "a"), load(tiny_dir / "other", "o")
    info = padded.describe()
    assert info is padded.info
    assert info.vocab_size == padded.model.get_output_embeddings().out_features == len(padded.tokenizer) + 13
    assert info.tokenizer_size == len(padded.tokenizer)
    assert info.eos_token_ids == (padded.tokenizer.eos_token_id,)
    assert (info.name, info.model, info.dtype, info.device) == ("c", str(tiny_dir / "c"), "float32", "cpu")
    assert info.max_positions == padded.model.config.max_position_embeddings
    assert info.tokenizer_fingerprint == plain.info.tokenizer_fingerprint  # one tokenizer, two models
    assert info.tokenizer_fingerprint != other.info.tokenizer_fingerprint
    assert padded.step([StepRequest("s", [5, 6])]).shape == (1, info.vocab_size)


def test_fingerprint_ignores_special_token_roles_and_eos_ids_join_both_sources(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "a")
    renamed = AutoTokenizer.from_pretrained(tiny_dir / "a", eos_token="<|endoftext|>")
    assert renamed.eos_token_id != tokenizer.eos_token_id
    assert tokenizer_fingerprint(renamed) == tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_dir / "other")) != tokenizer_fingerprint(tokenizer)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2]))
    assert eos_ids(model, SimpleNamespace(eos_token_id=2)) == (2, 7)
    assert eos_ids(SimpleNamespace(), SimpleNamespace(eos_token_id=None)) == ()
    assert codes_folder(None) is None
    assert codes_folder(tiny_dir) == tiny_dir / "weights"


def test_loading_errors_name_the_expert_and_what_is_missing(tiny_dir, tmp_path):
    with pytest.raises(AssetError, match="expert 'e': model folder not found"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssetError, match="expert 'e': cannot load the tokenizer"):
        load(tmp_path / "empty")
    AutoTokenizer.from_pretrained(tiny_dir / "a").save_pretrained(tmp_path / "tokenizer-only")
    with pytest.raises(AssetError, match="expert 'e': cannot load model"):
        load(tmp_path / "tokenizer-only")


# -- step and score -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a", "c"])  # c: output rows beyond the tokenizer's ids
def test_step_logits_equal_the_models_own_last_position_logits(tiny_dir, name):
    """Each session's row is the model's last-position logits over its whole history, for new prompts
    (one batched prefill), steady decoding (one batched step) and a session stepped alone."""
    expert = load(tiny_dir / name)
    histories = {"s1": [5, 17, 42, 99, 7], "s2": [3, 250, 11], "s3": list(range(8, 30))}
    for _ in range(3):
        got = expert.step([StepRequest(s, h) for s, h in histories.items()])
        assert got.shape == (3, expert.info.vocab_size) and got.dtype == torch.float32
        for row, history in zip(got, histories.values()):
            torch.testing.assert_close(row, plain_last_logits(expert, history), rtol=1e-4, atol=1e-4)
        for s, row in zip(histories, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]
    alone = expert.step([StepRequest("s2", histories["s2"])])
    torch.testing.assert_close(alone[0], plain_last_logits(expert, histories["s2"]), rtol=1e-4, atol=1e-4)
    assert expert.step([]).shape == (0, expert.info.vocab_size)
    expert.release(list(histories))


def test_prefix_reuse_matches_fresh_prefill(tiny_dir):
    """A history that extends, diverges from or repeats a cached one gives the logits of a fresh prefill."""
    expert = load(tiny_dir / "b")
    ids = list(range(20, 60))
    fresh = expert.step([StepRequest("fresh", ids)])
    expert.step([StepRequest("cached", ids[:25])])
    extended = expert.step([StepRequest("cached", ids)])  # only ids[25:] computed
    torch.testing.assert_close(extended, fresh, rtol=1e-5, atol=1e-5)
    branch = ids[:18] + [7, 7, 7]
    diverged = expert.step([StepRequest("cached", branch)])  # crop to 18, recompute the rest
    torch.testing.assert_close(diverged, expert.step([StepRequest("fresh2", branch)]), rtol=1e-5, atol=1e-5)
    same = expert.step([StepRequest("cached", branch)])  # identical history: recompute the last id only
    torch.testing.assert_close(same, diverged, rtol=1e-5, atol=1e-5)
    expert.release(["fresh", "cached", "fresh2"])
    assert len(expert.cache) == 0


def test_lru_eviction_under_budget(tiny_dir):
    """Past `max_cached_tokens` the least recently used sessions go; an evicted one is prefilled again."""
    config = parse_config({"experts": [{"name": "a", "model": str(tiny_dir / "a"), "dtype": "float32",
                                        "max_cached_tokens": 30}]})
    expert = LocalExpert.load(config.experts[0])
    expert.step([StepRequest("s1", list(range(1, 15)))])
    expert.step([StepRequest("s2", list(range(1, 15)))])
    assert expert.cache.sessions() == ["s1", "s2"]
    expert.step([StepRequest("s3", list(range(1, 15)))])  # 42 cached tokens > 30: s1 goes
    assert expert.cache.sessions() == ["s2", "s3"]
    assert expert.cache.evictions == 1
    # An evicted session costs a re-prefill, never a wrong answer.
    again = expert.step([StepRequest("s1", list(range(1, 16)))])
    torch.testing.assert_close(again, expert.step([StepRequest("fresh", list(range(1, 16)))]))


def test_batched_decode_matches_one_by_one(tiny_dir):
    """Sessions of different lengths, joining at different steps, decoded in one batched forward,
    give the logits of unbatched steps."""
    config = parse_config({"experts": [{"name": "c", "model": str(tiny_dir / "c"), "dtype": "float32"}]})
    batched = LocalExpert.load(config.experts[0])
    single = LocalExpert(config.experts[0], batched.model, batched.tokenizer, max_decode_batch=1)
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 60)), "s3": [8, 9, 10, 11, 12]}
    joins = {"s1": 0, "s2": 0, "s3": 2}  # s3 joins at step 2, its prefill beside the others' decode
    batch_sizes = []
    decode_batch = batched._decode_batch
    batched._decode_batch = lambda entries, hist, sessions: batch_sizes.append(len(entries)) or decode_batch(entries, hist, sessions)
    for step in range(6):
        active = [s for s in histories if joins[s] <= step]
        requests = [StepRequest(s, histories[s]) for s in active]
        got = batched.step(requests)
        expected = torch.stack([single.step([r])[0] for r in requests])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for s, row in zip(active, got):
            histories[s] = histories[s] + [int(row[:300].argmax())]
    assert batch_sizes == [2, 2, 3, 3, 3]  # the batched path really ran; the late joiner batches from step 3
    assert len(batched.cache) == 3


def test_batched_prefill_matches_one_by_one(tiny_dir):
    """New prompts of different lengths prefilled in one left-padded forward give the logits of
    separate prefills, and their caches then decode like separately built ones."""
    config = parse_config({"experts": [{"name": "a", "model": str(tiny_dir / "a"), "dtype": "float32"}]})
    batched = LocalExpert.load(config.experts[0])
    single = LocalExpert(config.experts[0], batched.model, batched.tokenizer, max_decode_batch=1)
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 60)), "s3": [8, 9, 10, 11, 12], "s4": [7]}
    calls = []
    prefill = batched._prefill_batch
    batched._prefill_batch = lambda entries, hist, sessions: calls.append(len(entries)) or prefill(entries, hist, sessions)
    for step in range(4):
        requests = [StepRequest(s, h) for s, h in histories.items()]
        got = batched.step(requests)
        expected = torch.stack([single.step([r])[0] for r in requests])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for s, row in zip(histories, got):
            histories[s] = histories[s] + [int(row[:300].argmax())]
    assert calls == [4]  # one batched prefill, then batched decoding
    assert batched.cache.cached_tokens == single.cache.cached_tokens


def test_score_rows_equal_the_models_logits_at_each_position(tiny_dir):
    """`score` predicts each of the last n ids: the model's logits at those positions of the history
    without its last id, whether the session had nothing cached or a prefix of it."""
    expert = load(tiny_dir / "a")
    ids = list(range(20, 45))
    with torch.no_grad():
        expected = expert.model(torch.tensor([ids[:-1]])).logits[0, -6:].float()  # (6, V)
    torch.testing.assert_close(expert.score("fresh", ids, 6), expected, rtol=1e-4, atol=1e-4)
    expert.step([StepRequest("cached", ids[:10])])
    torch.testing.assert_close(expert.score("cached", ids, 6), expected, rtol=1e-4, atol=1e-4)
    expert.release(["fresh", "cached"])


# -- extend ---------------------------------------------------------------------------------------
def test_extend_matches_plain_forwards_and_adopts_looked_ahead_ids(tiny_dir):
    """Each extension's row equals a plain forward over the history plus it; a next history that is a
    looked-ahead one is adopted (nothing recomputed but the new extension's id)."""
    expert = load(tiny_dir / "a")
    history = expert.tokenizer("the quick brown", add_special_tokens=False)["input_ids"]
    extensions = [[], [5], [17, 9], [40]]
    out = expert.extend("s", history, extensions)
    for row, ext in zip(out, extensions):
        torch.testing.assert_close(row, plain_last_logits(expert, history + ext), rtol=1e-4, atol=1e-4)
    # the next history is the last one plus a looked-ahead id: adopted, not recomputed, and still right
    expert.extend("s", history, [[], [5], [40]])
    before, fast_steps = expert.cache.misses, expert.fast_decode_steps
    again = expert.extend("s", history + [40], [[], [3]])
    assert expert.cache.misses - before == 1  # only the new extension's id was computed
    assert expert.fast_decode_steps == fast_steps + 1  # one-id extensions: the expert's fast decode step
    torch.testing.assert_close(again[0], plain_last_logits(expert, history + [40]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again[1], plain_last_logits(expert, history + [40, 3]), rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidArgumentError, match="extensions"):
        expert.extend("s", history, [])
    expert.release(["s"])


def test_one_id_lookahead_reads_the_session_cache_in_place_and_adopts_by_appending(tiny_dir):
    """One-id extensions run as rows of one fast step over the session's own columns: nothing is copied
    or written until one is adopted, which appends its column to the session's buffers."""
    expert = load(tiny_dir / "a")
    history = expert.tokenizer("the quick brown", add_special_tokens=False)["input_ids"]
    expert.extend("s", history, [[]])
    layers = expert.cache.get("s").kv.layers
    buffers = [(layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()) for layer in layers]
    snapshot = [layer.keys.clone() for layer in layers]
    extensions = [[5], [40], [7], [3]]
    out = expert.extend("s", history, extensions)
    for row, ext in zip(out, extensions):
        torch.testing.assert_close(row, plain_last_logits(expert, history + ext), rtol=1e-4, atol=1e-4)
    assert all(layer.get_seq_length() == len(history) for layer in layers)  # nothing appended yet
    assert all(torch.equal(layer.keys, kept) for layer, kept in zip(layers, snapshot))
    before = expert.cache.misses
    again = expert.extend("s", history + [40], [[], [3]])
    assert expert.cache.misses - before == 1  # [40] adopted; only [3] computed
    assert expert.cache.get("s").kv.layers == layers  # the same layers, one column longer, same buffers
    assert [(layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()) for layer in layers] == buffers
    assert all(layer.get_seq_length() == len(history) + 1 for layer in layers)
    torch.testing.assert_close(again[0], plain_last_logits(expert, history + [40]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again[1], plain_last_logits(expert, history + [40, 3]), rtol=1e-4, atol=1e-4)
    expert.release(["s"])


def test_extend_adopts_multi_id_padded_and_earlier_calls_extensions(tiny_dir):
    """A multi-id extension's row is adopted whole or cut after a shorter one; an earlier call's rows on
    the same history stay adoptable."""
    expert = load(tiny_dir / "a")
    history = expert.tokenizer("the quick brown", add_special_tokens=False)["input_ids"]
    for committed in ([17, 9], [5]):  # the full-width row, and a row right-padded by one column
        expert.extend("s", history, [[], [5], [17, 9], [40]])
        before = expert.cache.misses
        again = expert.extend("s", history + committed, [[], [3]])
        assert expert.cache.misses - before == 1  # only the new extension's id was computed
        torch.testing.assert_close(again[0], plain_last_logits(expert, history + committed), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again[1], plain_last_logits(expert, history + committed + [3]),
                                   rtol=1e-4, atol=1e-4)
    expert.release(["s"])
    # a second call on the same history keeps the first call's rows adoptable
    expert.extend("s", history, [[], [5], [40]])
    expert.extend("s", history, [[], [17, 9]])
    before = expert.cache.misses
    again = expert.extend("s", history + [40], [[]])
    assert expert.cache.misses == before
    torch.testing.assert_close(again[0], plain_last_logits(expert, history + [40]), rtol=1e-4, atol=1e-4)
    expert.release(["s"])


def test_extend_shares_rows_between_an_extension_and_its_prefixes(tiny_dir):
    """An extension that is a prefix of another reads its row (computed once) at its own last column."""
    expert = load(tiny_dir / "a")
    history = expert.tokenizer("the quick brown", add_special_tokens=False)["input_ids"]
    extensions = [[17, 9, 3], [], [5], [17], [17, 9], [5]]
    for committed in ([17], [17, 9], [5]):
        expert.extend("s", history, [[]])  # the history itself first
        before = expert.cache.misses
        out = expert.extend("s", history, extensions)
        assert expert.cache.misses - before == 4  # rows [17, 9, 3] and [5]: the prefixes share the first
        for row, ext in zip(out, extensions):
            torch.testing.assert_close(row, plain_last_logits(expert, history + ext), rtol=1e-4, atol=1e-4)
        before = expert.cache.misses
        again = expert.extend("s", history + committed, [[], [3]])
        assert expert.cache.misses - before == 1  # adopted: the shared row cut after the committed ids
        torch.testing.assert_close(again[0], plain_last_logits(expert, history + committed), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again[1], plain_last_logits(expert, history + committed + [3]),
                                   rtol=1e-4, atol=1e-4)
        expert.release(["s"])


def test_extend_on_sliding_window_layers_adopts_padded_rows_only_inside_the_window(tiny_dir, tmp_path):
    """A sliding-window layer can drop a padded row's extra columns only before it has dropped any of its
    own: past the window such a row is recomputed instead of adopted."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "a")
    torch.manual_seed(3)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=8, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "w")
    tokenizer.save_pretrained(tmp_path / "w")
    expert = load(tmp_path / "w")
    assert not all(type(layer).__name__ == "GrowingLayer" for layer in new_cache(expert.model.config).layers)
    for length, adopted in ((4, True), (12, False)):  # inside the window; past it (padding not droppable)
        history = list(range(10, 10 + length))
        expert.extend("s", history, [[], [5], [17, 9]])
        before = expert.cache.misses
        again = expert.extend("s", history + [5], [[], [3]])
        assert expert.cache.misses - before == (1 if adopted else 2)
        torch.testing.assert_close(again[0], plain_last_logits(expert, history + [5]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again[1], plain_last_logits(expert, history + [5, 3]), rtol=1e-4, atol=1e-4)
        expert.release(["s"])


def test_extend_then_step_equals_one_forward_over_the_concatenation(tiny_dir):
    """After looking ahead, a step whose history is the history plus one of the extensions (or
    anything else) gives the plain forward's logits, and a later `extend` does not adopt rows kept
    for the earlier history."""
    expert = load(tiny_dir / "a")
    history = [5, 17, 42, 99, 7, 3]
    extensions = [[5], [17, 9], [40, 41, 42]]
    for committed in extensions + [[8, 8]]:
        expert.extend("s", history, [[]] + extensions)
        got = expert.step([StepRequest("s", history + committed)])
        torch.testing.assert_close(got[0], plain_last_logits(expert, history + committed), rtol=1e-4, atol=1e-4)
        again = expert.extend("s", history + committed, [[], [3]])
        torch.testing.assert_close(again[0], plain_last_logits(expert, history + committed), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again[1], plain_last_logits(expert, history + committed + [3]),
                                   rtol=1e-4, atol=1e-4)
        expert.release(["s"])


# -- release and refusals -------------------------------------------------------------------------
def test_release_frees_sessions_their_kept_rows_and_the_batch_buffers(tiny_dir):
    expert = load(tiny_dir / "a")
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 50)), "s3": [8, 9, 10, 11]}
    for _ in range(2):  # a batched prefill, then a batched decode step (the cohort's buffers)
        got = expert.step([StepRequest(s, h) for s, h in histories.items()])
        for s, row in zip(histories, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]
    expert.extend("s1", histories["s1"], [[], [5]])
    assert expert.active_sessions == 3 and expert._cohort is not None
    expert.release(["s1", "never-seen"])  # an unknown session is nothing to free
    assert expert.cache.sessions() == ["s2", "s3"] and expert.active_sessions == 2
    assert expert._cohort is not None  # s2 and s3 still live in its rows
    expert.release(["s2", "s3"])
    assert expert.active_sessions == 0 and expert.cache_stats()["cached_tokens"] == 0
    assert expert._cohort is None
    # a released session starts afresh: wholly computed (its kept rows gone too), and still right
    before = expert.cache.misses
    got = expert.extend("s1", histories["s1"] + [5], [[]])
    assert expert.cache.misses - before == len(histories["s1"]) + 1
    torch.testing.assert_close(got[0], plain_last_logits(expert, histories["s1"] + [5]), rtol=1e-4, atol=1e-4)
    expert.release(["s1"])


@pytest.mark.parametrize("call, match", [
    (lambda e, v: e.step([StepRequest("s", [5, v])]), r"expert 'e': token_ids out of range \[0, {v}\): \[{v}\]"),
    (lambda e, v: e.step([StepRequest("s", [5, -1])]), r"token_ids out of range \[0, {v}\): \[-1\]"),
    (lambda e, v: e.step([StepRequest("s", [])]), "token_ids must not be empty"),
    (lambda e, v: e.step([StepRequest("s", [5] * 513)]), "513 token_ids exceed the model's 512 positions"),
    (lambda e, v: e.step([StepRequest("s", [5]), StepRequest("s", [6])]), "a step names a session twice"),
    (lambda e, v: e.score("s", [5, 6, 7], 3), r"num_positions must be in \[1, 2\], got 3"),
    (lambda e, v: e.score("s", [5, 6, 7], 0), "num_positions must be in"),
    (lambda e, v: e.extend("s", [5, v], [[]]), "token_ids out of range"),
    (lambda e, v: e.extend("s", [5, 6], [[7, v]]), "token_ids out of range"),
    (lambda e, v: e.extend("s", [5, 6], []), "extensions: give at least one"),
    (lambda e, v: e.extend("s", [5, 6], [[7]] * (MAX_EXTENSIONS + 1)), "extensions: .* exceed the limit"),
    (lambda e, v: e.extend("s", [5, 6], [[7] * (MAX_EXTENSION_TOKENS + 1)]), "extensions: one holds more than"),
    (lambda e, v: e.extend("s", [5] * 510, [[7, 7, 7]]), "513 token_ids exceed the model's 512 positions"),
], ids=["id-past-the-rows", "negative-id", "no-ids", "past-the-positions", "session-twice", "score-too-many",
        "score-none", "extend-history-id", "extension-id", "no-extensions", "too-many-extensions",
        "extension-too-long", "extension-past-the-positions"])
def test_bad_requests_are_refused_naming_the_field(tiny_dir, call, match):
    """Refused before any forward: the expert then serves the same session as if nothing had happened."""
    expert = load(tiny_dir / "a")
    assert expert.info.max_positions == 512
    with pytest.raises(InvalidArgumentError, match=match.format(v=expert.info.vocab_size)):
        call(expert, expert.info.vocab_size)
    assert expert.cache.misses == 0
    got = expert.step([StepRequest("s", [5, 6, 7])])
    torch.testing.assert_close(got[0], plain_last_logits(expert, [5, 6, 7]), rtol=1e-4, atol=1e-4)
