"""The Ray Serve deployment: builder arguments, registry, autoscaling policy and serve configs without
Ray; then three tiny experts and the coordinator on a real local Ray cluster (2 CPUs, no dashboard):
greedy output equal to the local engine's, a stream surviving the kill of its expert replica, and a
tear-down that leaves no Ray process behind."""

from __future__ import annotations

import os

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'logit-fusion[ray]'")

from fusion.deploy.autoscaling import LOAD_METRIC, fusion_load_policy
from fusion.deploy.registry import ReplicaTable
from fusion.deploy.settings import LOAD_POLICY, DeploymentOptions, parse_args
from fusion.config import parse_config
from fusion.errors import ConfigError
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S, wait_until
from tests.reference import assert_greedy_equivalent, assert_stream_matches

ROOT = Path(__file__).resolve().parent.parent
APP = "fusion-test"
# The hang bound of a wait that includes a replica's start: a new worker process imports torch and
# loads its model, which took 150 s on a 2-core host beside two busy loops (15 s idle).
REPLICA_START_S = 480.0
# A test here may wait for more than one replica's start.
pytestmark = pytest.mark.timeout(1800)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command name) of the living processes (not zombies), from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            out[int(entry.name)] = (int(ppid), name)
    return out


def descendants(root: int) -> dict[int, str]:
    """The processes started under `root` (Ray's GCS, raylet and workers of a cluster it started)."""
    table = _processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, name) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = name
                frontier.append(pid)
    return found


def wait_until_gone(started: dict[int, str], timeout_s: float = HANG_S) -> None:
    """Assert that every process in `started` has exited (other clusters on the machine are not ours)."""
    left: dict[int, str] = {}

    def gone() -> bool:
        table = _processes()
        left.clear()
        left.update({pid: name for pid, name in started.items() if pid in table and table[pid][1] == name})
        return not left

    wait_until(gone, timeout_s, interval_s=0.5)
    assert not left, f"processes left behind: {left}"
    assert {"raylet", "gcs_server"} <= set(started.values()), f"no Ray cluster was seen: {started}"


# -- without Ray -------------------------------------------------------------------------------
def test_replica_table_expires_silent_replicas():
    now = [100.0]
    table = ReplicaTable(ttl_s=5.0, clock=lambda: now[0])
    table.register("a", "r1", "10.0.0.1:1", "v1")
    table.register("a", "r2", "10.0.0.2:1", "v1")
    table.register("b", "r3", "10.0.0.3:1", "v1")
    assert table.addresses() == {"a": ["10.0.0.1:1", "10.0.0.2:1"], "b": ["10.0.0.3:1"]}
    now[0] += 4.0
    table.register("a", "r1", "10.0.0.1:1", "v1")  # heartbeat
    now[0] += 2.0  # r2 and r3 silent for 6 s
    assert table.addresses() == {"a": ["10.0.0.1:1"]}
    assert table.unregister("r1") and not table.unregister("r1")
    assert table.addresses() == {}


def test_scrape_targets_list_live_replicas_with_their_node():
    now = [0.0]
    table = ReplicaTable(ttl_s=5.0, clock=lambda: now[0])
    table.register("a", "r1", "10.0.0.1:1", "v1", node="n1", metrics="10.0.0.1:9100")
    table.register("a", "r2", "10.0.0.2:1", "v1", node="n2")  # no /metrics: not a target
    table.register("b", "r3", "10.0.0.3:1", "v1", node="n2", metrics="10.0.0.3:9100")
    assert table.scrape_targets() == [
        {"targets": ["10.0.0.1:9100"], "labels": {"expert": "a", "replica": "r1", "node": "n1"}},
        {"targets": ["10.0.0.3:9100"], "labels": {"expert": "b", "replica": "r3", "node": "n2"}}]
    # a coordinator lists its /metrics under its own labels, and expires like the experts
    table.register_metrics("co1", "10.0.0.9:9090", {"deployment": "coordinator", "replica": "co1", "node": "n3"})
    assert table.scrape_targets()[-1] == {
        "targets": ["10.0.0.9:9090"], "labels": {"deployment": "coordinator", "replica": "co1", "node": "n3"}}
    now[0] += 6.0
    table.register("b", "r3", "10.0.0.3:1", "v1", node="n2", metrics="10.0.0.3:9100")
    assert [t["labels"]["replica"] for t in table.scrape_targets()] == ["r3"]
    table.register_metrics("co1", "10.0.0.9:9090", {"replica": "co1"})
    assert table.unregister("co1") and [t["labels"]["replica"] for t in table.scrape_targets()] == ["r3"]


