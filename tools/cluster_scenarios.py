"""Multi-node scenarios on a `LocalRayCluster` (fusion.tools.ray_cluster): the Serve application
placed by resources (expert replicas on the nodes that carry `fusion-expert`, at most one replica of
an expert per node; the coordinator and the registry on the head), then

- node loss: concurrent greedy streams run while a worker node is killed whole; each stream must finish,
  with the tokens of an undisturbed run; the longest gap between two tokens is the failover's cost;
  a node joining again gets the lost replicas back, and the coordinator uses them;
- rolling update: the application is deployed again with a changed fusion config while streams run;
  none may fail, and new requests see the new config;
- autoscaling: clients ramp up one by one, each asking back to back; every expert scales up to its
  maximum and back down to one replica once they stop;
- coordinator loss: the coordinator serves on a fixed port from one of two nodes that carry
  `fusion-coordinator`; that node is killed under streams: each stream ends UNAVAILABLE (or had
  finished), never hangs, and the same address answers again once Serve has started the coordinator
  on the other node, with the undisturbed run's tokens.

`benchmarks/multinode.py` runs them on the default trio and prints the figures; `tests/test_multinode.py`
runs a short version with tiny experts.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from fusion.tools.ray_cluster import LocalRayCluster

logger = logging.getLogger(__name__)

APP = "fusion"
EXPERT_RESOURCE = "fusion-expert"  # what worker nodes carry, as GPU nodes carry GPUs
HEAD_RESOURCE = "node-head"  # every node carries node-<name> (LocalRayCluster)
COORDINATOR_RESOURCE = "fusion-coordinator"  # what the nodes that may run the coordinator carry


def placement_args(config: dict[str, Any], *, replicas: int = 2, grace_s: float = 60.0, **overrides) -> dict[str, Any]:
    """Deploy args placing `replicas` replicas of each expert on distinct nodes that carry
    `EXPERT_RESOURCE`, and the coordinator and the registry on the head; quick heartbeats and refreshes,
    so that the coordinator learns a changed replica set within a second or two. A replaced coordinator
    lets its streams run for `grace_s` (a rolling update loses none that end within it)."""
    on_head = {HEAD_RESOURCE: 0.01}
    args = {
        "config": config, "port": 0, "grace_s": grace_s, "heartbeat_s": 1.0, "registry_ttl_s": 4.0, "refresh_s": 0.5,
        "metrics_port": 0, "expert_metrics_port": 0,  # every replica's /metrics on a free port, listed by the registry ...
        "targets_port": 0,  # ... which serves that list over HTTP, as Prometheus polls it
        "expert": {"num_replicas": replicas, "num_cpus": 0, "resources": {EXPERT_RESOURCE: 0.01},
                   "max_replicas_per_node": 1, "health_check_period_s": 2.0},
        "coordinator": {"num_replicas": 1, "num_cpus": 0, "resources": on_head,
                        "graceful_shutdown_timeout_s": grace_s + 30},
        "registry": {"num_cpus": 0, "resources": on_head},
    }
    args.update(overrides)
    return args


def deploy(args: dict[str, Any]) -> str:
    """Deploy (or update) the application on the connected cluster; the coordinator's gRPC address."""
    from ray import serve

    from fusion.deploy.app import build_app, coordinator_address

    serve.start(proxy_location="Disabled")
    serve.run(build_app(args), name=APP, route_prefix=None)
    return coordinator_address(APP)


def replica_nodes() -> dict[str, list[str]]:
    """Per expert, the Ray node id of each replica the registry lists."""
    from ray import serve

    out: dict[str, list[str]] = {}
    for entry in serve.get_deployment_handle("registry", APP).replicas.remote().result(timeout_s=30):
        out.setdefault(entry["expert"], []).append(entry["node"])
    return out


def scraped_replicas() -> list[dict[str, str]]:
    """Each scrape target the registry's HTTP service discovery lists (as Prometheus polls it), read:
    the labels of the `fusion_replica_info` it serves (and the target's own labels, to compare)."""
    import json
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from ray import serve

    from fusion.deploy.registry import TARGETS_PATH

    discovery = serve.get_deployment_handle("registry", APP).targets_address.remote().result(timeout_s=30)
    out = []
    for target in json.loads(urllib.request.urlopen(f"http://{discovery}{TARGETS_PATH}", timeout=10).read()):
        [address] = target["targets"]
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        served = [s.labels for family in text_string_to_metric_families(text) if family.name == "fusion_replica_info"
                  for s in family.samples]
        out.append({"target": target["labels"], "served": served[0] if len(served) == 1 else served})
    return out


