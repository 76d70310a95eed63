"""The evaluation's measurements against plain references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from fusion.tools import evaluation as ev
from fusion.config import FusionSpec


def test_bits_per_byte_matches_plain_forward(tiny_dir, tiny_service):
    texts = ["the quick brown fox jumps over the lazy dog", "def add ( a , b ) : return a + b"]
    specs = [FusionSpec(rule="single", params={"expert": "a"}), FusionSpec(rule="mixture")]
    got = ev.bits_per_byte(tiny_service, specs, texts)
    tok = tiny_service.tokenizers[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32).eval()
    nats = 0.0
    for text in texts:
        ids = tok("\n")["input_ids"] + tok(text, add_special_tokens=False)["input_ids"]
        context = len(tok("\n")["input_ids"])
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :, : tiny_service.engine.vocab_size], -1)
        nats -= sum(lp[i - 1, ids[i]].item() for i in range(context, len(ids)))
    expected = nats / math.log(2) / sum(len(t.encode()) for t in texts)
    assert got[0] == pytest.approx(expected, rel=1e-4)
    assert got[1] != got[0]


def test_arithmetic_accuracy_runs_batched(tiny_service):
    questions = [("What is 2 + 3?", 5), ("What is 7 x 8?", 56), ("What is 9 - 4?", 5)]
    acc, tps, records = ev.arithmetic_accuracy(tiny_service, FusionSpec(rule="mixture"), questions, batch_size=2,
                                               max_tokens=8)
    assert 0.0 <= acc <= 1.0 and tps > 0
    assert [r["question"] for r in records] == [q for q, _ in questions]
    assert acc == sum(r["got"] == r["answer"] for r in records) / 3


def test_table_and_rows(tiny_service):
    rows = ev.default_rows(tiny_service)
    names = [n for n, _ in rows]
    assert names[:3] == ["a alone", "b alone", "c alone"] and "confidence" in names
    table = ev.format_table([ev.EvalRow("x", {}, 0.5, {"general": 1.234}, 10.0)])
    assert "| x | 50.0% | 1.234 | 10.0 |" in table
