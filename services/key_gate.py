"""`KeyGate`: the per-key gate with no transport in it. It authenticates a key and enforces the key's
limits: concurrent calls (Generate and Score each hold a slot), its share of the service's slots
(`limits.key_share` of `max_concurrent_sessions`, so one key never takes every slot while another
waits). `KeyGate.tenant` gives the runtime the key as a `Tenant`: its weight in every queue, its max
tokens per request, and its tokens per minute as a quota on which the service reserves a request's
tokens at admission (`KeyQuota`, a sliding 60 s window; settled with what the request used). Keyed
hashes are checked inline in microseconds; wrong secrets are rate-limited per key id, and legacy PBKDF2
checks also globally, refused before any hashing past the rate and run on their own bounded executor.
Its per-key state is bounded by the configured keys. Per-key usage counters (`fusion_key_*`) carry
the key id, never the key. The gRPC adapter is `fusion.services.grpc_auth`; the HTTP API calls the gate
itself and answers `Refusal.http_status` (401, 429 with Retry-After)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter

from fusion.config import Limits, SecurityConfig
from fusion.errors import InvalidArgumentError, ServiceBusyError
from fusion.engine.tenancy import LOCAL, Tenant
from fusion.services.api_keys import API_KEY_HEADER, ApiKey, ApiKeyStore, is_slow_hash

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
_ANONYMOUS = "-"  # key id label of callers without a valid key (never their key or a made-up id)


# Failed authentication, per key id: a burst of wrong secrets, then one every 1 / rate seconds.
# What a refusal for a key's slots suggests to wait: a slot frees when a call ends, which no one knows.
STREAM_RETRY_S = 1.0
FAILURE_BURST_PER_KEY = 5
FAILURES_PER_S_PER_KEY = 0.2
# Legacy PBKDF2 verifications of wrong keys, over all ids: a burst, then this rate.
SLOW_VERIFY_BURST = 10
SLOW_VERIFIES_PER_S = 1.0
SLOW_VERIFY_WORKERS = 1
SLOW_VERIFY_CAPACITY = 4  # PBKDF2 verifications running or waiting; past that, refused at once


class KeyMetrics:
    """Per-key counters (key id label only, never the key)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("fusion_key_requests", "Authenticated requests, by API key id and method",
                                ["key_id", "method"], registry=registry)
        self.tokens = Counter("fusion_key_tokens", "Tokens charged to tokens_per_minute (prompts, generated and "
                              "scored tokens), by API key id", ["key_id"], registry=registry)
        self.refusals = Counter("fusion_key_refusals", "Refused requests, by API key id ('-': no valid key) and reason",
                                ["key_id", "reason"], registry=registry)
        self.slow_verifications = Counter("fusion_key_slow_verifications",
                                          "Legacy PBKDF2 key verifications run (bounded and rate-limited)",
                                          registry=registry)


@dataclass
class _Usage:
    """A key's open streams and its tokens over the last WINDOW_S seconds, in one-second buckets: at
    most WINDOW_S + 1 entries per key, whether or not the key has a tokens_per_minute limit."""

    streams: int = 0
    tokens: deque = field(default_factory=deque)  # [monotonic time of the bucket's first token, count]
    window_total: int = 0

    def tokens_in_window(self, now: float) -> int:
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.window_total -= self.tokens.popleft()[1]
        return self.window_total

    def add_tokens(self, now: float, count: int) -> list:
        """Count `count` tokens now; the bucket they went into."""
        if self.tokens and now - self.tokens[-1][0] < 1.0:  # the current one-second bucket
            self.tokens[-1][1] += count
        else:
            self.tokens.append([now, count])
        self.window_total += count
        self.tokens_in_window(now)  # trims what left the window
        return self.tokens[-1] if self.tokens else [now, 0]

    def give_back(self, bucket: list, count: int, now: float) -> None:
        """Take `count` tokens out of `bucket` if it is still in the window (else they left already)."""
        self.tokens_in_window(now)
        if count > 0 and any(b is bucket for b in self.tokens):
            bucket[1] -= count
            self.window_total -= count

    def wait_until_free(self, tokens: int, now: float) -> float:
        """Seconds until `tokens` of the window's tokens have left it."""
        freed = 0
        for start, count in self.tokens:
            freed += count
            if freed >= tokens:
                return max(0.0, start + WINDOW_S - now)
        return WINDOW_S


