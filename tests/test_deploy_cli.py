"""`fusion deploy` as a user runs it: a local Ray cluster with the experts and the coordinator on Serve,
a client's greedy output equal to the local engine's, and Ctrl-C tearing everything down."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import pytest
import yaml

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'logit-fusion[ray]'")

from fusion.services.client import FusionClient
from tests.conftest import tiny_config_dict
from tests.reference import assert_greedy_equivalent
from tests.test_deploy import REPLICA_START_S, descendants, wait_until_gone

pytestmark = pytest.mark.timeout(1800)  # a cluster's start and stop, each bounded by REPLICA_START_S


def test_fusion_deploy_serves_until_ctrl_c(tiny_dir, tmp_path, tiny_service):
    config = tmp_path / "fusion.yaml"
    data = tiny_config_dict(tiny_dir)
    for expert in data["experts"]:  # failover is not this test's point: a starved replica is only slow
        expert.update(step_timeout_s=REPLICA_START_S, prefill_timeout_s=REPLICA_START_S)
    config.write_text(yaml.safe_dump(data))
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", FUSION_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion.tools.cli", "deploy", "--config", str(config), "--port", "0", "--num-cpus", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    started: dict[int, str] = {}
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=REPLICA_START_S)  # a hang bound: the replicas start before the line
            assert line is not None, f"fusion deploy exited early with {proc.wait()}"
            match = re.search(r"serving on (\S+:\d+)", line)
            if match:
                break
        expected = tiny_service.complete("hello world", {"max_tokens": 12})
        with FusionClient(match.group(1), timeout=REPLICA_START_S) as client:  # a hang bound
            got = [e.token.token_id for e in client.generate("hello world", {"max_tokens": 12})]
        assert_greedy_equivalent(tiny_service, "hello world", got, expected.token_ids)  # other processes
        started = descendants(proc.pid)  # the local cluster it started: GCS, raylet, workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=REPLICA_START_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until_gone(started)
