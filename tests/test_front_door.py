"""One request spec, every front door: the Python service, the CLI, gRPC and Ray Serve give the same ids.

The config's rule is `route` with `router: auto` (the router trained for the tiny trio, in a cache); the
request overrides one parameter (`hard: true`, which must keep `router: auto`), picks a weight profile
and samples with a seed and a stop string. Every door layers it over the config the same way, so the
seeded streams agree token for token. Processes other than this one are pinned to this process's
thread count (OMP_NUM_THREADS): with one row per step and the same threads, the float reductions are
the same, which is what makes a seeded stream reproducible across processes (see tests.reference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from fusion.config import SpecOverrides, parse_config
from fusion.frontdoor.service import FusionRequest, FusionService
from fusion.tools.router_training import RouterTrainSettings, prepare_router
from fusion.services.background import BackgroundLoop
from fusion.services.client import FusionClient
from fusion.services.coordinator import create_coordinator_server
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S

PROMPT = "what is 12 + 35 ?"
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 16, "stop": ["zz"]}
OVERRIDES = SpecOverrides(params={"hard": True}, profile="ab")


@pytest.fixture(scope="module")
def routed(tiny_dir, tmp_path_factory):
    """The tiny trio configured with `rule: route, router: auto`, its router trained into a cache."""
    root = tmp_path_factory.mktemp("front-door")
    data = tiny_config_dict(tiny_dir, fusion={"rule": "route", "params": {"router": "auto"}})
    config = parse_config(data)
    trainer = FusionService.from_config(config, cache_dir=root / "cache", require_router=False)
    prepare_router(trainer, RouterTrainSettings(max_texts=6, steps_per_text=2))
    trainer.close()
    service = FusionService.from_config(config, cache_dir=root / "cache")
    config_file = root / "routed.yaml"
    config_file.write_text(yaml.safe_dump(data))
    yield SimpleNamespace(config=config, data=data, cache=root / "cache", file=config_file, service=service)
    service.close()


def same_threads_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), RAY_USAGE_STATS_ENABLED="0")


def test_python_service(routed):
    completion = routed.service.complete(PROMPT, SAMPLING, OVERRIDES)
    spec = routed.service.spec(OVERRIDES)
    assert spec.rule == "route" and spec.params == {"router": "auto", "hard": True} and spec.profile == "ab"
    assert completion.token_ids and completion.usage.completion_tokens == len(completion.token_ids)
    # The stream is what `submit` gives; the overrides changed the output (they are not ignored).
    assert [e.token.token_id for e in routed.service.submit(FusionRequest(PROMPT, SAMPLING, OVERRIDES))] == \
        completion.token_ids
    assert routed.service.complete(PROMPT, SAMPLING).token_ids != completion.token_ids


def test_cli(routed):
    args = [sys.executable, "-m", "fusion.tools.cli", "generate", PROMPT, "--config", str(routed.file),
            "--cache-dir", str(routed.cache), "--params", "hard=true", "--profile", "ab", "--temperature", "0.9",
            "--top-p", "0.95", "--seed", "11", "--max-tokens", "16", "--stop", "zz", "--json"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env=same_threads_env())
    assert out.returncode == 0, out.stderr
    expected = routed.service.complete(PROMPT, SAMPLING, OVERRIDES)
    payload = json.loads(out.stdout)
    assert payload["token_ids"] == expected.token_ids
    assert payload["text"] == expected.text


def test_grpc(routed):
    with BackgroundLoop() as loop:
        server, port = loop.run(create_coordinator_server(routed.config, cache_dir=routed.cache))
        try:
            with FusionClient(f"127.0.0.1:{port}", timeout=HANG_S) as client:
                events = list(client.generate(PROMPT, SAMPLING, OVERRIDES))
        finally:
            loop.run(server.stop(1.0))
    expected = routed.service.complete(PROMPT, SAMPLING, OVERRIDES)
    assert [e.token.token_id for e in events] == expected.token_ids
    assert "".join(e.text for e in events) == expected.text
    assert events[-1].usage.completion_tokens == len(expected.token_ids)


def test_ray_serve(routed):
    pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'logit-fusion[ray]'")
    import ray
    from ray import serve

    from fusion.deploy.app import build_app, coordinator_address
    from tests.test_deploy import REPLICA_START_S, descendants, wait_until_gone

    args = {"config": routed.data, "port": 0, "grace_s": 2.0, "cache_dir": str(routed.cache),
            "expert": {"num_cpus": 0}, "coordinator": {"num_cpus": 0}}
    pinned = {"OMP_NUM_THREADS": str(torch.get_num_threads())}  # replicas compute with this process's threads
    before = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(args), name="front-door", route_prefix=None)
        with FusionClient(coordinator_address("front-door"), timeout=REPLICA_START_S) as client:
            events = list(client.generate(PROMPT, SAMPLING, OVERRIDES))
    finally:
        started = descendants(os.getpid())
        serve.shutdown()
        ray.shutdown()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    wait_until_gone(started)
    expected = routed.service.complete(PROMPT, SAMPLING, OVERRIDES)
    assert [e.token.token_id for e in events] == expected.token_ids
    assert "".join(e.text for e in events) == expected.text
