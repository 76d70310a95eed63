"""The Kubernetes manifests: they parse, their kinds and required fields are right, and their ports,
names, resources and replica bounds agree with the embedded Serve config and deploy/serve-gpu.yaml."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'logit-fusion[ray]'")

from fusion.deploy.settings import parse_args

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "k8s" / "rayservice.yaml"


@pytest.fixture(scope="module")
def docs():
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]


def one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def service(docs):
    return one(docs, "RayService")


@pytest.fixture(scope="module")
def serve_config(service):
    return yaml.safe_load(service["spec"]["serveConfigV2"])


@pytest.fixture(scope="module")
def settings(serve_config):
    [app] = serve_config["applications"]
    return parse_args(app["args"])


def autoscaling(serve_config, settings, deployment: str, options):
    """A deployment's autoscaling config: the serve YAML's `deployments:` override, else the args'."""
    [app] = serve_config["applications"]
    for override in app.get("deployments", []):
        if override["name"] == deployment and "autoscaling_config" in override:
            return override["autoscaling_config"]
    return options.autoscaling_config


def group(service, name):
    [found] = [g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == name]
    return found


def container(group_spec):
    [only] = group_spec["template"]["spec"]["containers"]
    return only


def ports(c):
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def test_kinds_and_api_versions(docs):
    assert sorted((d["apiVersion"], d["kind"]) for d in docs) == sorted([
        ("ray.io/v1", "RayService"),
        ("v1", "Service"),
        ("v1", "Service"),
        ("v1", "Service"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("policy/v1", "PodDisruptionBudget"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    ])
    for d in docs:
        assert d["metadata"]["name"] and d["metadata"]["labels"]["app.kubernetes.io/name"] == "logit-fusion"


def test_embedded_serve_config_is_serve_gpu_yaml(serve_config):
    from ray.serve.schema import ServeDeploySchema

    assert serve_config == yaml.safe_load((ROOT / "deploy" / "serve-gpu.yaml").read_text())
    ServeDeploySchema.model_validate(serve_config)
    [app] = serve_config["applications"]
    assert app["import_path"] == "fusion.deploy.app:build_app"


def test_ray_version_and_image(service):
    import ray

    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    images = {container(g)["image"] for g in cluster["workerGroupSpecs"]}
    images.add(cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"])
    assert len(images) == 1  # one image everywhere
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile


def test_every_container_has_requests_and_limits(service):
    cluster = service["spec"]["rayClusterConfig"]
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [container(g) for g in cluster["workerGroupSpecs"]]
    for c in containers:
        for key in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][key]), c["name"]
    auto = cluster["autoscalerOptions"]["resources"]
    assert {"cpu", "memory"} <= set(auto["requests"]) and {"cpu", "memory"} <= set(auto["limits"])


def test_gpu_group_matches_the_experts(service, serve_config, settings):
    config = settings.fusion_config()
    gpu = group(service, "gpu")
    resources = container(gpu)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    # Every expert on the GPU with its captured step; the trio shares one GPU, its KV slots and weights within it.
    assert all(0 < e.num_gpus <= 1 and e.device == "cuda" and e.decode == "fast" for e in config.experts)
    assert sum(e.num_gpus for e in config.experts) <= 1
    assert sum(e.kv_memory_fraction for e in config.experts) <= 0.75
    # Enough GPU pods for every expert's min and max replicas (fractions of a GPU packed onto pods).
    scaling = [autoscaling(serve_config, settings, f"expert-{e.name}", settings.expert_options(e.name))
               for e in config.experts]
    assert all(s is not None and s["min_replicas"] >= 1 for s in scaling)  # never scaled to zero
    assert gpu["minReplicas"] >= math.ceil(sum(s["min_replicas"] * e.num_gpus for s, e in zip(scaling, config.experts)))
    assert gpu["maxReplicas"] >= math.ceil(sum(s["max_replicas"] * e.num_gpus for s, e in zip(scaling, config.experts)))
    # The pod's CPUs hold its expert replicas' (three to a GPU).
    per_gpu = math.floor(1 / min(e.num_gpus for e in config.experts))
    assert per_gpu * settings.expert_options(config.experts[0].name).num_cpus <= int(resources["requests"]["cpu"])
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    assert ports(container(gpu))["fusion-metrics"] == settings.expert_metrics_port


def test_coordinator_group_port_probe_and_resource(service, serve_config, settings):
    coordinator = group(service, "coordinator")
    c = container(coordinator)
    assert ports(c) == {"grpc-fusion": settings.port, "http-fusion": settings.http_port,
                        "fusion-metrics": settings.metrics_port}
    # One probe for both APIs: the HTTP /health answers 200 only while the gRPC health of the Fusion
    # service reports SERVING (fusion.services.coordinator).
    probe = c["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": "http-fusion", "scheme": "HTTPS"}  # the tls section is on
    assert "grpc" not in c["readinessProbe"]
    # The custom resource that pins one coordinator replica to each pod of this group.
    offered = yaml.safe_load(yaml.safe_load(coordinator["rayStartParams"]["resources"]))
    assert settings.coordinator.resources == offered == {"fusion_coordinator": 1}
    assert settings.coordinator.max_replicas_per_node == 1
    scaling = autoscaling(serve_config, settings, "coordinator", settings.coordinator)
    assert coordinator["minReplicas"] >= scaling["min_replicas"]
    assert coordinator["maxReplicas"] >= scaling["max_replicas"]
    # Shutdown fits in the pod's grace period: preStop drain, then Serve's graceful stop.
    grace = coordinator["template"]["spec"]["terminationGracePeriodSeconds"]
    pre_stop = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert int(pre_stop.rsplit("sleep", 1)[1].split()[0]) < grace
    assert settings.grace_s < settings.coordinator.graceful_shutdown_timeout_s <= grace


def test_head_has_no_probe_of_ours_and_no_cpus(service):
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    # KubeRay submits the Serve config only to a ready head: a probe on the coordinator port there
    # would never pass.
    assert "readinessProbe" not in head["template"]["spec"]["containers"][0]
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_port_names_kuberay_leaves_alone(service):
    # KubeRay replaces a container port named `metrics` with Ray's own metrics port.
    for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert "metrics" not in ports(container(g))
        assert all(len(name) <= 15 for name in ports(container(g)))


def test_services_reach_ready_coordinators(docs, service, settings):
    labels = group(service, "coordinator")["template"]["metadata"]["labels"]
    for name in ("logit-fusion-grpc", "logit-fusion-grpc-headless"):
        svc = one(docs, "Service", name)
        assert svc["spec"]["selector"].items() <= labels.items()
        [port] = svc["spec"]["ports"]
        assert port["port"] == settings.port and port["targetPort"] == "grpc-fusion"
    assert one(docs, "Service", "logit-fusion-grpc-headless")["spec"]["clusterIP"] == "None"
    http = one(docs, "Service", "logit-fusion-http")
    assert http["spec"]["selector"].items() <= labels.items()
    [port] = http["spec"]["ports"]
    assert port["port"] == settings.http_port and port["targetPort"] == "http-fusion"
    budget = one(docs, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_pod_monitor_scrapes_named_ports_that_exist(docs, service):
    monitor = one(docs, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for g in groups:
        assert selector.items() <= g["template"]["metadata"]["labels"].items()
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert "fusion-metrics" in scraped
    for g in groups:
        assert "fusion-metrics" in ports(container(g))
    assert scraped - {"fusion-metrics"} == {"metrics"}  # Ray's own, added by KubeRay


VALIDATOR = ROOT / "tests" / "data" / "kuberay" / "validate_rayservice.py"  # with KubeRay's CRD beside it


def test_rayservice_validates_against_kuberay_crd():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(VALIDATOR), str(VALIDATOR.parent / "ray.io_rayservices.yaml"),
                          str(MANIFEST)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_security_is_on_with_secrets_from_kubernetes(service, serve_config, settings):
    """TLS, API keys and the expert secret, each read from a Secret the pods mount or map to env."""
    security = settings.fusion_config().security
    assert not security.plaintext and security.tls is not None
    assert security.api_keys_env == "FUSION_API_KEYS" and security.expert_secret_env == "FUSION_EXPERT_SECRET"
    assert settings.host == "0.0.0.0" and not settings.insecure_experts
    for name, env_names in (("coordinator", {"FUSION_API_KEYS", "FUSION_EXPERT_SECRET"}),
                            ("gpu", {"FUSION_EXPERT_SECRET"})):
        spec = group(service, name)["template"]["spec"]
        c = container(group(service, name))
        from_secrets = {e["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert env_names <= from_secrets
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        tls_volume = volumes[mounts["/etc/fusion/tls"]]
        assert tls_volume["secret"]["secretName"] == "logit-fusion-tls"
        for path in (security.tls.cert_file, security.tls.key_file, security.tls.ca_file):
            assert path.startswith("/etc/fusion/tls/")
    probe = container(group(service, "coordinator"))["readinessProbe"]["httpGet"]
    assert probe["scheme"] == "HTTPS"


def test_network_policies_keep_experts_and_head_inside(docs, service):
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    internal = policies["logit-fusion-internal"]
    selected = {e["key"]: set(e["values"]) for e in internal["podSelector"]["matchExpressions"]}
    assert selected["app.kubernetes.io/component"] == {"head", "expert"}
    for rule in internal["ingress"]:  # every way in names who may come: the cluster's pods or monitoring
        assert rule.get("from"), rule
    coordinator = policies["logit-fusion-coordinator"]
    open_rule = [r for r in coordinator["ingress"] if "from" not in r]
    assert [sorted(p["port"] for p in r["ports"]) for r in open_rule] == [["grpc-fusion", "http-fusion"]]
    named = set(ports(container(group(service, "coordinator"))))
    assert {"grpc-fusion", "http-fusion", "fusion-metrics"} <= named
