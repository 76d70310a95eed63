"""Where the coordinator finds the expert replicas' gRPC servers.

Each expert replica serves the Expert service on a free port of its node and registers
`(expert, replica id, address, version)` here, again every `heartbeat_s` seconds. An entry not heard from for
`ttl_s` seconds is dropped (a killed replica cannot unregister); a replica shutting down unregisters
itself. The coordinator reads `addresses()` every few seconds and hands each expert's list to its
`RemoteExpert`, which pins sessions to replicas and fails over between them.

The version (`expert_version`) names what decides an expert's logits: model, weights file, adapter,
quantized weights, dtype, device. A coordinator asks only for replicas of the versions its config names, so during a rolling
update that changes a model, old and new replicas of one expert never serve the same session.

With `targets_port`, the registry also serves `scrape_targets()` over HTTP (`GET /targets`), the
JSON that Prometheus's `http_sd_configs` polls, so Prometheus follows the replicas as they come and
go without a config change.

The table is soft state: if the registry's replica restarts, the expert replicas' next heartbeats
fill it again, and until then the coordinator keeps the replicas it knew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from ray import serve

from fusion.deploy._replica import advertised_host
from fusion.config import ExpertConfig

logger = logging.getLogger(__name__)

REGISTRY_DEPLOYMENT = "registry"
TARGETS_PATH = "/targets"


def expert_version(config: ExpertConfig) -> str:
    """A short hash of what decides the expert's logits (not its weight, replicas or placement)."""
    decisive = {k: getattr(config, k) for k in ("name", "model", "gguf_file", "dtype", "device")}
    if config.adapter is not None:  # (absent otherwise: versions of configs without adapters stay as they were)
        decisive["adapter"] = config.adapter
    if config.weights != "dense":  # quantized codes give other logits (absent when dense, as above)
        decisive["weights"] = config.weights
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class ReplicaEntry:
    expert: str
    replica_id: str  # Serve's full replica id, also the replica actor's name in the "serve" namespace
    address: str  # host:port of the replica's Expert gRPC server
    version: str  # expert_version of the config the replica serves
    seen: float  # monotonic time of the last registration
    node: str = ""  # the Ray node id the replica runs on
    metrics: str = ""  # host:port of the replica's /metrics ("" without one)


class ReplicaTable:
    """The registry's state, without Ray (unit-tested on its own)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, ReplicaEntry] = {}
        # other replicas' /metrics (the coordinators'): replica id -> (address, labels, last seen)
        self._scraped: dict[str, tuple[str, dict[str, str], float]] = {}
        self._lock = threading.Lock()  # Serve's threads and the HTTP server's read and write it

    def register(self, expert: str, replica_id: str, address: str, version: str, node: str = "",
                 metrics: str = "") -> None:
        with self._lock:
            self._entries[replica_id] = ReplicaEntry(expert, replica_id, address, version, self._clock(), node, metrics)

    def register_metrics(self, replica_id: str, metrics: str, labels: dict[str, str]) -> None:
        """A replica that serves no expert (a coordinator) listing its /metrics, labelled `labels`."""
        with self._lock:
            self._scraped[replica_id] = (metrics, dict(labels), self._clock())

    def scrape_targets(self) -> list[dict]:
        """The live replicas' /metrics in Prometheus's HTTP service-discovery format: the experts',
        labelled with the expert, the replica and the node, then the others' with their own labels."""
        targets = [{"targets": [e.metrics], "labels": {"expert": e.expert, "replica": e.replica_id, "node": e.node}}
                   for e in self.live() if e.metrics]
        with self._lock:
            now = self._clock()
            for replica_id in [r for r, (_, _, seen) in self._scraped.items() if now - seen > self.ttl_s]:
                del self._scraped[replica_id]
            others = sorted(self._scraped.items())
        return targets + [{"targets": [metrics], "labels": labels} for _, (metrics, labels, _) in others]

    def unregister(self, replica_id: str) -> bool:
        with self._lock:
            scraped = self._scraped.pop(replica_id, None) is not None
            return self._entries.pop(replica_id, None) is not None or scraped

    def live(self) -> list[ReplicaEntry]:
        """Entries heard from within `ttl_s`, by expert then replica id; expired ones are dropped."""
        with self._lock:
            now = self._clock()
            for replica_id in [r for r, e in self._entries.items() if now - e.seen > self.ttl_s]:
                del self._entries[replica_id]
            return sorted(self._entries.values(), key=lambda e: (e.expert, e.replica_id))

    def addresses(self, versions: dict[str, str] | None = None) -> dict[str, list[str]]:
        """Live addresses by expert; with `versions`, only those experts at those versions."""
        out: dict[str, list[str]] = {}
        for entry in self.live():
            if versions is None or versions.get(entry.expert) == entry.version:
                out.setdefault(entry.expert, []).append(entry.address)
        return out


def serve_targets(table: ReplicaTable, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server (its own threads) answering `GET /targets` with `table.scrape_targets()`."""

    class Targets(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != TARGETS_PATH:
                self.send_error(404, f"only {TARGETS_PATH} is served here")
                return
            body = json.dumps(table.scrape_targets()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # Prometheus polls often: debug, not stderr
            logger.debug("targets: " + format, *args)

    server = ThreadingHTTPServer((host, port), Targets)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="registry-targets", daemon=True).start()
    return server


@serve.deployment(
    name=REGISTRY_DEPLOYMENT,
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,  # tiny calls from every replica and coordinator
    logging_config={"enable_access_log": False},  # a heartbeat per replica every few seconds
    graceful_shutdown_wait_loop_s=0.5,
)
class ReplicaRegistry:
    def __init__(self, ttl_s: float = 10.0, host: str = "127.0.0.1", targets_port: int | None = None) -> None:
        self.table = ReplicaTable(ttl_s)
        self._targets = serve_targets(self.table, host, targets_port) if targets_port is not None else None
        if self._targets is not None:
            logger.info("scrape targets served at http://%s%s", self.targets_address(), TARGETS_PATH)

    def targets_address(self) -> str | None:
        """host:port of the HTTP service discovery (None: no `targets_port`)."""
        if self._targets is None:
            return None
        host, port = self._targets.server_address[:2]
        return f"{advertised_host(host)}:{port}"

    def __del__(self) -> None:
        if getattr(self, "_targets", None) is not None:
            self._targets.shutdown()
            self._targets.server_close()

    def register(self, expert: str, replica_id: str, address: str, version: str, node: str = "",
                 metrics: str = "") -> None:
        self.table.register(expert, replica_id, address, version, node, metrics)

    def register_metrics(self, replica_id: str, metrics: str, labels: dict[str, str]) -> None:
        self.table.register_metrics(replica_id, metrics, labels)

    def scrape_targets(self) -> list[dict]:
        return self.table.scrape_targets()

    def unregister(self, replica_id: str) -> bool:
        return self.table.unregister(replica_id)

    def addresses(self, versions: dict[str, str] | None = None) -> dict[str, list[str]]:
        return self.table.addresses(versions)

    def replicas(self) -> list[dict]:
        """Every live entry with its age in seconds (for operators and tests)."""
        now = time.monotonic()
        return [asdict(e) | {"age_s": now - e.seen} for e in self.table.live()]