class TokenBucket:
    """`burst` tokens, refilled at `rate` per second."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, float(burst), now

    def _refill(self, now: float) -> None:
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def available(self, now: float, count: float = 1.0) -> bool:
        self._refill(now)
        return self.tokens >= count

    def take(self, now: float, count: float = 1.0) -> bool:
        if not self.available(now, count):
            return False
        self.tokens -= count
        return True

    def give_back(self) -> None:
        self.tokens = min(float(self.burst), self.tokens + 1.0)

    def wait_s(self, now: float, count: float = 1.0) -> float:
        self._refill(now)
        return 0.0 if self.tokens >= count else (count - self.tokens) / self.rate


class SlowVerifier:
    """Runs slow (legacy PBKDF2) verifications on its own executor: `workers` threads and at most
    `capacity` verifications running or waiting, counted until the thread finishes one (a caller that
    goes away does not free its place early); past that, `run` answers None at once. Never the event
    loop's shared default executor, so a flood of guesses cannot delay other work that uses it."""

    def __init__(self, workers: int = SLOW_VERIFY_WORKERS, capacity: int = SLOW_VERIFY_CAPACITY) -> None:
        self.workers, self.capacity = workers, capacity
        self._pool: ThreadPoolExecutor | None = None
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    def _done(self, _future) -> None:
        with self._lock:
            self._pending -= 1

    async def run(self, fn: Callable[..., bool], *args: Any) -> bool | None:
        with self._lock:
            if self._pending >= self.capacity:
                return None
            self._pending += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fusion-key-verify")
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_CALLER: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("fusion_key_tenant", default=None)


def current_tenant() -> Tenant:
    """The tenant of the gRPC call in progress (its API key, set by `ApiKeyInterceptor` around the
    handler, in the call's task); the local tenant without API keys."""
    return _CALLER.get() or LOCAL


UNAUTHENTICATED, RESOURCE_EXHAUSTED = "unauthenticated", "resource_exhausted"
_GRPC_CODES = {UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED, RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED}
_HTTP_CODES = {UNAUTHENTICATED: 401, RESOURCE_EXHAUSTED: 429}