def test_scrape_targets_are_served_over_http_as_prometheus_polls_them():
    import json
    import urllib.error
    import urllib.request

    from fusion.deploy.registry import TARGETS_PATH, serve_targets

    table = ReplicaTable(ttl_s=5.0)
    server = serve_targets(table, "127.0.0.1", 0)
    base = "http://127.0.0.1:%d" % server.server_address[1]
    try:
        def targets():
            with urllib.request.urlopen(base + TARGETS_PATH, timeout=10) as reply:
                assert reply.headers["Content-Type"] == "application/json"
                return json.loads(reply.read())

        assert targets() == []
        table.register("a", "r1", "10.0.0.1:1", "v1", node="n1", metrics="10.0.0.1:9100")
        assert targets() == table.scrape_targets() == [
            {"targets": ["10.0.0.1:9100"], "labels": {"expert": "a", "replica": "r1", "node": "n1"}}]
        table.unregister("r1")  # a replica gone is gone from the next poll
        assert targets() == []
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/metrics", timeout=10)
        assert refused.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_coordinators_see_only_replicas_of_their_expert_versions():
    from fusion.deploy.registry import expert_version
    from fusion.config import ExpertConfig

    old = ExpertConfig(name="a", model="/models/a-v1")
    new = old.model_copy(update={"model": "/models/a-v2"})
    assert expert_version(old) != expert_version(new)
    assert expert_version(old) != expert_version(old.model_copy(update={"weights": "int4"}))
    # Weight, replicas and placement do not change the logits.
    assert expert_version(old) == expert_version(old.model_copy(update={"weight": 3.0, "num_gpus": 0.5}))
    table = ReplicaTable(ttl_s=5.0)
    table.register("a", "r1", "10.0.0.1:1", expert_version(old))
    table.register("a", "r2", "10.0.0.2:1", expert_version(new))  # a rolling update under way
    table.register("b", "r3", "10.0.0.3:1", "vb")
    assert table.addresses({"a": expert_version(new), "b": "vb"}) == {"a": ["10.0.0.2:1"], "b": ["10.0.0.3:1"]}
    assert table.addresses({"a": expert_version(old)}) == {"a": ["10.0.0.1:1"]}


def test_options_layer_and_become_serve_options():
    base = DeploymentOptions(num_cpus=0.5, autoscaling_config={"min_replicas": 1, "max_replicas": 4})
    own = DeploymentOptions(num_replicas=2)
    merged = own.over(base)
    assert merged.num_replicas == 2 and merged.autoscaling_config is None and merged.num_cpus == 0.5
    options = merged.serve_options(num_gpus=0.25)
    assert options == {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.25}, "num_replicas": 2}
    scaled = base.serve_options()
    assert scaled["autoscaling_config"]["policy"] == {"policy_function": LOAD_POLICY}
    assert "num_replicas" not in scaled and "num_gpus" not in scaled["ray_actor_options"]
    assert DeploymentOptions().serve_options() == {"ray_actor_options": {"num_cpus": 1.0}}  # Serve's defaults
    with pytest.raises(ValueError, match="either num_replicas or autoscaling_config"):
        DeploymentOptions(num_replicas=1, autoscaling_config={})


def test_deploy_args_name_the_bad_field(tiny_dir):
    data = tiny_config_dict(tiny_dir)
    with pytest.raises(ConfigError, match="unknown experts \\['zz'\\]"):
        parse_args({"config": data, "experts": {"zz": {"num_replicas": 2}}}).fusion_config()
    with_addresses = dict(data, experts=[dict(data["experts"][0], addresses=["h:1"])] + data["experts"][1:])
    with pytest.raises(ConfigError, match="leave addresses empty"):
        parse_args({"config": with_addresses}).fusion_config()
    with pytest.raises(ConfigError, match="registry_ttl_s"):
        parse_args({"config": data, "heartbeat_s": 5, "registry_ttl_s": 5})
    with pytest.raises(ConfigError, match="port"):
        parse_args({"config": data, "port": 70000})


