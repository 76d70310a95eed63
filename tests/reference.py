"""Comparing greedy streams computed in different processes.

Another process may run with another thread count (Ray sets OMP_NUM_THREADS from an actor's CPUs),
other batch shapes (a replica batches its sessions with others', a failover re-prefills a whole
history) or other CPU kernels; fp32 reductions then differ in their last bits. Two greedy streams are
therefore equal token for token except where the reference distribution has a near tie. These
helpers assert exactly that: a stream that differs from the reference must still pick, at every
position, a token the reference scores within `tol` of its best (teacher forced on the stream's own
history), so a wrong model, a lost token or a misaligned history still fails.
"""

from __future__ import annotations

import torch

# fp32 logits computed with other reduction orders differ by ~1e-6; a wrong token differs by far more.
NEAR_TIE = 1e-3


def greedy_gaps(service, prompt, token_ids: list[int], spec=None) -> list[float]:
    """Per position: the reference's best fused logprob minus that of the stream's token (0 = greedy)."""
    engine = service.engine
    rule, weights = service.resolve_spec(spec)
    prompt_ids = service.prompt_ids(prompt)
    uses = [rule.uses_expert(e, weights) for e in range(len(engine.experts))]
    logits = engine.continuation_logits(prompt_ids, token_ids, uses=uses)  # (E, n, V)
    log_probs = engine.fused_distribution(logits, token_ids, rule, weights, prompt_ids[0])  # (n, V)
    chosen = log_probs.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
    return (log_probs.amax(-1) - chosen).tolist()


def assert_greedy_equivalent(service, prompt, got: list[int], expected: list[int], spec=None,
                             tol: float = NEAR_TIE) -> None:
    """`got` (greedy, computed elsewhere) equals the reference `expected`, or departs from it only
    at near ties: every token of `got` is a greedy choice of the reference within `tol`."""
    assert got, "the stream is empty"
    if got == expected:
        return
    first = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), None)
    assert first is not None, f"one stream is a truncation of the other: {len(got)} vs {len(expected)} tokens"
    gaps = greedy_gaps(service, prompt, got, spec)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= tol, (
        f"the stream departs from the reference at token {first} and is not greedy under it: token {worst} "
        f"({got[worst]}) scores {gaps[worst]:.4g} below the reference's best")


def assert_stream_matches(service, prompt, events, local, spec=None) -> None:
    """A remote stream of text events against the local `Completion` for the same greedy request: the
    same tokens up to near ties (see above); where the tokens are the same, the same text and ending."""
    got = [e.token.token_id for e in events]
    assert_greedy_equivalent(service, prompt, got, local.token_ids, spec)
    if got == local.token_ids:
        assert "".join(e.text for e in events) == local.text
        assert events[-1].finish_reason == local.finish_reason


def assert_payload_matches(service, prompt, payload: dict, local, spec=None) -> None:
    """`fusion generate --json` output from another process against the local `Completion`."""
    assert_greedy_equivalent(service, prompt, payload["token_ids"], local.token_ids, spec)
    if payload["token_ids"] == local.token_ids:
        assert payload["text"] == local.text
