"""The multi-node scenarios (fusion.tools.cluster_scenarios), short, with the tiny experts: a real Ray
cluster on this machine (`ray start`: a head and two workers carrying `fusion-expert`), the
application placed by resources, every replica's metrics found through the registry's HTTP service
discovery, a worker node killed under four greedy streams, the node's replicas back when a node joins
again, a rolling update of the fusion config under streams, and the coordinator's node killed under
streams (two nodes carrying `fusion-coordinator` join for that). The experts are batch-invariant: a
history computed again on another replica gives the bits the lost one would have
(tests/test_batch_invariance.py), so streams that fail over or are asked again give exactly the
undisturbed tokens.

Every assertion here holds however fast the host is. Autoscaling is tested in tests/test_deploy.py:
the policy's answers deterministically, and Serve applying them on a real cluster; how fast a ramp of
clients scales a cluster up and down is a figure, measured by benchmarks/multinode.py."""

from __future__ import annotations

import os

import pytest

from fusion.tools import cluster_scenarios as sc
from fusion.tools.ray_cluster import LocalRayCluster, free_port
from tests.conftest import batch_invariant_config_dict
from tests.helpers import HANG_S, wait_until

# Node losses and rejoins wait for replicas to start again, which on a loaded 2-core host takes minutes.
pytestmark = pytest.mark.timeout(1800)

SAMPLING = {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["what is 12 + 35 ?", "def add", "hello world , fusion", "the quick brown fox"]


@pytest.fixture(scope="module")
def local_service(tiny_dir):
    """The same config in one process: the tokens every stream of the cluster must give."""
    from fusion.config import parse_config
    from fusion.frontdoor.service import FusionService

    service = FusionService.from_config(parse_config(batch_invariant_config_dict(tiny_dir)))
    yield service
    service.close()


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
            args = sc.placement_args(batch_invariant_config_dict(tiny_dir), replicas=2)
            yield cluster, args, sc.deploy(args)
        finally:
            serve.shutdown()
            ray.shutdown()
            os.environ.pop("RAY_ADDRESS", None)  # (ray.init sets it for child processes)


def test_experts_are_placed_by_resources_and_survive_a_node_loss(three_nodes, local_service):
    cluster, args, address = three_nodes
    placed = sc.replica_nodes()
    workers = {cluster.nodes["w1"].node_id, cluster.nodes["w2"].node_id}
    assert set(placed) == {"a", "b", "c"}
    for expert, nodes in placed.items():  # two replicas each, one on each worker, none on the head
        assert sorted(nodes) == sorted(workers), expert

    # every replica's metrics are reachable where the registry says, labelled with its replica and node:
    # the six expert replicas' on the workers, the coordinator's on the head
    # (listings are heartbeats: under load one may land a beat after the deployment reports ready)
    wait_until(lambda: len(sc.scraped_replicas()) == 7, interval_s=0.5, message="seven replicas listed")
    scraped = sc.scraped_replicas()
    assert len(scraped) == 7
    for replica in scraped:
        assert replica["served"] == replica["target"]
    experts = [r["served"] for r in scraped if "expert" in r["served"]]
    [coordinator] = [r["served"] for r in scraped if r["served"].get("deployment") == "coordinator"]
    assert len(experts) == 6 and all(r["node"] in workers for r in experts)
    assert coordinator["node"] == cluster.nodes["head"].node_id

    figures = sc.node_loss(cluster, address, PROMPTS, SAMPLING, victim="w2", replicas=2, kill_after_tokens=4)
    assert figures["lost"] == 0, figures["errors"]
    assert figures["replicas_on_the_lost_node"] == {"a": 1, "b": 1, "c": 1}
    assert figures["longest_gap_s"] > 0 and figures["replicas_back_after_rejoin_s"] > 0
    # every stream finished with the tokens of the undisturbed run, and of the same config in one process:
    # the replicas they failed over to computed their histories to the same bits
    assert figures["same_tokens_as_undisturbed"] == len(PROMPTS), figures["first_difference"]
    for prompt, tokens in zip(PROMPTS, figures["tokens"]):
        assert tokens == local_service.complete(prompt, SAMPLING).token_ids
    placed = sc.replica_nodes()
    assert all(cluster.nodes["w2-again"].node_id in nodes for nodes in placed.values())


def test_a_rolling_update_loses_no_stream_and_new_requests_see_the_new_config(three_nodes):
    from fusion.services.client import FusionClient

    cluster, args, address = three_nodes

    def rule(at: str) -> str:
        with FusionClient(at, timeout=HANG_S) as client:
            return client.describe().default_spec.rule

    new_config = {**args["config"], "fusion": {"rule": "mixture"}}
    figures = sc.rolling_update(address, {**args, "config": new_config}, PROMPTS, SAMPLING, rule)
    assert figures["lost"] == 0, figures["errors"]
    assert (figures["before"], figures["after"]) == ("weighted_logits", "mixture")


def test_the_coordinator_node_lost_under_streams_ends_them_unavailable_and_its_address_answers_again(
        three_nodes, local_service):
    cluster, args, _ = three_nodes
    for name in ("c1", "c2"):
        cluster.add_worker(name, num_cpus=1, resources={sc.COORDINATOR_RESOURCE: 1})
    port = free_port()
    address = sc.deploy(sc.coordinator_args(args, port))
    assert address.endswith(f":{port}")
    # long enough that streams are usually cut by the kill (at 200 tokens all four once finished before it)
    longer = {**SAMPLING, "max_tokens": 400}
    figures = sc.coordinator_loss(cluster, address, PROMPTS, longer, timeout_s=480)
    assert figures["hung"] == 0 and figures["other_errors"] == [], figures
    # every stream either ended with a clear UNAVAILABLE or had finished, with the undisturbed tokens
    # (how many of each depends on how fast the host decodes before the kill lands)
    assert figures["ended_unavailable"] + figures["finished_before_the_kill"] == len(PROMPTS)
    # the same address answers again, from the coordinator Serve started on the other node
    assert figures["new_coordinator_node"] in {"c1", "c2"} and figures["new_coordinator_node"] != figures["victim"]
    assert figures["asked_again_lost"] == 0
    for prompt, finished, again in zip(PROMPTS, figures["tokens"], figures["tokens_again"]):
        expected = local_service.complete(prompt, longer).token_ids
        for tokens in ([finished] if finished is not None else []) + [again]:
            assert tokens == expected
