"""`FusionService`, the one front door: layering, admission once, streams (sync and async), describe."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fusion.config import FusionSpec, SpecOverrides
from fusion.errors import InvalidArgumentError, NotFoundError
from fusion.frontdoor.service import FusionRequest
from tests.helpers import wait_until


def test_admission_layers_the_request_over_the_config(tiny_service):
    config = tiny_service.config
    admitted = tiny_service.admit(FusionRequest("hi", {"max_tokens": 3}, SpecOverrides(profile="ab"),
                                                request_id="client-7"))
    assert admitted.sampling.max_tokens == 3 and admitted.sampling.temperature == config.sampling.temperature
    assert admitted.weights == config.weights_for(FusionSpec(profile="ab"))
    assert admitted.prompt_ids == tiny_service.prompt_ids("hi")
    assert admitted.request_id.startswith("client-7/") and admitted.request_id != "client-7/"
    again = tiny_service.admit(FusionRequest("hi", {"max_tokens": 3}, SpecOverrides(profile="ab"),
                                             request_id="client-7"))
    assert again.request_id != admitted.request_id  # a caller's id only prefixes the service's own
    assert again.rule is admitted.rule  # one rule object per distinct rule and params


@pytest.mark.parametrize("request_args,error,match", [
    (("",), InvalidArgumentError, "prompt: give a prompt or messages"),
    (([{"role": "", "content": "x"}],), InvalidArgumentError, r"messages\[0\].role"),
    (("hi", {"top_p": 0}), InvalidArgumentError, "top_p"),
    (("hi", None, SpecOverrides(profile="nope")), NotFoundError, "profile"),
    (("hi", None, SpecOverrides(weights={"zz": 1.0})), NotFoundError, "unknown expert"),
    (("hi", None, SpecOverrides(rule="nope")), InvalidArgumentError, "unknown fusion rule"),
    (("hi", None, None, "a\nforged log line"), InvalidArgumentError, "request_id: may hold only"),
    (("hi", None, None, "x" * 129), InvalidArgumentError, "request_id: 129 characters exceed max_request_id_chars=128"),
])
def test_bad_requests_are_refused_at_admission_before_any_work(tiny_service, request_args, error, match):
    with pytest.raises(error, match=match):
        tiny_service.submit(FusionRequest(*request_args))
    assert tiny_service.active == 0
    assert not any(len(e.cache) for e in tiny_service.engine.experts)


def test_async_stream_equals_the_sync_one_and_admits_off_the_loop(tiny_service, monkeypatch):
    request = FusionRequest("hello world", {"max_tokens": 8, "ignore_eos": True})
    expected = [e.token.token_id for e in tiny_service.submit(request)]
    admitted_on = []
    real_admit = tiny_service.admit

    def spy(req):
        admitted_on.append(threading.current_thread())
        return real_admit(req)

    async def run():
        stream = await tiny_service.submit_async(request)
        return [event async for event in stream], threading.current_thread()

    monkeypatch.setattr(tiny_service, "admit", spy)  # undone after the test: the fixture is shared
    events, loop_thread = asyncio.run(run())
    monkeypatch.undo()
    assert [e.token.token_id for e in events] == expected
    assert admitted_on and admitted_on[0] is not loop_thread
    assert events[-1].usage.completion_tokens == 8 and events[-1].finish_reason == "length"


def test_describe(tiny_service):
    description = tiny_service.describe()
    assert [e.info.name for e in description.experts] == tiny_service.expert_names
    assert [e.default_weight for e in description.experts] == [e.weight for e in tiny_service.config.experts]
    assert {"weighted_logits", "mixture", "route"} <= set(description.rules)
    assert description.rules["route"] == ("router", "hard", "complementary", "fail_safe", "tau")
    assert description.default_spec == tiny_service.config.fusion
    assert description.active_requests == 0


def test_a_stream_dropped_unread_is_cancelled(tiny_service):
    """A caller that submits and drops the stream without reading it frees the batch slot and the
    sessions at once, instead of decoding on to max_tokens."""
    import gc

    steps = tiny_service._running_scheduler().steps  # before the request: every step of it counts
    stream = tiny_service.submit(FusionRequest("hello", {"max_tokens": 400, "ignore_eos": True}))
    assert tiny_service.active == 1
    del stream
    gc.collect()
    wait_until(lambda: not tiny_service.active and not any(e.active_sessions for e in tiny_service.experts),
               message="the dropped stream's slot and sessions were not freed")
    assert tiny_service.active == 0 and all(e.active_sessions == 0 for e in tiny_service.experts)
    # stopped, not run to its 400 tokens (one step a token): how early depends on the host's load
    assert tiny_service._scheduler.steps - steps < 400


def test_an_abandoned_score_stops_and_frees_its_sessions(tiny_service):
    """A Score whose caller is cancelled (a client gone, a deadline passed) stops at its next chunk and
    frees its sessions, instead of scoring on for nobody."""
    stream = tiny_service.submit(FusionRequest("hi", {"max_tokens": 400, "ignore_eos": True}))
    events = iter(stream)
    next(events)  # decoding: score chunks are a fraction of a step each

    scheduler = tiny_service._running_scheduler()

    async def abandon() -> int:
        task = asyncio.ensure_future(tiny_service.score_async("a", " b c d e f g h" * 25))
        assert await asyncio.to_thread(wait_until, lambda: scheduler.side_jobs >= 3)  # scoring, chunk by chunk
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return scheduler.side_jobs

    at_cancel = asyncio.run(abandon())
    try:
        assert wait_until(lambda: all(len(e.cache) == 1 for e in tiny_service.engine.experts))
        assert scheduler.side_jobs - at_cancel <= 2  # the chunk running then, at most one more: not the rest
    finally:
        stream.cancel()
    assert wait_until(lambda: all(len(e.cache) == 0 for e in tiny_service.engine.experts))
