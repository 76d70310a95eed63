"""The Expert protocol over gRPC: one expert served by one or more replicas of `expert_server`.

Every step carries each session's whole token history, so any replica can answer it. A session
sticks to one replica (its KV cache lives there); new sessions go to the live replica holding the
fewest. When a replica fails a step (unreachable, shutting down, or past the step deadline) it is
marked down for `retry_after_s`, its sessions move to another replica and the step is resent there:
the new replica re-prefills the history and the request completes with unchanged output. With no
replica left the step raises `ExpertUnavailableError` naming the expert.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc
import torch

from fusion.config import ExpertConfig, SecurityConfig
from fusion.errors import ConfigError, ExpertOutputError, ExpertUnavailableError
from fusion.expert import ExpertInfo, StepRequest
from services.protos import expert_pb2, expert_pb2_grpc
from services.security import expert_channel_metadata, open_channel
from services.serving import channel_options
from services.status import error_from_rpc
from services.wire import decode_tensor, info_from_proto

logger = logging.getLogger(__name__)

# Codes after which the same call may succeed on another replica.
FAILOVER_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
})

# Reconnect quickly to a replica that comes back (gRPC's default backoff grows to two minutes).
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass
class _Replica:
    address: str
    channel: grpc.Channel
    stub: expert_pb2_grpc.ExpertStub
    down_until: float = 0.0
    last_error: str = ""
    sessions: set[str] = field(default_factory=set)  # sessions pinned here
    retired: bool = False  # no longer listed (see set_addresses): takes no sessions

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until


class RemoteExpert:
    """Thread-safe: the engine may step and score concurrently."""

    def __init__(
        self,
        config: ExpertConfig,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        timeout_s: float | None = None,
        retry_after_s: float = 5.0,
        wire_dtype: str = "",
        security: SecurityConfig | None = None,
    ) -> None:
        if not config.addresses:
            raise ConfigError(f"experts.{config.name}.addresses: a remote expert needs at least one address")
        self.name = config.name
        self.timeout_s = timeout_s or config.step_timeout_s
        self.retry_after_s = retry_after_s
        self.wire_dtype = wire_dtype
        options = channel_options(max_message_bytes) + _RECONNECT
        self._channel_options = options
        self._security = security  # TLS / client certificate / the expert secret on every channel
        self._metadata = expert_channel_metadata(security)
        self._replicas = []
        for address in config.addresses:
            channel = self._open(address)
            self._replicas.append(_Replica(address, channel, expert_pb2_grpc.ExpertStub(channel)))
        self._lock = threading.Lock()
        self._pinned: dict[str, int] = {}  # session -> replica index
        self._touched: dict[str, set[int]] = {}  # session -> replicas that may cache it
        self._releasing: set[grpc.Future] = set()  # release calls in flight
        self.failovers = 0
        self.replica_info = self._fetch_info()
        if self.replica_info.name != config.name:
            logger.warning("expert %r: its replicas serve an expert named %r", config.name, self.replica_info.name)
        # Logits land on this machine's CPU, whatever device the replicas compute on.
        self.info = dataclasses.replace(self.replica_info, name=config.name, device="cpu")

    def _open(self, address: str) -> grpc.Channel:
        return open_channel(address, self._security, self._channel_options, to_expert=True, metadata=self._metadata)

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._replicas if not r.retired]

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Follow a replica set that changes while serving (replicas started, moved or stopped by an
        orchestrator). New addresses get a channel and take new sessions; a replica no longer listed
        takes none, and its sessions move on their next step (a re-prefill elsewhere). An empty list
        is ignored: the last known replicas are kept."""
        wanted = list(dict.fromkeys(addresses))
        if not wanted:
            return
        with self._lock:
            known = {r.address: r for r in self._replicas}
            for address in wanted:
                replica = known.get(address)
                if replica is None:
                    channel = self._open(address)
                    self._replicas.append(_Replica(address, channel, expert_pb2_grpc.ExpertStub(channel)))
                elif replica.retired:
                    replica.retired, replica.down_until = False, 0.0
            for replica in self._replicas:
                if replica.address not in wanted and not replica.retired:
                    replica.retired = True
                    logger.info("expert %r: replica %s retired", self.name, replica.address)

    def close(self) -> None:
        for replica in self._replicas:
            replica.channel.close()

    def describe(self) -> ExpertInfo:
        return dataclasses.replace(self.info, device=self.replica_info.device)

    @property
    def active_sessions(self) -> int:
        return 0  # each replica reports its own (Expert.Info)

    # -- the expert contract -------------------------------------------------------------------
    def step(self, requests: Sequence[StepRequest]) -> torch.Tensor:
        """Next-token logits for each session: (B, V) float32 on the CPU."""
        if not requests:
            return torch.empty(0, self.info.vocab_size)

        def send(replica: _Replica, rows: list[int]) -> grpc.Future:
            message = expert_pb2.StepRequest(dtype=self.wire_dtype, sessions=[
                expert_pb2.SessionStep(session_id=requests[i].session_id, token_ids=requests[i].token_ids)
                for i in rows
            ])
            return replica.stub.Step.future(message, timeout=self.timeout_s)

        out: list[torch.Tensor | None] = [None] * len(requests)
        for rows, response, address in self._fan_out([r.session_id for r in requests], send):
            logits = self._logits(response.logits, len(rows), address)  # (b, V)
            for k, i in enumerate(rows):
                out[i] = logits[k]
        return torch.stack(out)

    def score(self, session_id: str, token_ids: Sequence[int], num_positions: int) -> torch.Tensor:
        """Logits predicting each of the last `num_positions` ids: (n, V) float32."""
        message = expert_pb2.ExpertScoreRequest(
            session_id=session_id, token_ids=list(token_ids), num_positions=num_positions, dtype=self.wire_dtype,
        )
        [(_, response, address)] = self._fan_out(
            [session_id], lambda replica, rows: replica.stub.Score.future(message, timeout=self.timeout_s)
        )
        return self._logits(response.logits, num_positions, address)

    def release(self, session_ids: Sequence[str]) -> None:
        """Free the sessions on every replica that may cache them. Does not wait for the replicas (the
        engine may call this under its scheduler's lock); a failed release is logged, and the replica's
        LRU drops the sessions anyway."""
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for session_id in session_ids:
                pinned = self._pinned.pop(session_id, None)
                if pinned is not None:
                    self._replicas[pinned].sessions.discard(session_id)
                for index in self._touched.pop(session_id, ()):
                    by_replica.setdefault(index, []).append(session_id)
        for index, ids in by_replica.items():
            replica = self._replicas[index]
            call = replica.stub.Release.future(expert_pb2.ReleaseRequest(session_ids=ids), timeout=self.timeout_s)
            with self._lock:
                self._releasing.add(call)
            call.add_done_callback(lambda done, address=replica.address: self._released(done, address))

    def _released(self, call: grpc.Future, address: str) -> None:
        with self._lock:
            self._releasing.discard(call)
        if call.exception() is not None:
            logger.warning("expert %r: release on %s failed: %s", self.name, address, call.code().name)

    # -- replicas ------------------------------------------------------------------------------
    def _fetch_info(self) -> ExpertInfo:
        failures = []
        for replica in self._replicas:
            try:
                return info_from_proto(replica.stub.Info(expert_pb2.InfoRequest(), timeout=self.timeout_s))
            except grpc.RpcError as err:
                failures.append(f"{replica.address}: {err.code().name} {err.details()}")
        raise ExpertUnavailableError(f"expert {self.name!r}: no replica answered Info ({'; '.join(failures)})")

    def _choose(self, session_id: str, failed: set[int]) -> int:
        """Under the lock: the session's replica, or a new one for it (live first, then fewest sessions)."""
        pinned = self._pinned.get(session_id)
        if (pinned is not None and pinned not in failed and not self._replicas[pinned].down
                and not self._replicas[pinned].retired):
            return pinned
        candidates = [i for i in range(len(self._replicas)) if i not in failed and not self._replicas[i].retired]
        if not candidates:
            reasons = "; ".join(f"{r.address}: {r.last_error or 'no answer'}" for r in self._replicas)
            raise ExpertUnavailableError(f"expert {self.name!r}: no replica could answer ({reasons})")
        chosen = min(candidates, key=lambda i: (self._replicas[i].down, len(self._replicas[i].sessions), i))
        if pinned is not None:
            self._replicas[pinned].sessions.discard(session_id)
            self.failovers += 1
        self._pinned[session_id] = chosen
        self._replicas[chosen].sessions.add(session_id)
        self._touched.setdefault(session_id, set()).add(chosen)
        return chosen

    def _mark_down(self, index: int, err: grpc.RpcError) -> None:
        replica = self._replicas[index]
        replica.last_error = f"{err.code().name} {err.details() or ''}".strip()
        replica.down_until = time.monotonic() + self.retry_after_s
        logger.warning("expert %r: replica %s is down (%s); failing over", self.name, replica.address,
                       replica.last_error)

    def _fan_out(
        self, session_ids: Sequence[str], send: Callable[[_Replica, list[int]], grpc.Future]
    ) -> list[tuple[list[int], Any, str]]:
        """Send each replica its sessions' rows at once; resend what a failed replica had to another.
        Returns (rows, response, address) per answering call."""
        failed: set[int] = set()  # replicas that failed during this call: never retried in it
        todo = list(range(len(session_ids)))
        done = []
        while todo:
            groups: dict[int, list[int]] = {}
            with self._lock:
                for row in todo:
                    groups.setdefault(self._choose(session_ids[row], failed), []).append(row)
            calls = {index: send(self._replicas[index], rows) for index, rows in groups.items()}
            todo = []
            for index, rows in groups.items():
                replica = self._replicas[index]
                try:
                    done.append((rows, calls[index].result(), replica.address))
                except grpc.RpcError as err:
                    if err.code() not in FAILOVER_CODES:
                        raise error_from_rpc(err, f"expert {self.name!r} ({replica.address})") from None
                    self._mark_down(index, err)
                    failed.add(index)
                    todo.extend(rows)
        return done

    def _logits(self, message: expert_pb2.Tensor, rows: int, address: str) -> torch.Tensor:
        where = f"expert {self.name!r} ({address})"
        logits = decode_tensor(message, where)
        if tuple(logits.shape) != (rows, self.info.vocab_size):
            raise ExpertOutputError(f"{where}: logits of shape {list(logits.shape)}, expected "
                                    f"{[rows, self.info.vocab_size]}")
        return logits
