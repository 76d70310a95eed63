"""The Expert protocol over gRPC: one expert served by one or more replicas of `expert_server`.

Every step carries each session's whole token history, so any replica can answer it. A session
sticks to one replica (its KV cache lives there); new sessions go to the live replica holding the
fewest. When a call to a replica fails (unreachable, shutting down, or past its deadline) the
sessions of that call, and only those, move to another replica and the call is resent there: the
new replica re-prefills the histories and the requests complete with unchanged output. Sessions of
other calls stay where they are unless the replica is marked down, which takes one of:

- UNAVAILABLE (connection refused or reset, or dropped by keepalive): the replica is gone;
- `failures_before_down` consecutive failed calls;
- a failed health check (`grpc.health.v1`, `health_check_timeout_s`), made after each timed-out or
  cancelled call: a replica that answers it is slow (one call's bad luck), not dead.

A down replica takes no sessions until its health check answers SERVING again (probed every
`retry_after_s`); its sessions move on their next step. With no
replica left a call raises `ExpertUnavailableError` naming the expert.

Deadlines: a Step call carrying only decode work (each of its sessions was stepped on that replica
before and adds at most `DECODE_IDS` ids since) gets `step_timeout_s`; a call with a session new to
the replica or more ids (prompt work) gets `prefill_timeout_s`, as do Score calls. Channels send
keepalive pings (`fusion.services.serving.KEEPALIVE_TIME_MS`), so a peer that vanished is noticed within
seconds even between calls.

Score answers are split so each fits the message limit: positions go in chunks of at most
`score_rows_per_call()` logits rows, each call sending the history up to its chunk's end, and the
replica keeps the session's cache between chunks (only the new ids are computed).

A replica refuses a Step or Score naming a session already released there (FAILED_PRECONDITION):
this happens only after this coordinator released it, so that request is over; the call raises
`SessionReleasedError` and no replica is blamed. RESOURCE_EXHAUSTED (a replica's limits) is raised as
`ResourceExhaustedError` naming the limit, also without blaming the replica.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fusion.config import ExpertConfig, SecurityConfig
from fusion.errors import ConfigError, ExpertOutputError, ExpertUnavailableError
from fusion.experts.expert import ExpertInfo, StepRequest
from fusion.services import tracing
from fusion.services.protos import EXPERT_SERVICE, expert_pb2, expert_pb2_grpc
from fusion.services.expert_auth import expert_channel_metadata
from fusion.services.tls import open_channel
from fusion.services.serving import channel_options, keepalive_channel_options
from fusion.services.status import error_from_rpc
from fusion.services.wire import WIRE_DTYPES, decode_tensor, info_from_proto, wire_dtype

logger = logging.getLogger(__name__)

# Codes after which the same call may succeed on another replica.
FAILOVER_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
})
# Of those, the ones that say the replica is gone: it is marked down at once.
DOWN_AT_ONCE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})

# A Step call is decode work when each of its sessions was stepped on that replica before and adds at
# most this many ids since (one per decode step; a few more cost a decode step next to nothing).
DECODE_IDS = 8

# Bytes of a Score answer beyond its logits (message framing, dtype, shape: under 100), with room to spare.
MESSAGE_MARGIN_BYTES = 4096

# A release that fails is sent again this many times in all, after retry_after_s, 2x, 4x ... (a
# replica that stalled and came back frees the sessions moved away from it).
RELEASE_ATTEMPTS = 5

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
    failures: int = 0  # consecutive failed calls
    probing: bool = False  # a thread is waiting for it to pass a health check (it is down meanwhile)
    probes: int = 0  # health checks made while it was down
    keeps_histories: bool | None = None  # Step may send only new ids (its Info says; None: not asked yet)

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until

    @property
    def health(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel)


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
        max_sessions_per_call: int | None = None,
    ) -> None:
        if not config.addresses:
            raise ConfigError(f"experts.{config.name}.addresses: a remote expert needs at least one address")
        self.name = config.name
        self.timeout_s = timeout_s or config.step_timeout_s  # decode steps (and Release, Info)
        self.prefill_timeout_s = max(config.prefill_timeout_s, self.timeout_s)  # prompt work, Score
        self.failures_before_down = config.failures_before_down
        self.health_check_timeout_s = config.health_check_timeout_s
        self.retry_after_s = retry_after_s
        self.wire_dtype = wire_dtype
        self.max_message_bytes = max_message_bytes
        self.max_sessions_per_call = max_sessions_per_call  # a Step call's sessions (limits.max_sessions_per_step)
        options = channel_options(max_message_bytes) + keepalive_channel_options() + _RECONNECT
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
        self._closed = False
        self._closing = threading.Event()
        self._channels_lock = threading.Lock()  # held by close() and by health probes of down replicas
        self._stepped: dict[str, tuple[int, int]] = {}  # session -> (replica, history length) of its last step
        # session -> (replica, history) of its last Step there: what that replica holds of it, so the next
        # Step sends only the ids after it (SessionStep.known_length)
        self._sent: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.failovers = 0  # sessions moved to another replica
        self.failed_calls = 0  # calls that failed over (timed out, cancelled, unreachable)
        self._message_limit = max_message_bytes  # of a Score answer: this channel's and the replicas' (Info)
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
        self._closing.set()
        with self._channels_lock:
            self._closed = True
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

        def send(index: int, rows: list[int]) -> grpc.Future:
            if self._replicas[index].keeps_histories is None:
                self._ask_keeps_histories(index)
            with self._lock:
                known = [self._known_length(index, requests[i]) for i in rows]
            message = expert_pb2.StepRequest(dtype=self.wire_dtype, sessions=[
                expert_pb2.SessionStep(session_id=requests[i].session_id, token_ids=requests[i].token_ids[n:],
                                       known_length=n)
                for i, n in zip(rows, known)
            ])
            timeout = self._step_timeout(index, [requests[i] for i in rows])
            if not tracing.active():
                return self._replicas[index].stub.Step.future(message, timeout=timeout)
            span, metadata = tracing.start_expert_call(self.name, "Step", [requests[i].session_id for i in rows],
                                                       self._replicas[index].address)
            try:
                call = self._replicas[index].stub.Step.future(message, timeout=timeout, metadata=metadata)
            except BaseException as err:
                tracing.fail(span, err)
                tracing.end_expert_call(span, None)
                raise
            call.add_done_callback(lambda done: tracing.end_expert_call(span, done))
            return call

        out: list[torch.Tensor | None] = [None] * len(requests)
        for rows, response, index in self._fan_out([r.session_id for r in requests], send,
                                                   self.max_sessions_per_call, resend_whole=True):
            logits = self._logits(response.logits, len(rows), self._replicas[index].address)  # (b, V)
            with self._lock:
                for k, i in enumerate(rows):
                    out[i] = logits[k]
                    session_id = requests[i].session_id
                    if self._pinned.get(session_id) == index:  # not released meanwhile
                        self._stepped[session_id] = (index, len(requests[i].token_ids))
                        self._sent[session_id] = (index, tuple(requests[i].token_ids))
        return torch.stack(out)

    def _ask_keeps_histories(self, index: int) -> None:
        """Learn from a replica's Info whether it keeps histories (a replica from before the field does
        not, and would read new ids alone as a whole history); unanswered, it is asked again later."""
        replica = self._replicas[index]
        try:
            replica.keeps_histories = replica.stub.Info(expert_pb2.InfoRequest(), timeout=self.timeout_s).keeps_histories
        except grpc.RpcError as err:
            logger.info("expert %r: %s did not answer Info (%s); its steps send whole histories for now",
                        self.name, replica.address, err.code().name)

    def _known_length(self, index: int, request: StepRequest) -> int:
        """Under the lock: how many leading ids of the request's history replica `index` holds from the
        session's last Step there (0: send it whole)."""
        sent = self._sent.get(request.session_id)
        if sent is None or sent[0] != index or not self._replicas[index].keeps_histories:
            return 0
        history = sent[1]
        n = len(history)
        return n if n <= len(request.token_ids) and tuple(request.token_ids[:n]) == history else 0

    def score(self, session_id: str, token_ids: Sequence[int], num_positions: int) -> torch.Tensor:
        """Logits predicting each of the last `num_positions` ids: (n, V) float32. Asked in chunks of
        positions whose logits fit a message; each chunk sends the history up to its end, and the
        replica computes only the ids its cache of the session lacks."""
        token_ids = list(token_ids)
        total = len(token_ids)
        if not 0 < num_positions < total:  # the replica names the problem
            return self._score_call(session_id, token_ids, num_positions)
        per_call = self.score_rows_per_call()
        parts = [self._score_call(session_id, token_ids[:end], end - start)
                 for start in range(total - num_positions, total, per_call)
                 for end in [min(start + per_call, total)]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def extend(self, session_id: str, token_ids: Sequence[int], extensions: Sequence[Sequence[int]]
               ) -> torch.Tensor:
        """Logits after the history extended by each extension: (k, V) float32 (see `LocalExpert.extend`).
        Sent to the replica that holds the session, like its steps."""
        message = expert_pb2.ExtendRequest(
            session_id=session_id, token_ids=list(token_ids), dtype=self.wire_dtype,
            extensions=[expert_pb2.Extension(token_ids=list(e)) for e in extensions],
        )
        [(_, response, index)] = self._fan_out(
            [session_id],
            lambda index, rows: self._replicas[index].stub.Extend.future(message, timeout=self.prefill_timeout_s),
        )
        with self._lock:
            if self._pinned.get(session_id) == index:
                self._stepped[session_id] = (index, len(token_ids))
        return self._logits(response.logits, len(extensions), self._replicas[index].address)

    def score_rows_per_call(self) -> int:
        """Logits rows of one Score answer: as many as fit the message limit (of this channel and of
        the replicas), at least one."""
        dtype = WIRE_DTYPES[wire_dtype(self.wire_dtype, self.replica_info.dtype)]
        row_bytes = self.info.vocab_size * torch.empty((), dtype=dtype).element_size()
        return max(1, (self._message_limit - MESSAGE_MARGIN_BYTES) // row_bytes)

    def _score_call(self, session_id: str, token_ids: list[int], num_positions: int) -> torch.Tensor:
        message = expert_pb2.ExpertScoreRequest(
            session_id=session_id, token_ids=token_ids, num_positions=num_positions, dtype=self.wire_dtype,
        )
        [(_, response, index)] = self._fan_out(
            [session_id],
            lambda index, rows: self._replicas[index].stub.Score.future(message, timeout=self.prefill_timeout_s),
        )
        return self._logits(response.logits, num_positions, self._replicas[index].address)

    def release(self, session_ids: Sequence[str]) -> None:
        """Free the sessions on every replica that may cache them. Does not wait for the replicas (the
        engine may call this under its scheduler's lock); a failed release is logged, and the replica's
        LRU drops the sessions anyway."""
        by_replica: dict[int, list[str]] = {}
        for session_id, touched in self._forget(session_ids).items():
            for index in touched:
                by_replica.setdefault(index, []).append(session_id)
        for index, ids in by_replica.items():
            self._send_release(index, ids, attempt=0)

    def _send_release(self, index: int, ids: list[str], attempt: int) -> None:
        replica = self._replicas[index]
        with self._channels_lock:  # a retry from a timer must not race close()
            if self._closed:
                return
            call = replica.stub.Release.future(expert_pb2.ReleaseRequest(session_ids=ids), timeout=self.timeout_s)
        with self._lock:
            self._releasing.add(call)
        call.add_done_callback(lambda done: self._released(done, index, ids, attempt))

    def _forget(self, session_ids: Sequence[str]) -> dict[str, set[int]]:
        """Unpin the sessions; returns the replicas that may cache each."""
        touched = {}
        with self._lock:
            for session_id in session_ids:
                pinned = self._pinned.pop(session_id, None)
                if pinned is not None:
                    self._replicas[pinned].sessions.discard(session_id)
                self._stepped.pop(session_id, None)
                self._sent.pop(session_id, None)
                touched[session_id] = self._touched.pop(session_id, set())
        return touched

    def _released(self, call: grpc.Future, index: int, ids: list[str], attempt: int) -> None:
        """A failed release (the replica was unreachable or stalled) is sent again after a backoff, a
        few times, so a replica that comes back does not keep the sessions until its LRU drops them."""
        with self._lock:
            self._releasing.discard(call)
        if call.exception() is None:
            return
        address = self._replicas[index].address
        if attempt + 1 >= RELEASE_ATTEMPTS or self._closed:
            logger.warning("expert %r: release of %d session(s) on %s failed %d times (%s); its LRU will drop them",
                           self.name, len(ids), address, attempt + 1, call.code().name)
            return
        delay = self.retry_after_s * 2 ** attempt
        logger.info("expert %r: release on %s failed (%s); retrying in %.0f s", self.name, address,
                    call.code().name, delay)
        timer = threading.Timer(delay, self._send_release, args=(index, ids, attempt + 1))
        timer.daemon = True
        timer.start()

    # -- replicas ------------------------------------------------------------------------------
    def _fetch_info(self) -> ExpertInfo:
        failures = []
        for replica in self._replicas:
            try:
                message = replica.stub.Info(expert_pb2.InfoRequest(), timeout=self.timeout_s)
            except grpc.RpcError as err:
                failures.append(f"{replica.address}: {err.code().name} {err.details()}")
                continue
            if message.limits.max_message_bytes > 0:  # the replica's own send limit
                self._message_limit = min(self.max_message_bytes, message.limits.max_message_bytes)
            replica.keeps_histories = message.keeps_histories
            return info_from_proto(message)
        raise ExpertUnavailableError(f"expert {self.name!r}: no replica answered Info ({'; '.join(failures)})")

    def _step_timeout(self, index: int, requests: Sequence[StepRequest]) -> float:
        """The decode deadline when every session continues its last step on this replica by at most
        DECODE_IDS ids; else (a session new here, a prompt chunk) the prefill deadline."""
        for request in requests:
            last = self._stepped.get(request.session_id)
            if last is None or last[0] != index or not 0 < len(request.token_ids) - last[1] <= DECODE_IDS:
                return self.prefill_timeout_s
        return self.timeout_s

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

    def _call_failed(self, index: int, err: grpc.RpcError, sessions: int) -> None:
        """A call to replica `index` failed with a failover code: its sessions move (the caller resends
        them elsewhere); mark the replica down if it is gone, failed too often, or fails a health check."""
        replica = self._replicas[index]
        code = err.code()
        with self._lock:
            self.failed_calls += 1
            replica.failures += 1
            failures = replica.failures
            replica.last_error = f"{code.name} {err.details() or ''}".strip()
        if code in DOWN_AT_ONCE_CODES:
            why = "unreachable"
        elif failures >= self.failures_before_down:
            why = f"{failures} failed calls in a row"
        elif not self._answers_health_check(replica):
            why = "no answer to a health check"
        else:
            logger.warning("expert %r: a call to replica %s failed (%s); its %d session(s) move, the replica "
                           "stays up (%d of %d failures before it is marked down)", self.name, replica.address,
                           replica.last_error, sessions, failures, self.failures_before_down)
            return
        with self._lock:
            replica.down_until = math.inf  # until a health check passes (_probe_until_healthy)
            replica.failures = 0
            probe = not replica.probing
            replica.probing = True
        logger.warning("expert %r: replica %s is down (%s: %s); its sessions move", self.name, replica.address,
                       why, replica.last_error)
        if probe:
            threading.Thread(target=self._probe_until_healthy, args=(replica,), daemon=True,
                             name=f"probe-{self.name}-{replica.address}").start()

    def _probe_until_healthy(self, replica: _Replica) -> None:
        """A down replica takes sessions again only once its health check answers SERVING (probed every
        `retry_after_s`): a stalled replica that merely outlived a timer would otherwise get the next
        new sessions (it holds the fewest) and stall their prefill for its whole deadline."""
        try:
            while not self._closing.wait(self.retry_after_s) and not replica.retired:
                with self._channels_lock:  # close() must not shut the channel under the probe
                    replica.probes += 1
                    if self._closed or not self._answers_health_check(replica):
                        continue
                with self._lock:
                    replica.down_until = 0.0
                logger.info("expert %r: replica %s answers its health check again", self.name, replica.address)
                return
        finally:
            with self._lock:
                replica.probing = False

    def _call_succeeded(self, index: int) -> None:
        replica = self._replicas[index]
        if replica.failures:
            with self._lock:
                replica.failures = 0

    def _answers_health_check(self, replica: _Replica) -> bool:
        try:
            answer = replica.health.Check(health_pb2.HealthCheckRequest(service=EXPERT_SERVICE),
                                          timeout=self.health_check_timeout_s)
        except grpc.RpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def _fan_out(
        self, session_ids: Sequence[str], send: Callable[[int, list[int]], grpc.Future],
        max_rows: int | None = None, resend_whole: bool = False,
    ) -> list[tuple[list[int], Any, int]]:
        """Send each replica its sessions' rows at once (in calls of at most `max_rows`); resend what a
        failed call had to another replica, and (`resend_whole`) what a replica answered ABORTED to, its
        histories whole, to the same replica. Returns (rows, response, replica index) per answering call."""
        failed: set[int] = set()  # replicas that failed during this call: never retried in it
        resent: set[int] = set()  # rows sent again whole: a second ABORTED is an error
        todo = list(range(len(session_ids)))
        done = []
        while todo:
            groups: dict[int, list[int]] = {}
            with self._lock:
                for row in todo:
                    groups.setdefault(self._choose(session_ids[row], failed), []).append(row)
            size = max_rows or len(session_ids)
            calls = [(index, rows[k: k + size], send(index, rows[k: k + size]))
                     for index, rows in groups.items() for k in range(0, len(rows), size)]
            todo = []
            for index, rows, call in calls:
                replica = self._replicas[index]
                try:
                    response = call.result()
                except grpc.RpcError as err:
                    if resend_whole and err.code() == grpc.StatusCode.ABORTED and not resent & set(rows):
                        resent.update(rows)  # the replica lacks a session's history
                        with self._lock:
                            for row in rows:
                                self._sent.pop(session_ids[row], None)
                        todo.extend(rows)
                        continue
                    if err.code() not in FAILOVER_CODES:
                        if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # released before: nothing to pin
                            self._forget([session_ids[row] for row in rows])
                        raise error_from_rpc(err, f"expert {self.name!r} ({replica.address})") from None
                    self._call_failed(index, err, len(rows))
                    failed.add(index)
                    todo.extend(rows)
                    continue
                self._call_succeeded(index)
                done.append((rows, response, index))
        return done

    def _logits(self, message: expert_pb2.Tensor, rows: int, address: str) -> torch.Tensor:
        where = f"expert {self.name!r} ({address})"
        logits = decode_tensor(message, where)
        if tuple(logits.shape) != (rows, self.info.vocab_size):
            raise ExpertOutputError(f"{where}: logits of shape {list(logits.shape)}, expected "
                                    f"{[rows, self.info.vocab_size]}")
        return logits