@dataclass
class Stream:
    prompt: str
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str | None = None
    code: str | None = None  # the gRPC status of a failed stream

    @property
    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def run_streams(address: str, prompts: list[str], sampling: dict[str, Any], *, min_tokens: int = 1,
                timeout_s: float = 300.0) -> tuple[list[Stream], threading.Event, list[threading.Thread]]:
    """Start one client stream per prompt (threads); `ready` is set once every stream has `min_tokens`
    tokens. Returns the streams, that event and the threads to join."""
    from fusion.services.client import FusionClient

    streams = [Stream(p) for p in prompts]
    ready = threading.Event()
    lock = threading.Lock()

    def check_ready():
        with lock:
            if all(len(s.tokens) >= min_tokens or s.error for s in streams):
                ready.set()

    def run(stream: Stream) -> None:
        try:
            with FusionClient(address, timeout=timeout_s) as client:
                for event in client.generate(stream.prompt, sampling):
                    stream.tokens.append(event.token.token_id)
                    stream.times.append(time.monotonic())
                    check_ready()
        except Exception as err:  # a lost stream: what the scenario counts
            stream.error = f"{type(err).__name__}: {err}"
            cause = err.__cause__
            stream.code = cause.code().name if isinstance(cause, grpc.RpcError) else None
            check_ready()

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return streams, ready, threads


def streams_to_end(address: str, prompts: list[str], sampling: dict[str, Any]) -> list[Stream]:
    streams, _, threads = run_streams(address, prompts, sampling)
    for thread in threads:
        thread.join()
    return streams


