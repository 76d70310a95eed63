"""Continuous batching: many callers, one decode loop; same tokens as solo runs; explicit limits."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from fusion.config import SamplingParams
from fusion.engine import GenerationRequest
from fusion.errors import ResourceExhaustedError
from fusion.scheduler import Scheduler


def make_requests(service, n):
    rule, weights = service.resolve_spec(None)
    prompts = [[5 + i, 17, 42 + i] + [9] * (i % 4) for i in range(n)]
    return lambda: [
        GenerationRequest([p] * 3, SamplingParams(max_tokens=6 + i % 5, ignore_eos=True,
                                                  temperature=0.8 if i % 2 else 0.0, seed=i),
                          rule, weights)
        for i, p in enumerate(prompts)
    ]


def test_concurrent_requests_match_solo_runs(tiny_service):
    build = make_requests(tiny_service, 6)
    solo = [[e.token_id for e in tiny_service.engine.generate(r)] for r in build()]
    scheduler = Scheduler(tiny_service.engine, max_concurrent=8, max_batch_size=4).start()
    results = [None] * 6

    def consume(i, request):
        results[i] = [e.token_id for e in scheduler.submit(request)]

    threads = [threading.Thread(target=consume, args=(i, r)) for i, r in enumerate(build())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    scheduler.stop()
    assert results == solo
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)


def test_async_stream_and_cancel(tiny_service):
    scheduler = Scheduler(tiny_service.engine, max_concurrent=4).start()
    request = make_requests(tiny_service, 1)()[0]
    request.sampling = SamplingParams(max_tokens=500, ignore_eos=True)

    async def run():
        handle = scheduler.submit(request)
        got = []
        async with contextlib.aclosing(handle.stream()) as events:
            async for event in events:
                got.append(event.token_id)
                if len(got) == 3:
                    break
        return got

    assert len(asyncio.run(run())) == 3
    for _ in range(100):
        if scheduler.active == 0:
            break
        threading.Event().wait(0.05)
    assert scheduler.active == 0
    scheduler.stop()
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)


def test_over_the_limit_is_refused(tiny_service):
    scheduler = Scheduler(tiny_service.engine, max_concurrent=2).start()
    build = make_requests(tiny_service, 3)
    reqs = build()
    for r in reqs:
        r.sampling = SamplingParams(max_tokens=200, ignore_eos=True)
    handles = [scheduler.submit(reqs[0]), scheduler.submit(reqs[1])]
    with pytest.raises(ResourceExhaustedError, match="max_concurrent_sessions=2"):
        scheduler.submit(reqs[2])
    for h in handles:
        h.cancel()
    scheduler.stop()
