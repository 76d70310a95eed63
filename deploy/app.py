"""The Ray Serve application, built from the same YAML config as the local build.

    registry ◄── register / heartbeat ── expert-<name> × replicas   (Expert gRPC server each)
        ▲                                        ▲
        └──── addresses, every refresh_s ─── coordinator ── Fusion gRPC, OpenAI HTTP ◄── clients

`build_app(args)` is what a serve YAML's `import_path: fusion.deploy.app:build_app` calls with its `args:`
(see `fusion.deploy.settings.DeployArgs`), and what Python code calls before `serve.run`. `run_local`
starts it on a local Ray cluster and blocks until Ctrl-C (the `fusion deploy` command).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable

from ray import serve
from ray.serve import Application

from fusion.deploy.coordinator import COORDINATOR_DEPLOYMENT, CoordinatorReplica
from fusion.deploy.expert import ExpertReplica, expert_deployment_name
from fusion.deploy.registry import ReplicaRegistry
from fusion.deploy.settings import DeployArgs, parse_args

logger = logging.getLogger(__name__)

APP_NAME = "fusion"

__all__ = ["APP_NAME", "build_app", "run_local", "coordinator_address", "coordinator_http_address",
           "expert_deployment_name",
           "COORDINATOR_DEPLOYMENT"]


def build_app(args: dict[str, Any] | DeployArgs) -> Application:
    """The registry, one deployment per expert (GPUs from the expert's `num_gpus`) and the coordinator
    (the application's ingress)."""
    settings = parse_args(args)
    if settings.cache_dir is None and os.environ.get("FUSION_CACHE_DIR"):
        settings = settings.model_copy(update={"cache_dir": os.environ["FUSION_CACHE_DIR"]})
    config = settings.fusion_config()
    registry = ReplicaRegistry.options(**settings.registry.serve_options()).bind(
        settings.registry_ttl_s, settings.host, settings.targets_port)
    # Each replica gets only what it needs: its expert's config, limits and security, or the whole
    # config for the coordinator. (Serve restarts every replica when `args` change; replica counts and
    # autoscaling changed in a serve YAML's `deployments:` section restart none.)
    expert_runtime = settings.expert_runtime().model_dump()
    limits = config.limits.model_dump()
    security = config.security.model_dump()
    experts = {}
    for expert in config.experts:
        options = settings.expert_options(expert.name).serve_options(num_gpus=expert.num_gpus)
        deployment = ExpertReplica.options(name=expert_deployment_name(expert.name), **options)
        experts[expert.name] = deployment.bind(expert.model_dump(), limits, registry, expert_runtime, security)
    coordinator = CoordinatorReplica.options(**settings.coordinator.serve_options())
    return coordinator.bind(config.model_dump(), registry, settings.coordinator_runtime().model_dump(),
                            experts=experts)


def coordinator_address(app_name: str = APP_NAME, timeout_s: float = 60.0) -> str:
    """host:port of a coordinator replica's Fusion service."""
    handle = serve.get_deployment_handle(COORDINATOR_DEPLOYMENT, app_name)
    return handle.grpc_address.remote().result(timeout_s=timeout_s)


def coordinator_http_address(app_name: str = APP_NAME, timeout_s: float = 60.0) -> str | None:
    """host:port of a coordinator replica's OpenAI-compatible HTTP API (None: no `http_port`)."""
    handle = serve.get_deployment_handle(COORDINATOR_DEPLOYMENT, app_name)
    return handle.http_address.remote().result(timeout_s=timeout_s)


def run_local(
    args: dict[str, Any] | DeployArgs,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    app_name: str = APP_NAME,
    on_ready: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> None:
    """Deploy on Ray (a new local cluster, or the one at `address`) and block until SIGINT/SIGTERM or
    `stop` is set; then delete the application, shutting Serve and a cluster started here down."""
    import ray

    settings = parse_args(args)
    app = build_app(settings)  # config errors surface before Ray starts
    own_cluster = address is None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # "local": a cluster of its own, never one that `ray start` left running on this machine.
    ray.init(address=address or "local", num_cpus=num_cpus, include_dashboard=False if own_cluster else None,
             logging_level=logging.WARNING)
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        if own_cluster:
            serve.start(proxy_location="Disabled")  # clients use the coordinator's own gRPC and HTTP ports
        serve.run(app, name=app_name, route_prefix=None)
        http = coordinator_http_address(app_name)
        on_ready(coordinator_address(app_name) + (f", HTTP API on {http}" if http else ""))
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            if own_cluster:
                serve.shutdown()
            else:
                serve.delete(app_name)
        finally:
            ray.shutdown()
