"""The coordinator deployment: `fusion.services.coordinator` serving the Fusion gRPC service to clients and,
with `http_port`, the OpenAI-compatible HTTP API on its own port (uvicorn in the replica, not Serve's
HTTP proxy: docs/deployment.md, "The HTTP API on Ray Serve").

At start it waits until every expert has a registered replica of the version its config names
(same model, dtype, device; see `fusion.deploy.registry`), then builds the service with one
`RemoteExpert` per expert over those replicas' addresses and serves on `port` (fixed, so a
Kubernetes Service and probes can find it). Every `refresh_s` it re-reads the registry and hands
each expert's current replica list to its `RemoteExpert` (`set_addresses`): new replicas take new
sessions, sessions stay pinned to their replica (its KV cache), and a step that fails on a replica
(killed, draining, past the deadline) is resent to another one, which re-prefills the history.

- `check_health`: the server's own gRPC health service must report SERVING, dialled with the config's
  TLS settings (health needs no API key, as for Kubernetes probes); with `http_port`, the HTTP API's
  `/health` must answer 200 too.
- `record_autoscaling_stats`: requests in flight (what `fusion.deploy.autoscaling` scales on).
- `__del__` (Serve's graceful shutdown): NOT_SERVING, streams in flight get `grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import urllib.request
from pathlib import Path
from typing import Any

import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve

from fusion.deploy._replica import ServerLoop, advertised_host
from fusion.deploy.registry import expert_version
from fusion.deploy.settings import CoordinatorRuntime
from fusion.config import FusionConfig, parse_config
from fusion.errors import ExpertUnavailableError
from fusion.models import model_resolver
from fusion.services import tracing
from fusion.services.coordinator import create_coordinator_server
from fusion.services.metrics import label_replica
from fusion.services.protos import FUSION_SERVICE
from fusion.services.remote_expert import RemoteExpert
from fusion.services.tls import open_channel

logger = logging.getLogger(__name__)

COORDINATOR_DEPLOYMENT = "coordinator"


def with_addresses(config: FusionConfig, addresses: dict[str, list[str]]) -> FusionConfig:
    """The config with each expert's replica addresses filled in (experts then run remotely)."""
    experts = [e.model_copy(update={"addresses": list(addresses[e.name])}) for e in config.experts]
    return config.model_copy(update={"experts": experts})


@serve.deployment(name=COORDINATOR_DEPLOYMENT, health_check_period_s=10.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=60.0)
class CoordinatorReplica:
    async def __init__(self, config: dict[str, Any], registry, runtime: dict[str, Any],
                       experts: dict[str, Any] | None = None) -> None:
        settings = CoordinatorRuntime(**runtime)
        fusion_config = parse_config(config)
        tracing.configure(service_name="fusion-coordinator")  # on where the replica's OTEL_* variables say
        self._registry = registry
        self.expert_handles = experts or {}  # Serve handles of the expert deployments
        self._grace = settings.grace_s
        self._closed = True
        self.versions = {e.name: expert_version(e) for e in fusion_config.experts}  # replicas of these only
        addresses = await self._wait_for_experts(fusion_config.expert_names, settings.startup_timeout_s)
        self._security = fusion_config.security  # the health probe dials as clients do (TLS)
        self._loop = ServerLoop()
        http = f"{settings.host}:{settings.http_port}" if settings.http_port is not None else None
        self._running, port = await self._loop.call(create_coordinator_server(
            with_addresses(fusion_config, addresses), model_resolver(settings.cache_dir),
            f"{settings.host}:{settings.port}", settings.metrics_port, settings.host,
            Path(settings.cache_dir) if settings.cache_dir else None, http,
        ))
        self.address = f"{advertised_host(settings.host)}:{port}"
        http_port = self._running.http_port
        self.http = f"{advertised_host(settings.host)}:{http_port}" if http_port is not None else None
        self.service = self._running.servicer.service
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.node = ray.get_runtime_context().get_node_id()
        self._metrics_labels = {"deployment": COORDINATOR_DEPLOYMENT, "replica": self.replica_id, "node": self.node}
        label_replica(self._running.metrics.registry, **self._metrics_labels)
        metrics_port = self._running.metrics_port
        self.metrics_address = f"{advertised_host(settings.host)}:{metrics_port}" if metrics_port is not None else ""
        self.remote_experts = {e.name: e for e in self.service.experts if isinstance(e, RemoteExpert)}
        self._channel = None
        self._closed = False
        self._refresher = asyncio.create_task(self._refresh(settings.refresh_s))
        logger.info("fusion coordinator serving on %s (experts %s)", self.address, addresses)

    async def _wait_for_experts(self, names: list[str], timeout_s: float) -> dict[str, list[str]]:
        deadline = time.monotonic() + timeout_s
        while True:
            addresses = await self._registry.addresses.remote(self.versions)
            missing = [n for n in names if not addresses.get(n)]
            if not missing:
                return addresses
            if time.monotonic() > deadline:
                raise ExpertUnavailableError(f"no replica of experts {missing} registered within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    async def _refresh(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                addresses = await asyncio.wait_for(self._registry.addresses.remote(self.versions),
                                                   timeout=max(period_s, 5.0))
            except Exception as err:  # the registry restarting: keep the replicas we know
                logger.warning("reading the replica registry failed: %s", err)
                continue
            for name, remote in self.remote_experts.items():
                remote.set_addresses(addresses.get(name, []))
            if self.metrics_address:  # listed with the experts' for Prometheus (the registry's TTL drops it)
                try:
                    await self._registry.register_metrics.remote(self.replica_id, self.metrics_address,
                                                                 self._metrics_labels)
                except Exception as err:
                    logger.warning("listing the coordinator's metrics failed: %s", err)

    # -- what Serve and callers ask -------------------------------------------------------------
    def grpc_address(self) -> str:
        return self.address

    def http_address(self) -> str | None:
        """host:port of the OpenAI-compatible HTTP API (None: `http_port` not set)."""
        return self.http

    def node_id(self) -> str:
        """The Ray node this replica runs on (which node's loss takes it)."""
        return self.node

    def replica_addresses(self) -> dict[str, list[str]]:
        """The replicas each expert's sessions are spread over now."""
        return {name: remote.addresses for name, remote in self.remote_experts.items()}

    def failovers(self) -> dict[str, int]:
        return {name: remote.failovers for name, remote in self.remote_experts.items()}

    async def check_health(self) -> None:
        if self._closed:
            raise RuntimeError("the coordinator is shutting down")
        await self._loop.call(self._probe())

    async def _probe(self) -> None:
        if self._channel is None:
            self._channel = open_channel(self.address, self._security, aio=True)
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=FUSION_SERVICE), timeout=10.0)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            raise RuntimeError(f"the Fusion service reports {status}")
        if self.http is not None:
            await asyncio.to_thread(self._probe_http)

    def _probe_http(self) -> None:
        """GET /health of the HTTP API, as the Kubernetes readiness probe does (raises unless 200)."""
        context = None
        if not self._security.plaintext and self._security.tls is not None:  # unverified, like kubelet's probe
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        scheme = "http" if context is None else "https"
        with urllib.request.urlopen(f"{scheme}://{self.http}/health", timeout=10.0, context=context) as reply:
            reply.read()

    def record_autoscaling_stats(self) -> dict[str, float]:
        from fusion.deploy.autoscaling import LOAD_METRIC

        return {LOAD_METRIC: float(self.service.active)}

    # -- shutdown ---------------------------------------------------------------------------------
    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._refresher.cancel()

        self._loop.shut_down(self._running, self._channel, self._grace)
