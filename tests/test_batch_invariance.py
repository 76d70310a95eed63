"""Batch-invariant experts (`batch_invariant: true`): every forward runs its ids one row each through the C
decode step, so a session's logits are bit for bit the same whatever it is computed beside, however its
prompt is chunked, and on whichever replica its history is computed again. What exact failover rests on:
a greedy stream whose replica is lost continues, elsewhere, with the tokens it would have had."""

from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError

from fusion.config import ExpertConfig, parse_config
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.frontdoor.service import FusionService
from tests.conftest import batch_invariant_config_dict

PROMPT = [5, 17, 40, 33, 8, 91, 12, 64, 3, 27, 50]
OTHERS = {"left": [7, 7, 21, 90, 4], "right": [60, 2, 11, 35, 19, 44, 80, 23, 9, 14, 71, 30, 6, 55, 47, 38, 29]}
STEPS = 10


def _expert(tiny_dir, dtype: str) -> LocalExpert:
    return LocalExpert.load(ExpertConfig(name="a", model=str(tiny_dir / "a"), dtype=dtype, weights="int4",
                                         batch_invariant=True))


def _greedy_alone(expert: LocalExpert, session: str, prompt: list[int], steps: int) -> list[torch.Tensor]:
    history, rows = list(prompt), []
    for _ in range(steps):
        logits = expert.step([StepRequest(session, history)])[0]
        rows.append(logits)
        history.append(int(logits.argmax()))
    expert.release([session])
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_session_gets_the_same_bits_in_any_company_chunking_or_replica(tiny_dir, dtype):
    """One greedy session, stepped alone on one expert (the reference), then on another: its prompt in two
    chunks, decoded in a cohort with two sessions of other lengths (left-padded around it), then failed over
    to a third expert that computes its whole history at once and decodes it beside a fresh prompt. Every
    step's logits are the reference's, bit for bit."""
    reference = _greedy_alone(_expert(tiny_dir, dtype), "s", PROMPT, STEPS)
    first, replica = _expert(tiny_dir, dtype), _expert(tiny_dir, dtype)
    assert first._row_by_row and replica._row_by_row

    first.step([StepRequest("s", PROMPT[:4])])  # a first chunk of the prompt
    histories = {"s": list(PROMPT), **{name: list(ids) for name, ids in OTHERS.items()}}
    moved_at = 6
    for step in range(STEPS):
        expert, names = (first, list(histories)) if step < moved_at else (replica, ["s", "fresh"])
        if step == moved_at:
            histories["fresh"] = [1, 2, 3, 4, 5, 6, 7, 8]
        logits = expert.step([StepRequest(name, histories[name]) for name in names])
        assert torch.equal(logits[0], reference[step]), f"step {step}"
        for name, row in zip(names, logits):
            histories[name].append(int(row.argmax()))
    assert first.decode_batches["rebuilt"] + first.decode_batches["in_place"] > 0  # the cohort did decode


def test_a_prompt_scored_row_by_row_equals_its_steps(tiny_dir):
    """`score` runs row by row too: the logits at each position of a history are the ones stepping its ids
    gave."""
    expert = _expert(tiny_dir, "float32")
    stepped = [expert.step([StepRequest("s", PROMPT[:n])])[0] for n in range(4, len(PROMPT) + 1)]
    scored = expert.score("t", PROMPT + [1], len(PROMPT) - 3)
    assert torch.equal(scored, torch.stack(stepped))


def test_batch_invariant_needs_the_c_step():
    for fields in ({"weights": "dense"}, {"weights": "int4", "decode": "static"},
                   {"weights": "int4", "device": "cuda"}):
        with pytest.raises(ValidationError, match="batch_invariant needs the C decode step"):
            ExpertConfig(name="a", model="m", batch_invariant=True, **fields)


