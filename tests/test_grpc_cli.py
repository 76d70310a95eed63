"""`fusion serve-expert` and `fusion serve` as a user runs them (subprocesses), `fusion generate --server`
against them, and a graceful exit on SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading

import yaml

from fusion.services.client import FusionClient
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S
from tests.reference import assert_greedy_equivalent, assert_payload_matches


class Served:
    """A `fusion serve…` subprocess; `port` is read from its "serving on HOST:PORT" line."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, FUSION_CACHE_DIR="/nonexistent-cache")
        self.proc = subprocess.Popen([sys.executable, "-m", "fusion.tools.cli", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.port = self._wait_for_port(120)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def _wait_for_port(self, timeout: float) -> int:
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                raise AssertionError(f"server exited ({self.proc.wait()}): {''.join(self.log)}")
            self.log.append(line)
            match = re.search(r"serving on \S+:(\d+)", line)
            if match:
                return int(match.group(1))

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_serve_commands_and_generate_with_server(tiny_dir, tmp_path, tiny_service):
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump(tiny_config_dict(tiny_dir)))
    expert = Served("serve-expert", "--config", str(local), "--expert", "a", "--port", "0", "--host", "127.0.0.1")
    coordinator = None
    try:
        data = tiny_config_dict(tiny_dir)
        data["experts"][0]["addresses"] = [f"127.0.0.1:{expert.port}"]  # a remote, b and c in-process
        remote = tmp_path / "remote.yaml"
        remote.write_text(yaml.safe_dump(data))
        coordinator = Served("serve", "--config", str(remote), "--port", "0", "--host", "127.0.0.1",
                             "--metrics-port", "0")
        server = f"127.0.0.1:{coordinator.port}"
        expected = tiny_service.complete("hello world", {"max_tokens": 6})

        with FusionClient(server, timeout=HANG_S) as client:
            got = [e.token.token_id for e in client.generate("hello world", {"max_tokens": 6})]
        assert_greedy_equivalent(tiny_service, "hello world", got, expected.token_ids)  # other processes

        out = subprocess.run(
            [sys.executable, "-m", "fusion.tools.cli", "generate", "hello world", "--config", str(remote),
             "--server", server, "--max-tokens", "6", "--json"],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        payload = json.loads(out.stdout)
        assert_payload_matches(tiny_service, "hello world", payload, expected)
        assert [a["expert"] for a in payload["experts"][0]] == ["a", "b", "c"]

        out = subprocess.run(
            [sys.executable, "-m", "fusion.tools.cli", "generate", "hi", "--config", str(remote), "--server", server,
             "--profile", "nope"],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode != 0 and "profile" in out.stderr and "Traceback" not in out.stderr

        # without --server, the config's remote expert is asked where it serves, as `fusion serve` asks it
        local_run = [sys.executable, "-m", "fusion.tools.cli", "generate", "hello world", "--config", str(remote),
                     "--max-tokens", "6", "--json"]
        out = subprocess.run(local_run, capture_output=True, text=True, timeout=HANG_S)
        assert out.returncode == 0, out.stderr
        assert_payload_matches(tiny_service, "hello world", json.loads(out.stdout), expected)

        assert coordinator.terminate() == 0
        assert expert.terminate() == 0
        out = subprocess.run(local_run, capture_output=True, text=True, timeout=HANG_S)  # its replica gone
        assert out.returncode != 0 and "expert 'a'" in out.stderr and "Traceback" not in out.stderr
    finally:
        for served in (coordinator, expert):
            if served is not None:
                served.kill()


def test_serve_expert_unknown_name_fails_cleanly(tiny_dir, tmp_path):
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_dir)))
    out = subprocess.run([sys.executable, "-m", "fusion.tools.cli", "serve-expert", "--config", str(config), "--expert",
                          "zzz", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown expert 'zzz'" in out.stderr and "Traceback" not in out.stderr

