"""DecodeBatch: the per-row sampling state persists while the rows sampling together stay the same and
is rebuilt when one joins or leaves; every step samples exactly as a state built fresh for it would."""

from __future__ import annotations

from fusion.config import SamplingParams
from fusion.engine.batch import DecodeBatch
from fusion.engine.types import GenerationRequest
from fusion.fuse.sampler import SamplingMetadata


def requests(service, max_tokens=(6, 3, 6)):
    """A greedy request, a seeded sampled one that ends early, and a sampled one with top-k, a bias and
    a penalty: every kind of per-row state."""
    rule, weights = service.resolve_spec(None)
    samplings = [
        SamplingParams(max_tokens=max_tokens[0], temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens[1], temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens[2], temperature=1.1, top_k=5, seed=3, logit_bias={4: 2.0},
                       repetition_penalty=1.3, ignore_eos=True),
    ]
    prompts = ([5, 17, 42], [9, 9, 3, 1], [2, 8])
    return [GenerationRequest([list(p)] * 3, s, rule, weights, request_id=f"r{i}")
            for i, (p, s) in enumerate(zip(prompts, samplings))]


def run(service, monkeypatch, fresh_each_step: bool) -> tuple[dict[str, list[int]], int, int]:
    """Tokens per request, with a request joining after two steps; how many states were built; steps."""
    builds = []
    original = SamplingMetadata.build.__func__

    def counted(cls, *args, **kwargs):
        builds.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(SamplingMetadata, "build", classmethod(counted))
    engine = service.engine
    first, second, late = requests(service)
    batch = DecodeBatch(engine)
    for request in (first, second):
        batch.add(engine.admit(request))
    tokens: dict[str, list[int]] = {}
    step = 0
    while batch.active:
        if step == 2:
            batch.add(engine.admit(late))
        if fresh_each_step:
            batch._metadata = None
        for event in batch.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
        step += 1
    monkeypatch.undo()
    return tokens, len(builds), step


def test_sampling_state_persists_and_samples_as_a_fresh_one(tiny_service, monkeypatch):
    kept, kept_builds, steps = run(tiny_service, monkeypatch, fresh_each_step=False)
    fresh, fresh_builds, fresh_steps = run(tiny_service, monkeypatch, fresh_each_step=True)
    assert kept == fresh  # same tokens, seeded rows included
    assert {k: len(v) for k, v in kept.items()} == {"r0": 6, "r1": 3, "r2": 6}
    assert fresh_builds == fresh_steps == steps == 8  # reset: one state per step
    # Kept: built only when the rows change (the first step, the late row's first step, after r1 leaves,
    # after r0 leaves).
    assert kept_builds == 4