class Refusal(Exception):
    """Why the gate refuses a call: `status` is UNAUTHENTICATED or RESOURCE_EXHAUSTED (as a gRPC code:
    `grpc_code`; as an HTTP status: `http_status`); `reason` labels the refusal metric;
    `retry_after_s`, when a retry can succeed, says when."""

    def __init__(self, status: str, message: str, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.reason, self.retry_after_s = status, message, reason, retry_after_s

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES[self.status]

    @property
    def http_status(self) -> int:
        return _HTTP_CODES[self.status]


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The key in `authorization: Bearer <key>` or `x-api-key: <key>` (header names in lower case)."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None
    return headers.get(API_KEY_HEADER) or None


class KeyStream:
    """One admitted call of a key (a stream or a Score): holds one of its slots until `close`
    (idempotent)."""

    def __init__(self, gate: KeyGate, record: ApiKey, usage: _Usage) -> None:
        self.gate, self.record, self.usage = gate, record, usage
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.gate._stream_closed(self.record.key_id, self.usage)


class KeyReservation:
    """Tokens a key's window holds for one request, added to the second they were reserved in; `settle`
    gives back what the request did not use."""

    def __init__(self, gate: KeyGate, record: ApiKey, usage: _Usage, bucket: list, tokens: int) -> None:
        self.gate, self.record, self.usage, self.bucket, self.tokens = gate, record, usage, bucket, tokens

    def settle(self, used: int) -> None:
        used = max(0, min(used, self.tokens))
        with self.gate.lock:
            self.usage.give_back(self.bucket, self.tokens - used, self.gate.clock())
        self.gate.metrics.tokens.labels(key_id=self.record.key_id).inc(used)


class KeyQuota:
    """A key's tokens_per_minute as the runtime's `Quota`: a request reserves what it may use (its
    prompt and max_tokens; a Score its prompt and continuation) before any work."""

    def __init__(self, gate: KeyGate, record: ApiKey) -> None:
        self.gate, self.record = gate, record

    def reserve(self, tokens: int) -> KeyReservation:
        gate, record = self.gate, self.record
        limit = record.limits.tokens_per_minute
        with gate.lock:
            usage = gate.usage(record.key_id)
            now = gate.clock()
            if limit is not None:
                if tokens > limit:
                    gate.metrics.refusals.labels(key_id=record.key_id, reason="tokens_per_minute").inc()
                    raise InvalidArgumentError(
                        f"max_tokens: the request needs {tokens} tokens (prompt + max_tokens) and API key "
                        f"{record.key_id!r} has tokens_per_minute={limit}: ask for fewer tokens")
                used = usage.tokens_in_window(now)
                if used + tokens > limit:
                    wait = usage.wait_until_free(used + tokens - limit, now)
                    gate.metrics.refusals.labels(key_id=record.key_id, reason="tokens_per_minute").inc()
                    raise ServiceBusyError(
                        f"API key {record.key_id!r}: tokens_per_minute {limit} would be exceeded ({used} used in "
                        f"the last {WINDOW_S:g} s, this request needs {tokens}); retry in {math.ceil(wait)} s",
                        retry_after_s=wait)
            bucket = usage.add_tokens(now, tokens)
        return KeyReservation(gate, record, usage, bucket, tokens)


class KeyGate:
    """The per-key gate of a front end, with no transport in it: `authenticate` a key, `open_stream`
    or `check_rate` under the key's limits, count tokens. The gRPC `ApiKeyInterceptor` is a thin
    adapter over it; an HTTP front end would call the same methods and answer `Refusal.http_status`.

    Authentication costs microseconds: keyed hashes are checked inline. Wrong secrets are
    rate-limited per key id (a token bucket, FAILURE_BURST_PER_KEY then FAILURES_PER_S_PER_KEY);
    past it a wrong secret gets RESOURCE_EXHAUSTED. A fast hash is still checked then (a microsecond),
    so someone guessing at a public key id cannot lock out its holder. Legacy PBKDF2 hashes are the
    costly case: past the per-id or the global rate (SLOW_VERIFY_BURST, SLOW_VERIFIES_PER_S) the
    attempt is refused before any hashing, and the verifications that do run go to a bounded
    `SlowVerifier`, never the shared default executor; a legacy key that verified once is
    recognised by its SHA-256 fingerprint from then on (one entry per key id).

    Every per-key map (usage, failure buckets, verified legacy keys) holds only ids of the store's
    keys and is pruned when the keys file changes: wrong keys, however many, add no state."""

    def __init__(self, store: ApiKeyStore, registry: CollectorRegistry, *,
                 max_concurrent_sessions: int | None = None, key_share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, verifier: SlowVerifier | None = None,
                 failure_burst: int = FAILURE_BURST_PER_KEY, failures_per_s: float = FAILURES_PER_S_PER_KEY,
                 slow_burst: int = SLOW_VERIFY_BURST, slow_per_s: float = SLOW_VERIFIES_PER_S) -> None:
        self.store = store
        self.metrics = KeyMetrics(registry)
        self.max_concurrent_sessions, self.key_share = max_concurrent_sessions, key_share
        # limits.key_share: the streams one key may hold of the service's slots (at least one)
        self.streams_per_key = (None if max_concurrent_sessions is None
                                else max(1, math.floor(key_share * max_concurrent_sessions + 1e-9)))
        self.clock = clock
        self.verifier = verifier or SlowVerifier()
        self.failure_burst, self.failures_per_s = failure_burst, failures_per_s
        self._slow = TokenBucket(slow_per_s, slow_burst, clock())
        self._usage: dict[str, _Usage] = {}
        self.lock = threading.Lock()  # windows are reserved from admission threads and settled anywhere
        self._failures: dict[str, TokenBucket] = {}
        self._verified: dict[str, tuple[bytes, str]] = {}  # key id -> (sha256 of its key, the hash it matched)
        self._generation = store.generation
        self._known = store.key_ids()

    @classmethod
    def from_config(cls, security: SecurityConfig | None, registry: CollectorRegistry, *,
                    limits: Limits | None = None) -> KeyGate | None:
        """The gate of the config's keys (None without keys); `limits` gives key_share of
        max_concurrent_sessions."""
        store = ApiKeyStore.from_config(security)
        if store is None:
            return None
        limits = limits or Limits()
        return cls(store, registry, max_concurrent_sessions=limits.max_concurrent_sessions,
                   key_share=limits.key_share)

    def close(self) -> None:
        self.verifier.close()

    # -- state, bounded by the store's key ids ----------------------------------------------------
    def usage(self, key_id: str) -> _Usage:
        return self._usage.setdefault(key_id, _Usage())

    def state_sizes(self) -> dict[str, int]:
        return {"usage": len(self._usage), "failures": len(self._failures), "verified": len(self._verified)}

    def _prune(self) -> None:
        if self.store.generation == self._generation:
            return
        self._generation, self._known = self.store.generation, self.store.key_ids()
        for table in (self._failures, self._verified):
            for key_id in [k for k in table if k not in self._known]:
                del table[key_id]
        for key_id in [k for k, usage in self._usage.items() if k not in self._known and not usage.streams]:
            del self._usage[key_id]

    def _stream_closed(self, key_id: str, usage: _Usage) -> None:
        usage.streams -= 1
        if not usage.streams and key_id not in self._known and self._usage.get(key_id) is usage:
            del self._usage[key_id]

    # -- authentication -----------------------------------------------------------------------------
    def _unauthenticated(self, message: str, reason: str, key_id: str = _ANONYMOUS) -> Refusal:
        self.metrics.refusals.labels(key_id=key_id, reason=reason).inc()
        return Refusal(UNAUTHENTICATED, message, reason)

    def _too_many_failures(self, key_id: str, wait_s: float, scope: str) -> Refusal:
        self.metrics.refusals.labels(key_id=_ANONYMOUS, reason="auth_rate_limited").inc()
        return Refusal(RESOURCE_EXHAUSTED, f"too many failed attempts {scope} (key id {key_id!r}); retry in "
                       f"{max(1, math.ceil(wait_s))} s", "auth_rate_limited", max(wait_s, 0.001))

    def _failures_of(self, key_id: str, now: float) -> TokenBucket:
        bucket = self._failures.get(key_id)
        if bucket is None:
            bucket = self._failures[key_id] = TokenBucket(self.failures_per_s, self.failure_burst, now)
        return bucket

    async def authenticate(self, key: str | None) -> ApiKey:
        """The record of a valid, unrevoked key; else raises Refusal (UNAUTHENTICATED, or
        RESOURCE_EXHAUSTED past the rate of failed attempts or when slow verification is busy)."""
        if key is None:
            raise self._unauthenticated("an API key is required: send 'authorization: Bearer <key>' or "
                                        "'x-api-key: <key>'", "no_key")
        record = self.store.lookup(key)
        self._prune()
        if record is None:
            raise self._unauthenticated("unknown API key", "bad_key")
        if is_slow_hash(record.hash):
            valid = await self._verify_slow(key, record)
        else:
            valid = self.store.verify(key, record)
            if not valid:
                now = self.clock()
                bucket = self._failures_of(record.key_id, now)
                if not bucket.take(now):
                    raise self._too_many_failures(record.key_id, bucket.wait_s(now), "for this key")
        if not valid:
            raise self._unauthenticated("unknown API key", "bad_key")
        if record.revoked:
            raise self._unauthenticated(f"API key {record.key_id!r} is revoked", "revoked", record.key_id)
        return record

    async def _verify_slow(self, key: str, record: ApiKey) -> bool:
        fingerprint = hashlib.sha256(key.encode("utf-8", "replace")).digest()
        if self._verified.get(record.key_id) == (fingerprint, record.hash):
            return True
        now = self.clock()
        bucket = self._failures_of(record.key_id, now)
        if not bucket.available(now):
            raise self._too_many_failures(record.key_id, bucket.wait_s(now), "for this key")
        if not self._slow.available(now):
            raise self._too_many_failures(record.key_id, self._slow.wait_s(now), "on legacy-hashed keys")
        bucket.take(now)  # charged before hashing, so concurrent guesses cannot pass the rate; given back if right
        self._slow.take(now)
        valid = await self.verifier.run(self.store.verify, key, record)
        if valid is None:
            bucket.give_back()
            self._slow.give_back()
            self.metrics.refusals.labels(key_id=_ANONYMOUS, reason="auth_busy").inc()
            raise Refusal(RESOURCE_EXHAUSTED, "key verification is busy (a legacy-hashed key); retry shortly",
                          "auth_busy", STREAM_RETRY_S)
        self.metrics.slow_verifications.inc()
        if valid:
            bucket.give_back()
            self._slow.give_back()
            if record.key_id in self._known:
                self._verified[record.key_id] = (fingerprint, record.hash)
        return valid

    # -- limits ------------------------------------------------------------------------------------
    def count_request(self, record: ApiKey, method: str) -> None:
        self.metrics.requests.labels(key_id=record.key_id, method=method).inc()

    def refuse(self, record: ApiKey, limit: str, message: str, retry_after_s: float | None = None) -> Refusal:
        self.metrics.refusals.labels(key_id=record.key_id, reason=limit).inc()
        return Refusal(RESOURCE_EXHAUSTED, f"API key {record.key_id!r}: {limit} {message}", limit, retry_after_s)

    def tenant(self, record: ApiKey) -> Tenant:
        """The key as the runtime sees it: its weight, its per-request cap and its token quota."""
        limits = record.limits
        return Tenant(record.key_id, float(limits.weight or 1.0), limits.max_tokens_per_request,
                      KeyQuota(self, record))

    @contextlib.contextmanager
    def calling_as(self, record: ApiKey) -> Iterator[None]:
        """Within: `current_tenant()` is `record`'s key (the handler runs in the same task)."""
        token = _CALLER.set(self.tenant(record))
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):  # a stream closed from another context (a finalizer)
                _CALLER.reset(token)

    def check_rate(self, record: ApiKey) -> None:
        """Raises Refusal, with the time until tokens leave it, while the key's window is used up."""
        limit = record.limits.tokens_per_minute
        if limit is not None:
            usage, now = self.usage(record.key_id), self.clock()
            used = usage.tokens_in_window(now)
            if used >= limit:
                wait = usage.wait_until_free(used - limit + 1, now)
                raise self.refuse(record, "tokens_per_minute", f"limit {limit} reached ({used} tokens in the "
                                  f"last {WINDOW_S:g} s); retry in {math.ceil(wait)} s", retry_after_s=wait)

    def open_stream(self, record: ApiKey) -> KeyStream:
        """Admit a call of the key (a stream or a Score) into one of its slots, or raise Refusal naming
        the limit. Its tokens are reserved at admission (`KeyQuota`), once they are known."""
        limits = record.limits
        self.check_rate(record)
        usage = self.usage(record.key_id)
        if limits.max_concurrent_streams is not None and usage.streams >= limits.max_concurrent_streams:
            raise self.refuse(record, "max_concurrent_streams",
                              f"limit {limits.max_concurrent_streams} reached; wait for a call to end",
                              retry_after_s=STREAM_RETRY_S)
        if self.streams_per_key is not None and usage.streams >= self.streams_per_key:
            raise self.refuse(record, "key_share",
                              f"{self.key_share:g} of max_concurrent_sessions {self.max_concurrent_sessions} "
                              f"allows {self.streams_per_key} calls per key and {usage.streams} are open; "
                              "wait for one to end", retry_after_s=STREAM_RETRY_S)
        usage.streams += 1
        return KeyStream(self, record, usage)