@pytest.mark.parametrize("field", ["expert", "experts.a", "coordinator"])
def test_deploy_args_refuse_scaling_to_zero(tiny_dir, field):
    scaling = {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}
    args = {"config": tiny_config_dict(tiny_dir)}
    if field == "experts.a":
        args["experts"] = {"a": scaling}
    else:
        args[field] = scaling
    with pytest.raises(ConfigError, match=f"{field}.autoscaling_config.min_replicas must be at least 1, got 0"):
        parse_args(args)
    scaling["autoscaling_config"]["min_replicas"] = 1
    parse_args(args)


def _policy_context(reports, target=4.0, current=2):
    """What Serve hands a custom policy: each replica's reported `fusion_load`, the deployment's
    config, the replicas it targets now."""
    return SimpleNamespace(aggregated_metrics={LOAD_METRIC: reports} if reports is not None else None,
                           config=SimpleNamespace(target_ongoing_requests=target), target_num_replicas=current)


def test_load_policy_asks_for_load_over_target():
    assert fusion_load_policy(_policy_context({"r1": 7.0, "r2": 6.0}))[0] == 4  # 13 sessions / 4 per replica
    assert fusion_load_policy(_policy_context({"r1": 0.0, "r2": 0.0}))[0] == 0  # Serve clamps to min_replicas
    assert fusion_load_policy(_policy_context(None, current=3))[0] == 3  # no reports yet: no change
    assert fusion_load_policy(_policy_context({}, current=3))[0] == 3
    assert fusion_load_policy(_policy_context({"r1": 5.0}, target=None))[0] == 3  # the default: 2 a replica


# A ramp of clients, as benchmarks/multinode.py runs it live (two sessions wanted a replica): the
# sessions each replica reports, the replicas it runs, and the replicas the policy asks for.
RAMP = [
    ({"r1": 1.0}, 1, 1),  # one client
    ({"r1": 2.0}, 1, 1),  # two: still one replica's worth
    ({"r1": 3.0}, 1, 2),  # three: up
    ({"r1": 3.0, "r2": 1.0}, 2, 2),  # the new replica takes new sessions; four held in all
    ({"r1": 2.0, "r2": 0.0}, 2, 1),  # clients leaving: down
    ({"r1": 0.0, "r2": 0.0}, 2, 0),  # idle: Serve clamps to min_replicas
    ({"r1": 9.0}, 1, 5),  # past max_replicas: Serve clamps
]


@pytest.mark.parametrize(("reports", "running", "wanted"), RAMP)
def test_load_policy_scales_up_and_down_with_the_sessions_held(reports, running, wanted):
    assert fusion_load_policy(_policy_context(reports, target=2.0, current=running)) == (wanted, {})


@pytest.mark.parametrize("name", ["serve-cpu.yaml", "serve-gpu.yaml"])
def test_serve_configs_validate_and_build(name):
    import importlib

    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((ROOT / "deploy" / name).read_text())
    schema = ServeDeploySchema.model_validate(data)
    [app] = schema.applications
    settings = parse_args(app.args)
    config = settings.fusion_config()
    gpus = {e.num_gpus for e in config.experts}
    assert gpus == ({0.0} if name == "serve-cpu.yaml" else {0.3})  # (three experts to a GPU)
    # What `serve run` / `serve deploy` do with import_path and args.
    module, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert isinstance(call_user_app_builder_with_args_if_necessary(builder, app.args), Application)
    # Overrides name deployments the builder makes, and keep the load policy (Serve's own would see
    # no traffic).
    names = {f"expert-{e.name}" for e in config.experts} | {"coordinator", "registry"}
    for override in app.deployments:
        assert override.name in names
        scaling = override.autoscaling_config
        if scaling is not None:
            assert scaling["policy"] == {"policy_function": LOAD_POLICY}, override.name


# -- on a local Ray cluster ----------------------------------------------------------------------
PROMPTS = ["what is 12 + 35 ?", "def add"]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    import ray
    from ray import serve

    from fusion.deploy.app import build_app, coordinator_address

    # Sessions a test holds open stay while a new replica starts (minutes on a loaded host): the idle
    # sweep's default (120 s) would drop them, and the load the autoscaling test holds with them.
    config = tiny_config_dict(tiny_dir, limits={"session_idle_s": 3600})
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
               "downscale_delay_s": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5}
    args = {
        "config": config, "port": 0, "grace_s": 2.0, "heartbeat_s": 1.0, "registry_ttl_s": 4.0, "refresh_s": 0.5,
        "expert": {"num_cpus": 0, "health_check_period_s": 2.0},
        "experts": {"a": {"num_replicas": 2}, "c": {"autoscaling_config": scaling}},
        "coordinator": {"num_cpus": 0},
    }
    # Replicas report their load every half second instead of every ten (the workers inherit it).
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(args), name=APP, route_prefix=None)
        yield SimpleNamespace(address=coordinator_address(APP), config=parse_config(config))
    finally:
        started = descendants(os.getpid())  # the cluster ray.init started: GCS, raylet, workers
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", None)
    wait_until_gone(started)


