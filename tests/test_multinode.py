"""The multi-node scenarios (fusion.tools.cluster_scenarios), short, with the tiny experts: a real Ray
cluster of three nodes on this machine (`ray start`: a head and two workers carrying `fusion-expert`),
the application placed by resources, a worker node killed under four greedy streams, the node's
replicas back when a node joins again, and a rolling update of the fusion config under streams."""

from __future__ import annotations

import os

import pytest

from fusion.tools import cluster_scenarios as sc
from fusion.tools.ray_cluster import LocalRayCluster
from tests.conftest import tiny_config_dict
from tests.reference import assert_greedy_equivalent

SAMPLING = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["what is 12 + 35 ?", "def add", "hello world , fusion", "the quick brown fox"]


@pytest.fixture(scope="module")
def three_nodes(tiny_dir, tmp_path_factory):
    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with LocalRayCluster(tmp_path_factory.mktemp("ray-nodes"), head_cpus=1) as cluster:
        for name in ("w1", "w2"):
            cluster.add_worker(name, num_cpus=1, resources={sc.EXPERT_RESOURCE: 1})
        cluster.connect(logging_level="WARNING", log_to_driver=False)
        try:
            config = tiny_config_dict(tiny_dir)
            args = sc.placement_args(config, replicas=2)
            yield cluster, args, sc.deploy(args)
        finally:
            serve.shutdown()
            ray.shutdown()
            os.environ.pop("RAY_ADDRESS", None)  # (ray.init sets it for child processes)


def test_experts_are_placed_by_resources_and_survive_a_node_loss(three_nodes, tiny_service):
    cluster, args, address = three_nodes
    placed = sc.replica_nodes()
    workers = {cluster.nodes["w1"].node_id, cluster.nodes["w2"].node_id}
    assert set(placed) == {"a", "b", "c"}
    for expert, nodes in placed.items():  # two replicas each, one on each worker, none on the head
        assert sorted(nodes) == sorted(workers), expert

    # every replica's metrics are reachable where the registry says, labelled with its replica and node
    scraped = sc.scraped_replicas()
    assert len(scraped) == 6
    for replica in scraped:
        assert replica["served"] == replica["target"] and replica["served"]["node"] in workers

    figures = sc.node_loss(cluster, address, PROMPTS, SAMPLING, victim="w2", replicas=2, kill_after_tokens=4)
    assert figures["lost"] == 0, figures["errors"]
    assert figures["replicas_on_the_lost_node"] == {"a": 1, "b": 1, "c": 1}
    assert figures["longest_gap_s"] > 0 and figures["replicas_back_after_rejoin_s"] > 0
    # every stream finished with the tokens of the undisturbed run (up to near ties: the failover's
    # re-prefill computes the history in another shape; see tests.reference)
    for prompt, tokens in zip(PROMPTS, figures["tokens"]):
        assert_greedy_equivalent(tiny_service, prompt, tokens, tiny_service.complete(prompt, SAMPLING).token_ids)
    placed = sc.replica_nodes()
    assert all(cluster.nodes["w2-again"].node_id in nodes for nodes in placed.values())


def test_a_rolling_update_loses_no_stream_and_new_requests_see_the_new_config(three_nodes):
    from services.client import FusionClient

    cluster, args, address = three_nodes

    def rule(at: str) -> str:
        with FusionClient(at, timeout=60) as client:
            return client.describe().default_spec.rule

    new_config = {**args["config"], "fusion": {"rule": "mixture"}}
    figures = sc.rolling_update(address, {**args, "config": new_config}, PROMPTS, SAMPLING, rule)
    assert figures["lost"] == 0, figures["errors"]
    assert (figures["before"], figures["after"]) == ("weighted_logits", "mixture")