def test_greedy_streams_side_by_side_are_each_the_stream_alone(tiny_dir):
    """The tiny trio, batch-invariant, through the service: six greedy streams at once (their prompts,
    steps and fusion sharing batches) give each the tokens it gives alone."""
    service = FusionService.from_config(parse_config(batch_invariant_config_dict(tiny_dir)))
    prompts = ["what is 12 + 35 ?", "def add", "hello world , fusion", "the quick brown fox", "a b c", "fusion"]
    sampling = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    try:
        alone = [service.complete(p, sampling).token_ids for p in prompts]
        together: list[list[int] | None] = [None] * len(prompts)

        def run(i: int) -> None:
            together[i] = service.complete(prompts[i], sampling).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        service.close()
    assert together == alone


def test_lookahead_rows_of_several_ids_are_not_adopted_but_computed_row_by_row(tiny_dir):
    """`extend` computes extensions of several ids with transformers' forward and, as configured, keeps
    their rows for a history that takes one of them. A batch-invariant expert keeps none: the history is
    computed row by row, bit for bit what stepping it gives."""
    reference = _expert(tiny_dir, "float32")
    want = reference.step([StepRequest("s", PROMPT + [1, 2])])[0]
    expert = _expert(tiny_dir, "float32")
    expert.extend("s", PROMPT, [[1, 2], [3]])
    assert "s" not in expert._extensions  # nothing kept to adopt
    assert torch.equal(expert.step([StepRequest("s", PROMPT + [1, 2])])[0], want)


def _int4_expert(tiny_dir, **fields) -> LocalExpert:
    return LocalExpert.load(ExpertConfig(name="a", model=str(tiny_dir / "a"), dtype="float32", weights="int4",
                                         **fields))


def test_short_prompts_run_row_by_row_and_long_ones_the_forward(tiny_dir):
    """`c_step_prompt_ids`: a step's new prompts of at most that many ids in all run row by row through the C
    step (each prompt's logits are the batch-invariant expert's, bit for bit); more take transformers' forward,
    one left-padded batch (the logits of an expert whose prompts always do, `c_step_prompt_ids: 0`)."""
    invariant = _int4_expert(tiny_dir, batch_invariant=True)
    forward = _int4_expert(tiny_dir, c_step_prompt_ids=0)
    other = OTHERS["left"]
    both = [StepRequest("s", PROMPT), StepRequest("o", other)]
    by_rows = torch.stack([invariant.step([StepRequest("s", PROMPT)])[0], invariant.step([StepRequest("o", other)])[0]])
    by_forward = forward.step(both)
    assert not torch.equal(by_rows, by_forward)  # the two ways differ in their bits: the checks below can tell

    fits = _int4_expert(tiny_dir, c_step_prompt_ids=len(PROMPT) + len(other))
    assert torch.equal(fits.step(both), by_rows)
    one_short = _int4_expert(tiny_dir, c_step_prompt_ids=len(PROMPT) + len(other) - 1)
    assert torch.equal(one_short.step(both), by_forward)


def test_short_prompts_need_the_c_step(tiny_dir):
    """Where the C step cannot run the expert (dense weights), every prompt takes the forward."""
    dense = LocalExpert.load(ExpertConfig(name="a", model=str(tiny_dir / "a"), dtype="float32"))
    assert not dense._short_for_c_step(1) and dense._c_step_prompts is False
    assert _int4_expert(tiny_dir)._short_for_c_step(ExpertConfig.model_fields["c_step_prompt_ids"].default)


def test_short_prompts_take_the_forward_while_the_c_layers_are_off(tiny_dir):
    """A decoder whose C layers are switched off (a benchmark timing torch's operators) sends short prompts
    through the forward rather than failing them."""
    forward = _int4_expert(tiny_dir, c_step_prompt_ids=0)
    expert = _int4_expert(tiny_dir)
    expert._fast_step.decoder.native_layers = False
    assert torch.equal(expert.step([StepRequest("s", PROMPT)]), forward.step([StepRequest("s", PROMPT)]))