def _handle(name):
    from ray import serve

    return serve.get_deployment_handle(name, APP)


def _wait_for(condition, what: str, timeout_s: float = HANG_S):
    """Wait until `condition()` is True (anything else it returns is the state it saw, for the failure)."""
    seen: list = [None]

    def met() -> bool:
        seen[0] = condition()
        return seen[0] is True

    if not wait_until(met, timeout_s, interval_s=1.0):
        pytest.fail(f"{what} within {timeout_s:.0f} s; last seen: {seen[0]}")


def _replica_count(expert: str) -> int:
    """The replicas Serve runs or is starting for the expert (what it made of the policy's answer)."""
    from ray import serve

    states = serve.status().applications[APP].deployments[f"expert-{expert}"].replica_states
    return sum(states.get(state, 0) for state in ("STARTING", "RUNNING"))


def _replicas_of(expert: str) -> tuple[int, int, set[str]]:
    """(RUNNING replicas by Serve, replicas the coordinator uses, replica ids in the registry)."""
    from ray import serve

    running = serve.status().applications[APP].deployments[f"expert-{expert}"].replica_states.get("RUNNING", 0)
    used = len(_handle("coordinator").replica_addresses.remote().result()[expert])
    registered = {r["replica_id"] for r in _handle("registry").replicas.remote().result() if r["expert"] == expert}
    return running, used, registered


def test_deployments_follow_the_config(cluster):
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert set(deployments) == {"registry", "coordinator", "expert-a", "expert-b", "expert-c"}
    assert all(d.status == "HEALTHY" for d in deployments.values())
    assert deployments["expert-a"].replica_states.get("RUNNING") == 2
    replicas = _handle("registry").replicas.remote().result()
    assert sorted(r["expert"] for r in replicas) == ["a", "a", "b", "c"]

    # The coordinator re-reads the registry every refresh_s, so its view converges shortly after.
    def coordinator_spread():
        spread = _handle("coordinator").replica_addresses.remote().result()
        counts = {name: len(addresses) for name, addresses in spread.items()}
        return True if counts == {"a": 2, "b": 1, "c": 1} else counts

    _wait_for(coordinator_spread, "the coordinator uses every registered replica")


def test_greedy_output_equals_the_local_engine(cluster, tiny_service):
    from fusion.services.client import FusionClient

    sampling = {"max_tokens": 24, "temperature": 0.0}
    with FusionClient(cluster.address, timeout=REPLICA_START_S) as client:
        for prompt in PROMPTS:
            remote = list(client.generate(prompt, sampling))
            # Replicas run with one thread each and batch with other sessions: see tests.reference.
            assert_stream_matches(tiny_service, prompt, remote, tiny_service.complete(prompt, sampling))


def test_step_through_a_serve_handle(cluster, tiny_service):
    import torch

    from fusion.errors import InvalidArgumentError
    from fusion.experts.expert import StepRequest
    from fusion.services.protos import expert_pb2
    from fusion.services.wire import decode_tensor

    def request(session_id):
        return expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id=session_id, token_ids=[5, 6, 7])])

    got = decode_tensor(_handle("expert-b").Step.remote(request("handle-1")).result(timeout_s=HANG_S).logits, "b")
    local = tiny_service.engine.experts[1]
    try:
        expected = local.step([StepRequest("handle-1", [5, 6, 7])])
    finally:
        local.release(["handle-1"])
    # The same model through the Expert API. Not bit for bit: the replica computes with one OpenMP thread
    # (Ray sets OMP_NUM_THREADS from the actor's CPUs), this process with two, and fp32 reductions in
    # another order differ in their last bits on some CPUs (AVX-512).
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    with pytest.raises(InvalidArgumentError, match="session_id"):
        _handle("expert-b").Step.remote(request("")).result(timeout_s=HANG_S)


