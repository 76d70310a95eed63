"""Who a request is for, and how waiting work is shared between tenants.

A `Tenant` is what the edges know of a caller (an API key's id, its weight, its per-request cap and
its token quota); the runtime knows nothing of keys. Every queue a request waits in shares its
capacity by the waiting tenants' weights (weighted fair queuing):

- batch slots: `fair_pick` chooses the waiting tenant furthest below its weighted share, and
  `should_preempt` says when a tenant over its share must give a slot back (the scheduler);
- prefill tokens of one step: `VirtualClock` orders the tenants by the work they were given divided
  by their weight (the decode batch; the scheduler's score chunks).

An idle system lets one tenant use everything: shares only bind while another tenant waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol


class Reservation(Protocol):
    def settle(self, used: int) -> None:
        """The tokens the work really used (at most what was reserved); the rest is given back."""


class Quota(Protocol):
    def reserve(self, tokens: int) -> Reservation:
        """Hold `tokens` before the work, or raise: `ServiceBusyError` (with `retry_after_s`) when the
        window is used up for now, `InvalidArgumentError` when no window could ever hold them."""


@dataclass(frozen=True)
class Tenant:
    """A caller as the runtime sees it. The default tenant ("") is every caller without a key."""

    id: str = ""
    weight: float = 1.0
    max_tokens: int | None = None  # the most tokens one request may ask (unset: requests are capped to it)
    quota: Quota | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant {self.id!r}: weight must be > 0, got {self.weight}")


LOCAL = Tenant()


def fair_pick(waiting: Iterable[str], running: Mapping[str, int], weights: Mapping[str, float],
              order: Mapping[str, int]) -> str | None:
    """The waiting tenant with the fewest running requests per unit of weight; ties go to the tenant
    served least recently (`order`: a counter of its last admission, lower is older)."""
    best, best_key = None, None
    for tenant in waiting:
        key = (running.get(tenant, 0) / weights[tenant], order.get(tenant, -1))
        if best_key is None or key < best_key:
            best, best_key = tenant, key
    return best


def should_preempt(waiting_tenant: str, running: Mapping[str, int], weights: Mapping[str, float]) -> str | None:
    """The running tenant that should give `waiting_tenant` a slot: the most loaded one per unit of
    weight, if it is more loaded now than `waiting_tenant` would be with the slot. The reverse move
    would then need the opposite inequality, so a slot never bounces back."""
    after = (running.get(waiting_tenant, 0) + 1) / weights[waiting_tenant]
    victim, load = None, after
    for tenant, count in running.items():
        if tenant != waiting_tenant and count and count / weights[tenant] > load:
            victim, load = tenant, count / weights[tenant]
    return victim


class VirtualClock:
    """Weighted fair order over the tenants with work now: each tenant's work so far divided by its
    weight. A tenant that becomes active starts at the least clock of the active ones, so an idle
    spell earns no credit to monopolise later."""

    def __init__(self) -> None:
        self._clock: dict[str, float] = {}

    def activate(self, tenants: Iterable[str]) -> None:
        """Forget tenants with no work now; start newcomers at the current minimum."""
        active = set(tenants)
        for tenant in [t for t in self._clock if t not in active]:
            del self._clock[tenant]
        start = min(self._clock.values(), default=0.0)
        for tenant in active:
            self._clock.setdefault(tenant, start)

    def key(self, tenant: str) -> float:
        return self._clock.get(tenant, 0.0)

    def charge(self, tenant: str, work: float, weight: float) -> None:
        self._clock[tenant] = self._clock.get(tenant, 0.0) + work / weight