def wait_until(condition, what: str, timeout_s: float, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last is True:
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s; last seen: {last}")


def coordinator_replicas() -> dict[str, int]:
    """How many replicas of each expert the coordinator uses now."""
    from ray import serve

    spread = serve.get_deployment_handle("coordinator", APP).replica_addresses.remote().result(timeout_s=30)
    return {name: len(addresses) for name, addresses in spread.items()}


def node_loss(cluster: LocalRayCluster, address: str, prompts: list[str], sampling: dict[str, Any], *,
              victim: str, replicas: int, kill_after_tokens: int = 4, rejoin_timeout_s: float = 600.0) -> dict[str, Any]:
    """The node-loss scenario (module docstring); its figures."""
    experts = sorted(coordinator_replicas())
    reference = streams_to_end(address, prompts, sampling)
    if any(s.error for s in reference):
        raise RuntimeError(f"the undisturbed run failed: {[s.error for s in reference if s.error]}")
    victim_id = cluster.nodes[victim].node_id
    on_victim = {expert: ids.count(victim_id) for expert, ids in replica_nodes().items()}
    streams, ready, threads = run_streams(address, prompts, sampling, min_tokens=kill_after_tokens)
    if not ready.wait(timeout=600):  # a hang bound: every stream past its first tokens before the kill
        raise TimeoutError("the streams did not reach their first tokens")
    killed_at = time.monotonic()
    resources = {k: v for k, v in cluster.nodes[victim].resources.items() if not k.startswith("node-")}
    cpus = cluster.nodes[victim].num_cpus
    cluster.kill(victim)
    for thread in threads:
        thread.join()
    finished = time.monotonic()
    lost = [s for s in streams if s.error or len(s.tokens) != len(reference[0].tokens)]
    same = sum(1 for s, r in zip(streams, reference) if not s.error and s.tokens == r.tokens)
    figures: dict[str, Any] = {
        "streams": len(streams), "lost": len(lost), "errors": [s.error for s in lost],
        "same_tokens_as_undisturbed": same,
        "first_difference": [_first_difference(s.tokens, r.tokens) for s, r in zip(streams, reference)],
        "longest_gap_s": max(s.longest_gap_s for s in streams),
        "longest_gap_undisturbed_s": max(s.longest_gap_s for s in reference),
        "replicas_on_the_lost_node": on_victim,
        "streams_finished_after_kill_s": finished - killed_at,
        "tokens": [s.tokens for s in streams],
    }
    # The coordinator drops the lost replicas (failed calls, then the registry's TTL) ...
    wait_until(lambda: all(n <= replicas - 1 for n in coordinator_replicas().values()) or coordinator_replicas(),
               "the coordinator dropping the lost replicas", timeout_s=180)
    figures["coordinator_dropped_lost_replicas_s"] = time.monotonic() - killed_at
    # ... and a node joining again gets them back.
    rejoined_at = time.monotonic()
    cluster.add_worker(f"{victim}-again", num_cpus=cpus, resources=resources)
    wait_until(lambda: coordinator_replicas() == {e: replicas for e in experts} or coordinator_replicas(),
               "the lost replicas back on the new node and in use", timeout_s=rejoin_timeout_s)
    figures["replicas_back_after_rejoin_s"] = time.monotonic() - rejoined_at
    return figures


def rolling_update(address: str, new_args: dict[str, Any], prompts: list[str],
                   sampling: dict[str, Any], describe, *, update_after_tokens: int = 3) -> dict[str, Any]:
    """The rolling-update scenario: streams run while `new_args` are deployed; `describe(address)` is
    what tells the old config from the new one in a fresh request's answer. Its figures, and the
    coordinator's address after the update."""
    streams, ready, threads = run_streams(address, prompts, sampling, min_tokens=update_after_tokens)
    if not ready.wait(timeout=600):  # a hang bound: every stream past its first tokens before the kill
        raise TimeoutError("the streams did not reach their first tokens")
    before = describe(address)
    started = time.monotonic()
    new_address = deploy(new_args)  # returns once the new version is running
    deployed_s = time.monotonic() - started
    for thread in threads:
        thread.join()
    after = describe(new_address)
    return {
        "streams": len(streams), "lost": sum(1 for s in streams if s.error or not s.tokens),
        "errors": [s.error for s in streams if s.error],
        "update_deployed_s": deployed_s, "new_config_seen": after != before, "before": before, "after": after,
        "address": new_address,
    }


def running_replicas() -> dict[str, int]:
    """RUNNING replicas of each expert deployment, as Serve counts them."""
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    return {name.removeprefix("expert-"): d.replica_states.get("RUNNING", 0)
            for name, d in deployments.items() if name.startswith("expert-")}


def autoscaling_args(args: dict[str, Any], *, max_replicas: int, sessions_per_replica: float = 2,
                     downscale_delay_s: float = 5.0) -> dict[str, Any]:
    """`args` with every expert autoscaled on the sessions its replicas hold, from one replica up to
    `max_replicas` (fusion.deploy.autoscaling)."""
    scaling = {"min_replicas": 1, "max_replicas": max_replicas, "target_ongoing_requests": sessions_per_replica,
               "upscale_delay_s": 0, "downscale_delay_s": downscale_delay_s, "look_back_period_s": 2,
               "metrics_interval_s": 0.5}
    expert = {k: v for k, v in args["expert"].items() if k != "num_replicas"}
    return {**args, "expert": {**expert, "autoscaling_config": scaling}}


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0.0


def _back_to_back(address: str, prompt: str, sampling: dict[str, Any], hold_s: float,
                  streams: list[Stream]) -> threading.Thread:
    """A client asking `prompt` again and again (each stream appended to `streams`) until `hold_s`
    seconds have passed since it began; at least once."""
    until = time.monotonic() + hold_s

    def run() -> None:
        while True:
            done = streams_to_end(address, [prompt], sampling)
            streams.extend(done)
            if done[0].error or time.monotonic() >= until:
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def autoscaling(address: str, prompts: list[str], sampling: dict[str, Any], *, max_replicas: int,
                ramp_interval_s: float = 1.0, hold_s: float = 0.0, timeout_s: float = 300.0) -> dict[str, Any]:
    """Under a ramp (one more client every `ramp_interval_s` up to len(prompts), each asking its
    prompt back to back for `hold_s` seconds, or once), every expert scales up to `max_replicas`; once
    the clients stop, back down to one. Times to scale up (all experts at `max_replicas`, watched
    every half second while the clients run) and down, and the p95 gap between tokens during the ramp
    against one stream alone before it."""
    steady = streams_to_end(address, prompts[:1], sampling)
    ramp_started = time.monotonic()
    scaled_up: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not scaled_up:
            if all(n >= max_replicas for n in running_replicas().values()):
                scaled_up.append(time.monotonic() - ramp_started)
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    streams: list[Stream] = []
    clients = []
    for prompt in prompts:
        clients.append(_back_to_back(address, prompt, sampling, hold_s, streams))
        time.sleep(ramp_interval_s)
    for client in clients:
        client.join()
    done.set()
    watcher.join()
    idle_from = time.monotonic()
    wait_until(lambda: all(n == 1 for n in running_replicas().values()) or running_replicas(),
               "every expert back to one replica", timeout_s=timeout_s)
    ramp_gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    steady_gaps = [b - a for a, b in zip(steady[0].times, steady[0].times[1:])]
    return {
        "clients": len(prompts), "streams": len(streams), "lost": sum(1 for s in streams if s.error),
        "errors": [s.error for s in streams if s.error],
        "scaled_up_s": scaled_up[0] if scaled_up else None,
        "scaled_down_after_idle_s": time.monotonic() - idle_from,
        "p95_gap_ramp_s": _p95(ramp_gaps), "p95_gap_one_stream_s": _p95(steady_gaps),
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def coordinator_args(args: dict[str, Any], port: int) -> dict[str, Any]:
    """`args` with the coordinator on the nodes that carry `COORDINATOR_RESOURCE` (one replica, checked
    every second) serving on the fixed `port`: the stable address its clients keep."""
    coordinator = {**args["coordinator"], "resources": {COORDINATOR_RESOURCE: 0.01}, "health_check_period_s": 1.0}
    return {**args, "port": port, "coordinator": coordinator}


def coordinator_node() -> str:
    """The Ray node id of the coordinator replica that answers."""
    from ray import serve

    return serve.get_deployment_handle("coordinator", APP).node_id.remote().result(timeout_s=30)


def coordinator_loss(cluster: LocalRayCluster, address: str, prompts: list[str], sampling: dict[str, Any], *,
                     kill_after_tokens: int = 3, timeout_s: float = 300.0) -> dict[str, Any]:
    """The coordinator-loss scenario (module docstring): the node the coordinator runs on is killed
    while streams run through `address`; its figures. The cluster needs another node carrying
    `COORDINATOR_RESOURCE` for Serve to start the coordinator again."""
    from fusion.services.client import FusionClient

    reference = streams_to_end(address, prompts, sampling)
    if any(s.error for s in reference):
        raise RuntimeError(f"the undisturbed run failed: {[s.error for s in reference if s.error]}")
    victim = cluster.name_of(coordinator_node())
    streams, ready, threads = run_streams(address, prompts, sampling, min_tokens=kill_after_tokens,
                                          timeout_s=timeout_s)
    if not ready.wait(timeout=600):  # a hang bound: every stream past its first tokens before the kill
        raise TimeoutError("the streams did not reach their first tokens")
    killed_at = time.monotonic()
    cluster.kill(victim)
    for thread in threads:
        thread.join(timeout=timeout_s)
    ended_s = time.monotonic() - killed_at
    hung = sum(1 for thread in threads if thread.is_alive())

    def answers() -> bool | str:  # a client asking again at the same address, as one would
        try:
            with FusionClient(address, timeout=10) as client:
                client.describe()
            return True
        except Exception as err:
            return f"{type(err).__name__}: {err}"

    wait_until(answers, "the coordinator answering at its address again", timeout_s=timeout_s)
    back_s = time.monotonic() - killed_at
    again = streams_to_end(address, prompts, sampling)
    finished = [s for s in streams if not s.error]
    return {
        "streams": len(streams), "victim": victim, "hung": hung,
        "ended_unavailable": sum(1 for s in streams if s.code == "UNAVAILABLE"),
        "finished_before_the_kill": len(finished),
        "finished_with_undisturbed_tokens": sum(1 for s, r in zip(streams, reference) if not s.error and s.tokens == r.tokens),
        "other_errors": [s.error for s in streams if s.error and s.code != "UNAVAILABLE"],
        "streams_ended_after_kill_s": ended_s,
        "answering_again_after_kill_s": back_s,
        "new_coordinator_node": cluster.name_of(coordinator_node()),
        "asked_again_lost": sum(1 for s in again if s.error),
        "asked_again_same_tokens": sum(1 for s, r in zip(again, reference) if not s.error and s.tokens == r.tokens),
        # where each stream asked again first departs from the undisturbed one (None: nowhere)
        "asked_again_first_difference": [_first_difference(s.tokens, r.tokens) for s, r in zip(again, reference)],
        "tokens": [None if s.error else s.tokens for s in streams], "tokens_again": [s.tokens for s in again],
    }