def _replica_holding_sessions(addresses_by_replica: dict[str, str]) -> str:
    """The replica id whose Expert server caches the most sessions now."""
    from fusion.services.protos import expert_pb2, expert_pb2_grpc

    counts = {}
    for replica_id, address in addresses_by_replica.items():
        with grpc.insecure_channel(address) as channel:
            info = expert_pb2_grpc.ExpertStub(channel).Info(expert_pb2.InfoRequest(), timeout=10)
        counts[replica_id] = info.active_sessions
    return max(counts, key=counts.get)


def test_stream_survives_killing_its_expert_replica(cluster, tiny_service):
    import ray

    from fusion.services.client import FusionClient

    sampling = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    prompt = "hello world , fusion"
    expected = tiny_service.complete(prompt, sampling).token_ids
    _wait_for(lambda: _replicas_of("a")[:2] == (2, 2) or _replicas_of("a"), "the coordinator using both replicas of a")
    registry = _handle("registry")
    replicas_a = {r["replica_id"]: r["address"] for r in registry.replicas.remote().result() if r["expert"] == "a"}
    assert len(replicas_a) == 2
    failovers_before = _handle("coordinator").failovers.remote().result()["a"]

    with FusionClient(cluster.address, timeout=REPLICA_START_S) as client:
        events = client.generate(prompt, sampling)
        tokens = [next(events).token.token_id for _ in range(5)]
        victim = _replica_holding_sessions(replicas_a)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        tokens += [e.token.token_id for e in events]

    # The re-prefill on the surviving replica computes the history in another shape: see tests.reference.
    assert_greedy_equivalent(tiny_service, prompt, tokens, expected)
    assert _handle("coordinator").failovers.remote().result()["a"] > failovers_before

    # Serve replaces the killed replica; it registers and the coordinator spreads sessions over it again.
    def recovered():
        running, used, registered = _replicas_of("a")
        return (running, used, len(registered), victim in registered) == (2, 2, 2, False) or (running, used, registered)

    _wait_for(recovered, "expert a back to two replicas", timeout_s=REPLICA_START_S)
    with FusionClient(cluster.address, timeout=REPLICA_START_S) as client:
        again = [e.token.token_id for e in client.generate(PROMPTS[0], {"max_tokens": 24})]
    assert_greedy_equivalent(tiny_service, PROMPTS[0], again,
                             tiny_service.complete(PROMPTS[0], {"max_tokens": 24}).token_ids)


def test_expert_scales_on_the_sessions_it_holds(cluster):
    """Expert c scales on its cached sessions (target 1 per replica, at most 2): three sessions opened
    directly on its replica bring a second one, which the coordinator then uses; releasing them
    brings it back to one."""
    from fusion.services.protos import expert_pb2, expert_pb2_grpc

    [address] = [r["address"] for r in _handle("registry").replicas.remote().result() if r["expert"] == "c"]
    sessions = [f"load-{i}" for i in range(3)]
    with grpc.insecure_channel(address) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)
        for session in sessions:
            stub.Step(expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(session_id=session, token_ids=[5, 6])]),
                      timeout=HANG_S)
        try:
            # Serve acts on the policy's answer at once (a second replica starting); the replica then
            # takes as long as the host needs to start, and the coordinator uses it once registered
            _wait_for(lambda: _replica_count("c") == 2 or _replica_count("c"), "Serve adding a replica of expert c")
            _wait_for(lambda: _replicas_of("c")[:2] == (2, 2) or _replicas_of("c"), "expert c scaled up to two",
                      timeout_s=REPLICA_START_S)
        finally:
            stub.Release(expert_pb2.ReleaseRequest(session_ids=sessions), timeout=HANG_S)
    _wait_for(lambda: _replicas_of("c")[:2] == (1, 1) or _replicas_of("c"), "expert c scaled back to one",
              timeout_s=REPLICA_START_S)


def test_health_checks_step_the_model(cluster):
    from ray import serve

    for name in ("expert-a", "expert-b", "expert-c", "coordinator"):
        assert _handle(name).check_health.remote().result(timeout_s=HANG_S) is None

    def all_healthy():  # an autoscaling test before this one may still be settling
        deployments = serve.status().applications[APP].deployments
        return all(d.status == "HEALTHY" for d in deployments.values()) or deployments

    _wait_for(all_healthy, "every deployment HEALTHY")
