"""Continuous batching: many callers, one decode loop; same tokens as solo runs; explicit limits."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading

import pytest

from fusion.config import SamplingParams
from fusion.engine.types import GenerationRequest
from fusion.errors import ResourceExhaustedError, ServiceBusyError
from fusion.engine.scheduler import Scheduler
from fusion.engine.tenancy import Tenant
from tests.helpers import wait_until


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
    assert wait_until(lambda: scheduler.active == 0)
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


def _tenant_requests(service, tenant, n, max_tokens, first_prompt=0):
    rule, weights = service.resolve_spec(None)
    return [GenerationRequest([[5 + first_prompt + i, 17, 42]] * 3,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9,
                                             seed=first_prompt + i),
                              rule, weights, tenant=tenant)
            for i in range(n)]


def test_a_tenant_filling_the_batch_gives_a_newcomer_a_slot_at_once(tiny_service):
    """Tenant A holds every batch slot and more waits; tenant B's request runs at the next step (A gives
    back its latest request), and A's preempted requests still produce their solo tokens."""
    team_a, team_b = Tenant("a"), Tenant("b")
    a_requests = _tenant_requests(tiny_service, team_a, 4, 40)
    b_request = _tenant_requests(tiny_service, team_b, 1, 5, first_prompt=10)[0]
    solo = {r.request_id: [e.token_id for e in tiny_service.engine.generate(copy.copy(r))]
            for r in a_requests + [b_request]}
    admitted: list[tuple[str, float]] = []
    scheduler = Scheduler(tiny_service.engine, max_concurrent=8, max_batch_size=2,
                          admission_observers=[lambda _, tenant, waited: admitted.append((tenant, waited))]).start()
    try:
        a_handles = [scheduler.submit(r) for r in a_requests]
        first = next(iter(a_handles[0]._queue.get, None))  # A is decoding
        assert first is not None and scheduler.running_by_tenant() == {"a": 2}
        with scheduler._cond:  # no step starts between the count and B's arrival, however loaded the host
            steps_before = scheduler.steps
            b_handle = scheduler.submit(b_request)
        b_tokens = [e.token_id for e in b_handle]
        assert b_tokens == solo[b_request.request_id]
        # B ran its 5 tokens in about 5 steps (one more may have been under way), while A's requests
        # of 40 tokens were still far from done
        assert scheduler.steps - steps_before <= 8
        assert scheduler.preemptions >= 1
        a_tokens = [[first.token_id] + [e.token_id for e in a_handles[0]]] + [
            [e.token_id for e in h] for h in a_handles[1:]]
        assert a_tokens == [solo[r.request_id] for r in a_requests]
        # each request's wait is observed once, when it first takes a slot (not again after preemption)
        assert sorted(tenant for tenant, _ in admitted) == ["a"] * len(a_requests) + ["b"]
        assert all(waited >= 0 for _, waited in admitted)
    finally:
        scheduler.stop()
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)


def test_weights_split_the_batch(tiny_service):
    """Both tenants keep more waiting than slots: slots split 3 : 1 by weight 3 : 1."""
    heavy, light = Tenant("heavy", weight=3.0), Tenant("light", weight=1.0)
    scheduler = Scheduler(tiny_service.engine, max_concurrent=16, max_batch_size=4).start()
    try:
        handles = [scheduler.submit(r) for r in _tenant_requests(tiny_service, light, 4, 300)]
        assert wait_until(lambda: scheduler.running_by_tenant() == {"light": 4})  # alone: every slot
        handles += [scheduler.submit(r) for r in _tenant_requests(tiny_service, heavy, 4, 300, first_prompt=4)]
        assert wait_until(lambda: scheduler.running_by_tenant() == {"heavy": 3, "light": 1})
    finally:
        for handle in handles:
            handle.cancel()
        scheduler.stop()
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)


def test_a_request_waiting_past_max_queue_wait_is_refused_with_a_retry_time(tiny_service):
    scheduler = Scheduler(tiny_service.engine, max_concurrent=4, max_batch_size=1, max_queue_wait_s=0.2).start()
    try:
        holding, waiting = _tenant_requests(tiny_service, Tenant("a"), 2, 2000)
        held = scheduler.submit(holding)
        refused = scheduler.submit(waiting)  # same tenant: nothing to preempt, so it waits
        with pytest.raises(ServiceBusyError, match="max_queue_wait_s=0.2") as caught:
            list(refused)
        assert caught.value.retry_after_s > 0
        held.cancel()
        assert wait_until(lambda: scheduler.active == 0)
    finally:
        scheduler.stop()
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)


def test_a_preempted_request_cancelled_while_waiting_frees_its_sessions(tiny_service):
    scheduler = Scheduler(tiny_service.engine, max_concurrent=4, max_batch_size=1).start()
    try:
        a = scheduler.submit(_tenant_requests(tiny_service, Tenant("a"), 1, 2000)[0])
        next(iter(a._queue.get, None))
        # b weighs twice a: its first request takes a's only slot at once (equal weights would wait)
        b = scheduler.submit(_tenant_requests(tiny_service, Tenant("b", weight=2.0), 1, 2000, first_prompt=3)[0])
        assert wait_until(lambda: scheduler.running_by_tenant() == {"b": 1})
        assert scheduler.preemptions == 1 and scheduler.active == 2  # a waits, preempted, sessions held
        a.cancel()
        b.cancel()
        assert wait_until(lambda: scheduler.active == 0)
        assert wait_until(lambda: all(len(e.cache) == 0 for e in tiny_service.engine.experts))
    finally:
        scheduler.stop()


def test_score_chunks_between_steps_equal_a_plain_score(tiny_service):
    """A score run between a stream's decode steps, in chunks sized to the steps (a few positions each),
    gives the log-probabilities of a plain score; the stream's tokens are unchanged."""
    rule, weights = tiny_service.resolve_spec(None)
    prompt_ids, continuation = [[5, 17, 42, 9]] * 3, [(7 * k + 3) % 200 for k in range(1, 300)]
    plain = tiny_service.engine.score(prompt_ids, continuation, rule, weights)
    chunked = tiny_service.engine.score(prompt_ids, continuation, rule, weights, run_chunk=lambda job: job(3))
    assert chunked == pytest.approx(plain, abs=1e-4)
    stream = _tenant_requests(tiny_service, Tenant("a"), 1, 60)[0]
    solo = [e.token_id for e in tiny_service.engine.generate(copy.copy(stream))]
    scheduler = Scheduler(tiny_service.engine, max_concurrent=4).start()
    try:
        handle = scheduler.submit(stream)
        first = next(iter(handle._queue.get, None))  # decoding
        chunks = []

        def run_chunk(job):
            result = scheduler.run_between_steps(Tenant("b"), job)
            chunks.append(len(result))
            return result

        between = tiny_service.engine.score(prompt_ids, continuation, rule, weights, run_chunk=run_chunk)
        tokens = [first.token_id] + [e.token_id for e in handle]
    finally:
        scheduler.stop()
    assert between == pytest.approx(plain, abs=1e-4)
    assert sum(chunks) == len(continuation) and len(chunks) > 1
    assert tokens == solo
    assert all(len(e.cache) == 0 for e in tiny_service.engine.experts)
