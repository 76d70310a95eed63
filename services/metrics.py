"""Prometheus metrics for the expert server and the coordinator, one registry per server.

A per-server `CollectorRegistry` lets tests and benchmarks run several servers in one process.
Names follow Prometheus conventions: a `fusion_` prefix, base units (`_seconds`), `_total` counters.
`serve_metrics(registry, port)` exposes `/metrics` over HTTP (port 0 picks a free port).
"""

from __future__ import annotations

import time
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fusion.engine.types import StepTimings

# Decode steps of small models take milliseconds on a GPU and up to a second or so on a CPU.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """What both servers count: requests by method and status code, and active sessions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "fusion_requests", "RPCs finished, by method and gRPC status code", ["method", "code"],
            registry=self.registry,
        )
        self.active_sessions = Gauge(
            "fusion_active_sessions", "Sessions (requests, or cached expert sessions) alive now",
            registry=self.registry,
        )
        self.expert_step = Histogram(
            "fusion_expert_step_seconds", "Wall time of one expert step (a batched forward pass)", ["expert"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )

    def count_request(self, method: str, code: grpc.StatusCode) -> None:
        self.requests.labels(method=method, code=code.name).inc()

    def track_sessions(self, count: Callable[[], float]) -> None:
        self.active_sessions.set_function(count)


class ExpertMetrics(ServerMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.batch_size = Histogram(
            "fusion_expert_batch_sessions", "Sessions stepped together in one forward pass",
            buckets=_BATCH_BUCKETS, registry=self.registry,
        )
        self.wire_bytes = Counter(
            "fusion_expert_response_bytes", "Logits bytes sent to callers", registry=self.registry,
        )
        self.dropped = Counter(
            "fusion_expert_dropped_sessions", "Queued session steps not computed: their caller's deadline "
            "passed or it went away first", registry=self.registry,
        )

    def track_cache(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry.register(ExpertCacheCollector(stats))


class ExpertCacheCollector(Collector):
    """The expert's KV cache, read at scrape time: ids cached now, prompt/history ids reused from the
    cache or computed, evictions, and batched decode steps run in place or on a rebuilt batch."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats()
        yield GaugeMetricFamily("fusion_expert_cached_tokens", "Ids whose keys/values the expert holds now",
                                value=stats["cached_tokens"])
        tokens = CounterMetricFamily("fusion_expert_prefix_tokens", "History ids of steps, by whether the KV "
                                     "cache served them or they were computed", labels=["outcome"])
        tokens.add_metric(["reused"], stats["reused_tokens"])
        tokens.add_metric(["computed"], stats["computed_tokens"])
        yield tokens
        yield CounterMetricFamily("fusion_expert_cache_evictions", "Sessions evicted under the KV budget",
                                  value=stats["evictions"])
        yield GaugeMetricFamily("fusion_expert_kept_prefix_tokens", "Ids of ended sessions kept for new sessions "
                                "that begin alike (prefix_cache_tokens)", value=stats["prefix_kept_tokens"])
        yield CounterMetricFamily("fusion_expert_adopted_prefix_tokens", "Ids new sessions took from kept "
                                  "prefixes instead of computing them", value=stats["prefix_adopted_tokens"])
        batches = CounterMetricFamily("fusion_expert_decode_batches", "Batched decode steps, by whether the "
                                      "batch of the previous step was reused in place or rebuilt", labels=["batch"])
        batches.add_metric(["in_place"], stats["decode_batches_in_place"])
        batches.add_metric(["rebuilt"], stats["decode_batches_rebuilt"])
        yield batches


class CoordinatorMetrics(ServerMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.time_to_first_token = Histogram(
            "fusion_time_to_first_token_seconds", "From receiving a Generate request to its first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "fusion_inter_token_latency_seconds", "Between consecutive tokens of one stream",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.decode_step = Histogram(
            "fusion_decode_step_seconds", "Wall time of one fused decode step of the whole batch",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.fusion_overhead = Histogram(
            "fusion_fuse_sample_seconds", "Alignment, fusion, sampling and attribution of one decode step",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue_wait = Histogram(
            "fusion_queue_wait_seconds", "From admission to the request's first batch slot, by API key id "
            "('-': no key)", ["key_id"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tokens = Counter(
            "fusion_generated_tokens", "Tokens generated for clients", registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "fusion_prompt_tokens", "Prompt tokens of admitted requests (the first expert's)",
            registry=self.registry,
        )
        self.http_requests = Counter(
            "fusion_http_requests", "HTTP API requests answered, by path and status (a stream: when it starts)",
            ["path", "status"], registry=self.registry,
        )

    def stream(self, received: float) -> StreamTimer:
        """The timer of one token stream of a request received at `received` (time.perf_counter)."""
        return StreamTimer(self, received)

    def observe_admission(self, request_id: str, tenant: str, waited_s: float) -> None:
        """The service's admission observer: how long a request waited for its batch slot."""
        self.queue_wait.labels(key_id=tenant or "-").observe(waited_s)

    def observe_step(self, timings: StepTimings) -> None:
        """The service's step observer: one decode step's timings."""
        self.decode_step.observe(timings.step_s)
        for name, seconds in timings.per_expert_s.items():
            self.expert_step.labels(expert=name).observe(seconds)
        if timings.fuse_sample_s:
            self.fusion_overhead.observe(timings.fuse_sample_s)


class StreamTimer:
    """One stream's tokens into the metrics: the first one's time from the request, each next one's
    from the one before, and the count."""

    __slots__ = ("metrics", "received", "last")

    def __init__(self, metrics: CoordinatorMetrics, received: float) -> None:
        self.metrics, self.received, self.last = metrics, received, None

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.received)
        else:
            self.metrics.inter_token_latency.observe(now - self.last)
        self.last = now
        self.metrics.tokens.inc()


def label_replica(registry: CollectorRegistry, **labels: str) -> None:
    """`fusion_replica_info{...} 1`: which replica and node these figures come from, joined onto any of
    them in a query (`* on(instance) group_left(replica, node) fusion_replica_info`)."""
    Gauge("fusion_replica_info", "Which replica and node serve these metrics", sorted(labels),
          registry=registry).labels(**labels).set(1)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0"):
    """Start `/metrics` on a daemon thread; returns (http_server, bound_port). Call `.shutdown()` to stop."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
