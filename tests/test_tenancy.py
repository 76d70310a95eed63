"""`fusion/engine/tenancy.py`: the weighted-fair choices every queue makes, against a plain simulation."""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from fusion.config import SamplingParams
from fusion.engine.types import GenerationRequest
from fusion.engine.tenancy import Tenant, VirtualClock, fair_pick, should_preempt


def test_tenant_weight_must_be_positive():
    with pytest.raises(ValueError, match="weight"):
        Tenant("a", weight=0.0)


def settle(slots: int, demand: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """Run admission and preemption as the scheduler does until nothing moves; the running counts."""
    running = {t: 0 for t in demand}
    waiting = dict(demand)
    order: dict[str, int] = {}
    for step in itertools.count():
        assert step < 10_000
        tenants = [t for t, n in waiting.items() if n]
        if not tenants:
            return running
        tenant = fair_pick(tenants, running, weights, order)
        if sum(running.values()) >= slots:
            victim = should_preempt(tenant, running, weights)
            if victim is None:
                return running
            running[victim] -= 1
            waiting[victim] += 1
        running[tenant] += 1
        waiting[tenant] -= 1
        order[tenant] = step


def water_fill(slots: int, demand: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares (the reference): raise every unsatisfied tenant's share together."""
    share = {t: 0.0 for t in demand}
    left, active = float(slots), {t for t in demand if demand[t] > 0}
    while left > 1e-9 and active:
        total = sum(weights[t] for t in active)
        step = min(left / total, *((demand[t] - share[t]) / weights[t] for t in active))
        for t in list(active):
            share[t] += step * weights[t]
            if share[t] >= demand[t] - 1e-9:
                active.discard(t)
        left -= step * total
    return share


@pytest.mark.parametrize("seed", range(40))
def test_admission_and_preemption_reach_the_weighted_fair_shares(seed):
    """Whatever the demand and weights, the slots end within one of the weighted max-min fair share, and
    an idle system lets one tenant use everything."""
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(rng.randint(1, 5))]
    demand = {t: rng.randint(0, 20) for t in tenants}
    weights = {t: rng.choice([0.5, 1.0, 1.0, 2.0, 3.0]) for t in tenants}
    slots = rng.randint(1, 16)
    running = settle(slots, demand, weights)
    fair = water_fill(slots, demand, weights)
    assert sum(running.values()) == min(slots, sum(demand.values()))
    for t in tenants:
        assert running[t] <= demand[t]
        assert abs(running[t] - fair[t]) < 1 + 1e-9, (running, fair, weights)


def test_a_lone_tenant_takes_every_slot_and_a_slot_never_bounces_back():
    assert settle(8, {"a": 20}, {"a": 1.0}) == {"a": 8}
    weights = {"a": 1.0, "b": 1.0}
    assert should_preempt("b", {"a": 8, "b": 0}, weights) == "a"
    assert should_preempt("a", {"a": 4, "b": 4}, weights) is None  # equal: no move
    assert should_preempt("a", {"a": 3, "b": 5}, weights) == "b"
    assert should_preempt("b", {"a": 4, "b": 4}, weights) is None  # after a -> b it would bounce


def test_virtual_clock_orders_by_work_per_weight_and_gives_no_idle_credit():
    clock = VirtualClock()
    clock.activate(["a", "b"])
    clock.charge("a", 30, weight=3.0)
    clock.charge("b", 20, weight=1.0)
    assert sorted(["a", "b"], key=clock.key) == ["a", "b"]  # a did 10 per unit of weight, b 20
    clock.activate(["a"])  # b left; it comes back at a's clock, not at 0
    clock.charge("a", 60, weight=3.0)
    clock.activate(["a", "b"])
    assert clock.key("b") == clock.key("a") == 30.0


def test_prefill_budget_alternates_between_tenants(tiny_service):
    """Two tenants each with a prompt longer than the budget: chunks alternate between them, so
    neither waits for the other's whole prompt."""
    rule, weights = tiny_service.resolve_spec(None)
    engine = copy.copy(tiny_service.engine)  # the same experts, a small prefill budget
    engine.limits = engine.limits.model_copy(update={"prefill_chunk_tokens": 16})
    batch = engine.new_batch()
    budget = engine.limits.prefill_chunk_tokens
    long_prompt = [5, 17, 42, 9] * (budget // 2)  # two budgets long
    requests = [GenerationRequest([long_prompt] * 3, SamplingParams(max_tokens=2, ignore_eos=True), rule, weights,
                                  tenant=Tenant(name)) for name in ("a", "a", "b")]
    for request in requests:
        engine.admit(request)
        batch.add(request)
    order = []
    for _ in range(4):
        ready, chunks = batch._schedule()
        order.append([row.request.tenant.id for row, _ in chunks] + [row.request.tenant.id for row in ready])
        for row, ends in chunks:
            row.prefilled = ends
    assert order[:2] == [["a"], ["b"]]  # b's prompt starts before a's second
    batch.cancel_all()
