"""The Grafana dashboard shipped in k8s/: every query reads a metric the servers export (or Prometheus'
own `up`), every variable it uses is defined, and the sidecar's ConfigMap holds the same dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from fusion.services.key_gate import KeyMetrics
from fusion.services.metrics import CoordinatorMetrics, ExpertMetrics, label_replica

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "k8s" / "grafana-dashboard.json"
CONFIGMAP = ROOT / "k8s" / "grafana-dashboard-configmap.yaml"
# Series suffixes Prometheus' exposition adds to each metric family's name, by its type.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("", "_sum", "_count", "_created")}
# What a query holds besides series names: label lists, label matchers, ranges, strings, functions.
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
NOT_NAMES = re.compile(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"")
IDENTIFIER = re.compile(r"(?<![\w.$:])[A-Za-z_:][A-Za-z0-9_:]*(?![\w:])(?!\s*\()")


def exported_series() -> set[str]:
    """Every series name the coordinator's and the expert replicas' registries expose."""
    coordinator = CoordinatorMetrics()
    KeyMetrics(coordinator.registry)
    expert = ExpertMetrics()
    expert.track_cache(lambda: dict.fromkeys(
        ["cached_tokens", "reused_tokens", "computed_tokens", "evictions", "prefix_kept_tokens",
         "prefix_adopted_tokens", "decode_batches_in_place", "decode_batches_rebuilt"], 0))
    replicas = CollectorRegistry()
    label_replica(replicas, deployment="coordinator", expert="a", replica="r", node="n")
    names = set()
    for registry in (coordinator.registry, expert.registry, replicas):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def series_in(expr: str) -> set[str]:
    stripped = NOT_NAMES.sub(" ", LABEL_LISTS.sub(" ", expr))
    return set(IDENTIFIER.findall(stripped))


def queries(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(series, label): the series is the query
            found.append(re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"]).group(1))
    return found


def test_every_query_reads_a_series_the_servers_export():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series() | {"up"}  # `up`: Prometheus' own, per scraped replica
    assert {"fusion_queue_wait_seconds_bucket", "fusion_key_tokens_total", "fusion_expert_cached_tokens"} <= exported
    exprs = queries(dashboard)
    assert len(exprs) >= 20
    read = set()
    for expr in exprs:
        names = series_in(expr)
        assert names, expr
        assert names <= exported, (expr, names - exported)
        read |= names
    # the list: latency, queue time, tokens, refusals, sessions and cache, replica health
    for needed in ("fusion_time_to_first_token_seconds_bucket", "fusion_inter_token_latency_seconds_bucket",
                   "fusion_queue_wait_seconds_bucket", "fusion_key_tokens_total", "fusion_key_refusals_total",
                   "fusion_active_sessions", "fusion_expert_cached_tokens", "up"):
        assert needed in read, needed


def test_the_query_check_catches_a_misspelt_series():
    assert series_in('sum by (key_id) (rate(fusion_key_tokenz_total{key_id=~"$key_id"}[$__rate_interval]))') \
        == {"fusion_key_tokenz_total"}
    assert series_in("histogram_quantile(0.95, sum by (le) (rate(fusion_x_bucket[5m])))") == {"fusion_x_bucket"}
    assert series_in("a * on(instance) group_left(expert) b") == {"a", "b"}


def test_variables_are_defined_and_panels_have_a_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    for expr in queries(dashboard):
        for used in re.findall(r"\$(\w+)", expr):
            assert used in defined or used.startswith("__"), (used, expr)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_the_configmap_holds_the_same_dashboard_for_the_sidecar():
    configmap = yaml.safe_load(CONFIGMAP.read_text())
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    [(name, text)] = configmap["data"].items()
    assert name.endswith(".json")
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
