"""The builder's arguments (a serve YAML's `args:`), read once and checked: which fusion config,
where models live, the ports, and per-deployment options (replicas or autoscaling, CPUs, health
checks, shutdown grace).

The fusion config is the same YAML the local build reads (`fusion.config`), given as a path or
inline as a mapping (what a KubeRay `serveConfigV2` embeds). GPUs are never set here: each expert
deployment asks for its expert's `num_gpus` from the fusion config.

Replica counts and autoscaling set here are the application's defaults. In a serve YAML they are
better set in the application's `deployments:` section (by deployment name: `expert-<name>`,
`coordinator`): Serve applies a change there without restarting replicas, while any change to
`args` restarts all of them.

Autoscaling works on load the deployments report themselves (sessions on an expert replica,
requests on a coordinator; see `fusion.deploy.autoscaling`), because the decode traffic runs over the
services' own gRPC channels, which Serve does not see. `target_ongoing_requests` is therefore read as
sessions per replica, and an `autoscaling_config` given here gets that policy unless it names one
(one given in a `deployments:` section must name it: `fusion.deploy.autoscaling:fusion_load_policy`).

`min_replicas: 0` is refused for the experts and the coordinator: a deployment scaled to zero
reports no load, so that policy never asks for a replica again, and the coordinator would have no
replica to call (nor the clients a coordinator). Keep `min_replicas` at 1 or more in a serve YAML's
`deployments:` section too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fusion.config import FusionConfig, format_validation_error, load_config, parse_config
from fusion.errors import ConfigError

LOAD_POLICY = "fusion.deploy.autoscaling:fusion_load_policy"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentOptions(_Strict):
    """Serve options of one deployment; unset fields keep the defaults (or the broader setting)."""

    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    num_cpus: float | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, ge=0)  # bytes reserved per replica (Ray's accounting)
    resources: dict[str, float] | None = None  # custom Ray resources, e.g. pin the coordinator to a group
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    health_check_period_s: float | None = Field(default=None, gt=0)
    health_check_timeout_s: float | None = Field(default=None, gt=0)
    graceful_shutdown_timeout_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> DeploymentOptions:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give either num_replicas or autoscaling_config, not both")
        return self

    def over(self, base: DeploymentOptions) -> DeploymentOptions:
        """These options layered over `base` (set fields win)."""
        mine = self.model_dump(exclude_unset=True)
        merged = base.model_dump(exclude_unset=True) | mine
        if "num_replicas" in mine:
            merged.pop("autoscaling_config", None)
        if "autoscaling_config" in mine:
            merged.pop("num_replicas", None)
        return DeploymentOptions(**merged)

    def serve_options(self, num_gpus: float = 0.0) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus if self.num_cpus is not None else 1.0}
        if num_gpus:
            actor["num_gpus"] = num_gpus
        if self.memory is not None:
            actor["memory"] = self.memory
        if self.resources:
            actor["resources"] = dict(self.resources)
        out: dict[str, Any] = {"ray_actor_options": actor}
        if self.autoscaling_config is not None:
            autoscaling = dict(self.autoscaling_config)
            autoscaling.setdefault("policy", {"policy_function": LOAD_POLICY})
            out["autoscaling_config"] = autoscaling
        elif self.num_replicas is not None:  # else Serve's default (1), or a serve YAML's `deployments:`
            out["num_replicas"] = self.num_replicas
        for name in ("max_replicas_per_node", "health_check_period_s", "health_check_timeout_s",
                     "graceful_shutdown_timeout_s"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class RegistryOptions(_Strict):
    num_cpus: float = Field(default=0.0, ge=0)
    resources: dict[str, float] | None = None

    def serve_options(self) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        return {"ray_actor_options": actor}


class DeployArgs(_Strict):
    config: str | dict[str, Any]  # a fusion config: a YAML path, or the config itself
    cache_dir: str | None = None  # model cache for `builtin:` refs (default: $FUSION_CACHE_DIR or XDG)
    # Interface the replicas' gRPC servers bind: loopback for one machine; a cluster binds 0.0.0.0 and
    # needs the config's expert secret or client certificates, or insecure_experts on a trusted network.
    host: str = "127.0.0.1"
    insecure_experts: bool = False
    port: int = Field(default=50051, ge=0, le=65535)  # the coordinator's Fusion port; 0 picks a free one
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # coordinator /metrics
    http_port: int | None = Field(default=None, ge=0, le=65535)  # the coordinator's OpenAI-compatible HTTP API
    expert_metrics_port: int | None = Field(default=None, ge=0, le=65535)  # each expert replica's /metrics
    # The registry's HTTP service discovery for Prometheus (GET /targets: every replica's /metrics)
    targets_port: int | None = Field(default=None, ge=0, le=65535)
    refresh_s: float = Field(default=2.0, gt=0)  # how often the coordinator re-reads the replica set
    heartbeat_s: float = Field(default=2.0, gt=0)  # how often an expert replica re-registers
    registry_ttl_s: float = Field(default=10.0, gt=0)  # a replica not heard from for this long is dropped
    startup_timeout_s: float = Field(default=900.0, gt=0)  # coordinator: wait this long for every expert
    grace_s: float = Field(default=20.0, ge=0)  # in-flight RPCs may finish for this long on shutdown
    expert: DeploymentOptions = Field(default_factory=DeploymentOptions)  # every expert deployment
    experts: dict[str, DeploymentOptions] = Field(default_factory=dict)  # per expert name, over `expert`
    coordinator: DeploymentOptions = Field(default_factory=DeploymentOptions)
    # Where the registry runs: `resources` (or `num_cpus`) to keep it with the coordinator, on a node
    # that outlives the expert nodes. One replica always (it is the table).
    registry: RegistryOptions = Field(default_factory=lambda: RegistryOptions())

    @model_validator(mode="after")
    def _registry_outlives_heartbeats(self) -> DeployArgs:
        if self.registry_ttl_s <= self.heartbeat_s:
            raise ValueError(f"registry_ttl_s ({self.registry_ttl_s}) must exceed heartbeat_s ({self.heartbeat_s})")
        return self

    @model_validator(mode="after")
    def _never_scale_to_zero(self) -> DeployArgs:
        where = [("expert", self.expert), ("coordinator", self.coordinator)]
        where += [(f"experts.{name}", options) for name, options in self.experts.items()]
        for field, options in where:
            min_replicas = (options.autoscaling_config or {}).get("min_replicas", 1)
            if not isinstance(min_replicas, int) or min_replicas < 1:
                raise ValueError(
                    f"{field}.autoscaling_config.min_replicas must be at least 1, got {min_replicas!r}: a deployment "
                    "scaled to zero reports no load, so it is never scaled up again and the coordinator has no "
                    "replica to call")
        return self

    def fusion_config(self) -> FusionConfig:
        config = load_config(self.config) if isinstance(self.config, str) else parse_config(self.config)
        unknown = sorted(set(self.experts) - set(config.expert_names))
        if unknown:
            raise ConfigError(f"args.experts names unknown experts {unknown}; known: {config.expert_names}")
        with_addresses = [e.name for e in config.experts if e.addresses]
        if with_addresses:
            raise ConfigError(f"experts {with_addresses} list addresses; on Ray Serve the expert replicas are "
                              "found by the coordinator, so leave addresses empty")
        return config

    def expert_options(self, name: str) -> DeploymentOptions:
        own = self.experts.get(name)
        return own.over(self.expert) if own is not None else self.expert

    def expert_runtime(self) -> ExpertRuntime:
        return ExpertRuntime(cache_dir=self.cache_dir, host=self.host, metrics_port=self.expert_metrics_port,
                             heartbeat_s=self.heartbeat_s, grace_s=self.grace_s, insecure=self.insecure_experts)

    def coordinator_runtime(self) -> CoordinatorRuntime:
        return CoordinatorRuntime(cache_dir=self.cache_dir, host=self.host, port=self.port,
                                  metrics_port=self.metrics_port, http_port=self.http_port, refresh_s=self.refresh_s,
                                  startup_timeout_s=self.startup_timeout_s, grace_s=self.grace_s)


# What a replica is constructed with, and nothing more.
class ExpertRuntime(_Strict):
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    insecure: bool = False
    metrics_port: int | None = None
    heartbeat_s: float = 2.0
    grace_s: float = 20.0


class CoordinatorRuntime(_Strict):
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    http_port: int | None = None
    refresh_s: float = 2.0
    startup_timeout_s: float = 900.0
    grace_s: float = 20.0


def parse_args(args: dict[str, Any] | DeployArgs | None) -> DeployArgs:
    if isinstance(args, DeployArgs):
        return args
    try:
        return DeployArgs.model_validate(dict(args or {}))
    except ValidationError as err:
        raise ConfigError(f"deploy args: {format_validation_error(err)}") from None
