"""One Serve deployment per expert; each replica is one `fusion.services.expert_server` on its node.

A replica loads its expert (on the GPU Ray gave it, when the expert config asks for `num_gpus`),
starts the Expert gRPC service on a free port, registers the address with the registry and
re-registers every `heartbeat_s`. The coordinator talks to it over that gRPC channel (logits as raw
bytes, continuous batching across sessions), not through Serve's request path.

- `check_health`: `grpc.health.v1` and `Info` through the replica's own gRPC server, dialled as the
  coordinator dials (TLS, client certificate, expert secret), so a wedged server or broken
  credentials fail it and Serve replaces the replica; and the model's worker thread must not have
  been on one job for more than `_WEDGED_AFTER_S` (a forward that never returns). Both answer on the
  server's event loop, never behind the worker: a long Score does not fail the check.
- `record_autoscaling_stats`: the sessions cached here (what `fusion.deploy.autoscaling` scales on).
- `Step`: the same batched step for a caller holding a Serve handle, or Serve's gRPC ingress.
- `__del__` (Serve's graceful shutdown): unregister, report NOT_SERVING, let in-flight steps finish
  for `grace_s`, then stop. A caller refused meanwhile fails over to another replica.

The config's `security` section applies as in `fusion serve-expert`: TLS server credentials, client
certificates when `tls.require_client_auth`, and the coordinator's shared secret on every gRPC call.
Its files (and `expert_secret_env`) are read on the replica's node. `Step` through a Serve handle is
not checked: it comes from inside the Ray cluster, and whoever reaches Ray can run code on it anyway.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
import logging
from typing import Any

import ray
from ray import serve

from fusion.deploy._replica import DirectContext, ServerLoop, advertised_host
from fusion.deploy.registry import expert_version
from fusion.deploy.settings import ExpertRuntime
from fusion.compute import compute_executor
from fusion.config import ExpertConfig, Limits, SecurityConfig
from fusion.experts.expert import LocalExpert
from fusion.models import model_resolver
from fusion.services import tracing
from fusion.services.expert_server import create_expert_server
from fusion.services.metrics import label_replica, serve_metrics
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fusion.services.protos import EXPERT_SERVICE, expert_pb2, expert_pb2_grpc
from fusion.services.expert_auth import expert_channel_metadata
from fusion.services.tls import open_channel
from fusion.services.serving import channel_options

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 10.0
# One job of the worker thread (a batched forward, a score chunk) running longer than this is taken for
# a wedged model: the slowest legitimate one, a prefill chunk or a score chunk of a few thousand ids on
# a CPU, takes well under a minute.
_WEDGED_AFTER_S = 300.0


def expert_deployment_name(expert: str) -> str:
    return f"expert-{expert}"


@serve.deployment(health_check_period_s=10.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=30.0)
class ExpertReplica:
    async def __init__(self, expert: dict[str, Any], limits: dict[str, Any], registry,
                       runtime: dict[str, Any], security: dict[str, Any] | None = None) -> None:
        expert_config, limits_config = ExpertConfig(**expert), Limits(**limits)
        self._security = SecurityConfig(**(security or {}))
        settings = ExpertRuntime(**runtime)
        self.name = expert_config.name
        self.version = expert_version(expert_config)
        tracing.configure(service_name=f"fusion-expert-{self.name}")  # on where OTEL_* variables say
        self._registry = registry
        self._grace = settings.grace_s
        self._closed = True  # until fully started: nothing for __del__ to stop
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.node = ray.get_runtime_context().get_node_id()
        model_path = model_resolver(settings.cache_dir)(expert_config.model)
        compiled = Path(settings.cache_dir) / "compiled" if settings.cache_dir else None
        local = await asyncio.to_thread(LocalExpert.load, expert_config, model_path, compiled)
        self._loop = ServerLoop()
        self._running, port = await self._loop.call(create_expert_server(
            local, limits_config, f"{settings.host}:0", security=self._security,
            worker=compute_executor(), insecure=settings.insecure))  # the replica's process: its compute thread (fusion.compute)
        label_replica(self._running.metrics.registry, expert=self.name, replica=self.replica_id, node=self.node)
        self.metrics_address = ""
        if settings.metrics_port is not None:
            self._serve_metrics(settings.metrics_port, settings.host)
            self.metrics_address = f"{advertised_host(settings.host)}:{self._running.metrics_port}"
        self.address = f"{advertised_host(settings.host)}:{port}"
        self._channel = None  # the health probe's, made on the server loop
        self._message_bytes = limits_config.max_message_bytes
        self._closed = False
        await self._register()
        self._heartbeat = asyncio.create_task(self._beat(settings.heartbeat_s))
        logger.info("expert %r replica %s serving on %s", self.name, self.replica_id, self.address)

    def _serve_metrics(self, port: int, host: str) -> None:
        """/metrics on the fixed port when free; several replicas on one node fall back to a free port."""
        try:
            http, bound = serve_metrics(self._running.metrics.registry, port, host)
        except OSError:
            http, bound = serve_metrics(self._running.metrics.registry, 0, host)
            logger.warning("expert %r: metrics port %d is taken on this node; serving /metrics on %d",
                           self.name, port, bound)
        self._running.metrics_port = bound
        self._running.on_stop(http.shutdown)

    # -- registration ---------------------------------------------------------------------------
    async def _register(self) -> None:
        await self._registry.register.remote(self.name, self.replica_id, self.address, self.version, self.node,
                                             self.metrics_address)

    async def _beat(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await asyncio.wait_for(self._register(), timeout=max(period_s, 5.0))
            except Exception as err:  # the registry restarting: the next beat registers again
                logger.warning("expert %r: registering %s failed: %s", self.name, self.address, err)

    # -- what Serve and callers ask -------------------------------------------------------------
    def grpc_address(self) -> str:
        return self.address

    def replica_info(self) -> dict[str, Any]:
        return {"expert": self.name, "replica_id": self.replica_id, "address": self.address, "version": self.version,
                "metrics_port": self._running.metrics_port, "sessions": self._running.servicer.expert.active_sessions}

    async def check_health(self) -> None:
        if self._closed:
            raise RuntimeError(f"expert {self.name!r} replica is shutting down")
        await self._loop.call(self._probe())

    async def _probe(self) -> None:
        """On the server loop: health and Info over gRPC, then the worker thread's progress."""
        if self._channel is None:
            self._channel = open_channel(self.address, self._security, channel_options(self._message_bytes),
                                         to_expert=True, metadata=expert_channel_metadata(self._security), aio=True)
        health = health_pb2_grpc.HealthStub(self._channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=EXPERT_SERVICE), timeout=_HEALTH_TIMEOUT_S)
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"expert {self.name!r}: health reports "
                               f"{health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}")
        info = await expert_pb2_grpc.ExpertStub(self._channel).Info(expert_pb2.InfoRequest(), timeout=_HEALTH_TIMEOUT_S)
        if info.name != self.name:
            raise RuntimeError(f"expert {self.name!r}: the replica's server reports expert {info.name!r}")
        busy = self._running.servicer.worker_busy_s()
        if busy > _WEDGED_AFTER_S:
            raise RuntimeError(f"expert {self.name!r}: the model has been on one job for {busy:.0f} s "
                               f"(more than {_WEDGED_AFTER_S:.0f} s): wedged")

    def record_autoscaling_stats(self) -> dict[str, float]:
        from fusion.deploy.autoscaling import LOAD_METRIC

        return {LOAD_METRIC: float(self._running.servicer.expert.active_sessions)}

    async def Step(self, request: expert_pb2.StepRequest) -> expert_pb2.StepResponse:
        """The Expert service's Step, for a Serve handle or Serve's gRPC ingress (batched with the
        gRPC callers' steps)."""
        return await self._loop.call(self._running.servicer.Step(request, DirectContext()))

    # -- shutdown ---------------------------------------------------------------------------------
    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._heartbeat.cancel()
        try:
            self._registry.unregister.remote(self.replica_id)  # not awaited: the entry expires anyway
        except Exception as err:
            logger.warning("expert %r: unregistering failed: %s", self.name, err)

        self._loop.shut_down(self._running, self._channel, self._grace)
