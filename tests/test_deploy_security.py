"""The Ray Serve deployment with the config's `security` section: three tiny experts and the
coordinator on a real local Ray cluster (2 CPUs, no dashboard) with mutual TLS to the experts, the
coordinator's secret, API keys and `tls.server_name` (the certificates name `localhost`, replicas are
dialled at the node's IP). Greedy output over TLS equals the local engine's; an expert replica refuses
callers without the client certificate or the secret; every replica's health probe passes."""

from __future__ import annotations

import os

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from types import SimpleNamespace

import grpc
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'logit-fusion[ray]'")

from fusion.config import parse_config
from fusion.errors import FusionError
from fusion.services.protos import expert_pb2, expert_pb2_grpc
from fusion.services.api_keys import create_key
from fusion.services.expert_auth import expert_channel_metadata
from fusion.services.tls import open_channel
from tests.conftest import tiny_config_dict
from tests.reference import assert_stream_matches
from tests.test_deploy import REPLICA_START_S, descendants, wait_until_gone
from tests.test_security import make_ca, make_leaf

APP = "fusion-secure-test"
SECRET = "s3cret-for-ray-experts"


def _security(root) -> tuple[dict, str]:
    """A `security` section over a throwaway CA, and an API key for it."""
    ca = make_ca(root / "ca", "fusion test CA")
    server_cert, server_key = make_leaf(root / "server", ca, "localhost", server=True)
    client_cert, client_key = make_leaf(root / "coordinator", ca, "coordinator", server=False)
    secret_file = root / "expert-secret"
    secret_file.write_text(SECRET + "\n")
    key = create_key(root / "keys.yaml", "team-ray")
    tls = {"cert_file": server_cert, "key_file": server_key, "ca_file": ca[2], "client_cert_file": client_cert,
           "client_key_file": client_key, "require_client_auth": True, "server_name": "localhost"}
    return {"tls": tls, "expert_secret_file": str(secret_file), "api_keys_file": str(root / "keys.yaml")}, key


@pytest.fixture(scope="module")
def secure_app(tiny_dir, tmp_path_factory):
    import ray
    from ray import serve

    from fusion.deploy.app import build_app, coordinator_address

    section, key = _security(tmp_path_factory.mktemp("pki"))
    config = tiny_config_dict(tiny_dir, security=section)
    args = {
        "config": config, "port": 0, "grace_s": 1.0, "heartbeat_s": 1.0, "registry_ttl_s": 4.0, "refresh_s": 0.5,
        "expert": {"num_cpus": 0, "health_check_period_s": 2.0},
        "coordinator": {"num_cpus": 0, "health_check_period_s": 2.0},
    }
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(args), name=APP, route_prefix=None)
        yield SimpleNamespace(address=coordinator_address(APP), config=parse_config(config), key=key)
    finally:
        started = descendants(os.getpid())  # the cluster ray.init started: GCS, raylet, workers
        serve.shutdown()
        ray.shutdown()
    wait_until_gone(started)


def _handle(name):
    from ray import serve

    return serve.get_deployment_handle(name, APP)


def test_replicas_pass_their_health_probes_over_tls(secure_app):
    from ray import serve

    for name in ("expert-a", "expert-b", "expert-c", "coordinator"):
        assert _handle(name).check_health.remote().result(timeout_s=30) is None
    status = serve.status().applications[APP]
    assert status.status == "RUNNING"
    assert all(d.status == "HEALTHY" for d in status.deployments.values()), status.deployments


def test_greedy_output_over_tls_equals_the_local_engine(secure_app, tiny_service):
    from fusion.services.client import FusionClient

    sampling = {"max_tokens": 16, "temperature": 0.0}
    prompt = "what is 12 + 35 ?"
    local = tiny_service.complete(prompt, sampling)
    with FusionClient(secure_app.address, timeout=REPLICA_START_S, api_key=secure_app.key,
                      security=secure_app.config.security) as client:
        remote = list(client.generate(prompt, sampling))
    assert_stream_matches(tiny_service, prompt, remote, local)  # replicas run in other processes
    with FusionClient(secure_app.address, timeout=REPLICA_START_S, security=secure_app.config.security) as client:
        with pytest.raises(FusionError) as caught:  # TLS alone is not an API key
            list(client.generate(prompt, sampling))
    assert isinstance(caught.value.__cause__, grpc.RpcError)
    assert caught.value.__cause__.code() == grpc.StatusCode.UNAUTHENTICATED


def _info_code(channel) -> grpc.StatusCode:
    with channel:
        try:
            expert_pb2_grpc.ExpertStub(channel).Info(expert_pb2.InfoRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_expert_replica_answers_only_the_coordinator(secure_app):
    security = secure_app.config.security
    [address] = [r["address"] for r in _handle("registry").replicas.remote().result() if r["expert"] == "b"]
    coordinator = open_channel(address, security, to_expert=True, metadata=expert_channel_metadata(security))
    assert _info_code(coordinator) == grpc.StatusCode.OK
    # the coordinator's certificate without the secret
    assert _info_code(open_channel(address, security, to_expert=True)) == grpc.StatusCode.UNAUTHENTICATED
    # the secret without a client certificate, or in plaintext: the TLS handshake fails
    no_cert = open_channel(address, security, metadata=expert_channel_metadata(security))
    assert _info_code(no_cert) == grpc.StatusCode.UNAVAILABLE
    plaintext = open_channel(address, None, metadata=expert_channel_metadata(security))
    assert _info_code(plaintext) == grpc.StatusCode.UNAVAILABLE
