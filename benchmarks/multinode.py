"""The service on a real multi-node Ray cluster on this machine: a head and two worker nodes started
with `ray start` (each its own process group, the workers carrying the `fusion-expert` resource), the
config's experts deployed with two replicas each on distinct workers, then

1. node loss: STREAMS greedy streams run while worker w2 is killed whole (SIGKILL to its raylet and
   every process on it); streams lost, streams with the undisturbed run's tokens, the longest token
   gap; how long until the coordinator drops the lost replicas, and until a node joining again has
   them back in use;
2. rolling update: the application deployed again with another fusion rule while STREAMS streams
   run; streams lost, how long the update took, whether a new request sees the new rule;
3. autoscaling: each expert autoscaled on the sessions it holds (1 to 2 replicas, 2 sessions per
   replica); STREAMS streams of ten times TOKENS ramp up one a second: time until every expert has two
   replicas, until it is back to one once they end, and the p95 gap between tokens during the ramp
   against one stream;
4. coordinator loss: two nodes carrying `fusion-coordinator` join, the coordinator moves onto one of
   them with a fixed port, and that node is killed while STREAMS streams run: how the streams end
   (UNAVAILABLE, none hanging), how long until the same address answers again from the other node,
   and whether the streams asked again there get the undisturbed run's tokens.

Every expert is made batch-invariant (`batch_invariant: true`: a history computed again on another replica
gives the lost one's bits, so failed-over greedy streams keep their tokens; docs/configuration.md) unless
--no-batch-invariant, which keeps the config as it is.

    python benchmarks/multinode.py --json benchmarks/results/multinode.json     # the default trio (fetched first)
    python benchmarks/multinode.py --config my.yaml --streams 8 --tokens 48
    python benchmarks/multinode.py --scenarios coordinator_loss --no-batch-invariant
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

import yaml

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Replicas report their load every half second instead of every ten (the nodes pass it on).
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")


SCENARIOS = ("node_loss", "rolling_update", "autoscaling", "coordinator_loss")


def main() -> None:
    from fusion.models import default_cache_dir
    from fusion.tools import cluster_scenarios as sc
    from fusion.tools.assets import prepare_model
    from fusion.tools.loading import DEFAULT_CONFIG
    from fusion.tools.ray_cluster import LocalRayCluster, free_port
    from fusion.tools.step_timing import emit_figures
    from fusion.services.client import FusionClient

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(DEFAULT_CONFIG))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {','.join(SCENARIOS)}")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                        help="make every expert batch-invariant (default), or keep the config's setting")
    options = parser.parse_args()
    chosen = set(options.scenarios.split(","))
    if chosen - set(SCENARIOS):
        parser.error(f"--scenarios: unknown {sorted(chosen - set(SCENARIOS))}; known: {list(SCENARIOS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache = default_cache_dir()
    config = yaml.safe_load(options.config.read_text())
    for expert in config["experts"]:
        prepare_model(expert["model"], cache)  # fetched once here, not by six replicas at once
        if options.batch_invariant:
            expert["batch_invariant"] = True
    sampling = {"max_tokens": options.tokens, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"Question {i}: what is {12 + i} + {35 + 2 * i}? Explain the steps." for i in range(options.streams)]

    import ray
    from ray import serve

    figures = {"batch_invariant": options.batch_invariant}
    with tempfile.TemporaryDirectory() as workdir, LocalRayCluster(Path(workdir), head_cpus=1) as cluster:
        for name in ("w1", "w2"):
            cluster.add_worker(name, num_cpus=1, resources={sc.EXPERT_RESOURCE: 1})
        cluster.connect(logging_level="WARNING", log_to_driver=False)
        try:
            args = sc.placement_args(config, replicas=2, cache_dir=str(cache))
            address = sc.deploy(args)
            figures["placement"] = {e: len(set(n)) for e, n in sc.replica_nodes().items()}
            if "node_loss" in chosen:
                node = sc.node_loss(cluster, address, prompts, sampling, victim="w2", replicas=2)
                node.pop("tokens")
                figures["node_loss"] = node

            def rule(at: str) -> str:
                with FusionClient(at, timeout=120) as client:
                    return client.describe().default_spec.rule

            current = config.get("fusion", {}).get("rule", "weighted_logits")
            changed = {**config, "fusion": {"rule": "mixture" if current != "mixture" else "weighted_logits"}}
            if "rolling_update" in chosen:
                update = sc.rolling_update(address, {**args, "config": changed}, prompts, sampling, rule)
                figures["rolling_update"] = update
            longer = {**sampling, "max_tokens": 4 * options.tokens}
            if "autoscaling" in chosen:
                address = sc.deploy(sc.autoscaling_args(args, max_replicas=2, sessions_per_replica=2))
                sc.wait_until(lambda: all(n == 1 for n in sc.running_replicas().values()) or sc.running_replicas(),
                              "one replica per expert to start from", timeout_s=300)
                # Streams that outlast a new replica's start (tens of seconds here): at four times --tokens
                # (192) the trio's streams once ended before every expert had its second replica.
                ramp = {**sampling, "max_tokens": 10 * options.tokens}
                figures["autoscaling"] = sc.autoscaling(address, prompts, ramp, max_replicas=2)
            if "coordinator_loss" in chosen:
                for name in ("c1", "c2"):
                    cluster.add_worker(name, num_cpus=1, resources={sc.COORDINATOR_RESOURCE: 1})
                address = sc.deploy(sc.coordinator_args(args, free_port()))
                lost = sc.coordinator_loss(cluster, address, prompts, longer)
                for key in ("tokens", "tokens_again"):
                    lost.pop(key)
                figures["coordinator_loss"] = lost
        finally:
            serve.shutdown()
            ray.shutdown()
    emit_figures(figures, options.json)


if __name__ == "__main__":
    main()
