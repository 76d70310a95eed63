"""A real multi-node Ray cluster on one machine, for the multi-node scenarios (node loss, rolling
update) and their test: a head and worker nodes, each started by `ray start --block` as a process
group of its own (its raylet, object store and every worker process it spawns), so that one node can
be killed whole, as a machine that dies, while the others run on.

Each node carries the custom resources it is given, so deployments that ask for a resource land on
the nodes that carry it, as expert replicas asking for GPUs land on GPU nodes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


# Token authentication, Ray's default for a new cluster, stated for every node and driver: each reads
# the token from ~/.ray/auth_token (the head makes one if there is none).
AUTH = {"RAY_AUTH_MODE": "token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    num_cpus: float
    resources: dict[str, float]
    process: subprocess.Popen
    log: Path
    node_id: str | None = None  # Ray's, once it has joined

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class LocalRayCluster:
    """`ray start` nodes on this machine (module docstring). Use as a context manager: every node it
    started is killed on exit."""

    workdir: Path
    head_cpus: float = 1
    head_resources: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # set in every node's environment (Ray's RAY_* settings)
    port: int = field(default_factory=free_port)
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The head's GCS, at the address Ray advertises for this machine (a driver dialling another
        address of it is not taken for a local one)."""
        from ray._private.services import get_node_ip_address

        return f"{get_node_ip_address()}:{self.port}"

    def __enter__(self) -> LocalRayCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start("head", ["--head", f"--port={self.port}", "--include-dashboard=false",
                                 "--disable-usage-stats"], self.head_cpus, self.head_resources)
        except BaseException:
            self.__exit__()
            raise
        return self

    def connect(self, **init_kwargs) -> None:
        """`ray.init` this process into the cluster, with its token (see `AUTH`)."""
        import ray
        from ray._raylet import Config

        os.environ.update(AUTH)
        Config.initialize("")  # Ray reads the mode once per process: again, now that it is set
        ray.init(address=self.address, **init_kwargs)

    def __exit__(self, *exc) -> None:
        for node in list(self.nodes.values()):
            self.kill(node.name)

    def add_worker(self, name: str, num_cpus: float, resources: dict[str, float]) -> Node:
        """A worker node joining the head, carrying `resources`; returns once Ray lists it alive."""
        return self._start(name, [f"--address={self.address}"], num_cpus, resources)

    def _start(self, name: str, args: list[str], num_cpus: float, resources: dict[str, float]) -> Node:
        if name in self.nodes and self.nodes[name].alive:
            raise ValueError(f"node {name!r} is already running")
        log = self.workdir / f"{name}.log"
        resources = {**resources, f"node-{name}": 1.0}  # every node also carries its own name
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--block",
                   f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}"]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **self.env, **AUTH}
        with open(log, "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)  # a process group of its own
        node = Node(name, num_cpus, resources, process, log)
        self.nodes[name] = node
        node.node_id = self._wait_for_node(node)
        logger.info("node %s joined (%s, %s)", name, node.node_id[:8], resources)
        return node

    def _wait_for_node(self, node: Node, timeout_s: float = 120.0) -> str:
        """Ray's id of the alive node carrying `node-<name>`, polled through `ray.nodes()` in a
        short-lived process (this process may hold no Ray connection)."""
        marker = f"node-{node.name}"
        probe = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                 "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive'] and %r in n['Resources']]))"
                 % (self.address, marker))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not node.alive:
                raise RuntimeError(f"node {node.name} exited while starting; see {node.log}")
            result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                                    env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **AUTH})
            lines = [line for line in result.stdout.splitlines() if line.startswith("[")]
            if result.returncode == 0 and lines and json.loads(lines[-1]):
                return json.loads(lines[-1])[0]
            time.sleep(1.0)
        raise TimeoutError(f"node {node.name} did not join within {timeout_s:.0f} s; see {node.log}")

    def name_of(self, node_id: str) -> str:
        """The name of the running node with Ray's id `node_id`."""
        [name] = [n for n, node in self.nodes.items() if node.node_id == node_id]
        return name

    def kill(self, name: str) -> None:
        """Kill node `name` whole and at once (SIGKILL to its process group), as a machine that dies."""
        node = self.nodes.pop(name)
        try:
            os.killpg(node.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.process.wait()
        logger.info("node %s killed", name)
