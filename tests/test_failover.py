"""Isolation between streams on remote experts: real expert servers on loopback, tiny experts.

A slow or black-holed replica costs one decode deadline and moves only the sessions of the call that
timed out; a replica is marked down only when it is unreachable, fails a health check or fails
repeatedly; an expert server drops steps whose caller gave up, never recomputes a released session,
refuses work past its limits naming the limit, and keeps answering Info and health while its worker
is busy. What a remote expert answers when its replicas are well is tests/test_remote_expert.py's subject.

"Busy" and "hung" replicas are real ones whose only worker thread is kept on a job (a wait on an
event) until the test lets it go: the calls queue behind it exactly as behind a long forward.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fusion.config import Limits, parse_config
from fusion.errors import SessionReleasedError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.services.client import FusionClient
from fusion.services.coordinator import create_coordinator_server
from fusion.services.expert_server import create_expert_server
from fusion.services.protos import EXPERT_SERVICE, expert_pb2, expert_pb2_grpc
from fusion.services.remote_expert import RemoteExpert
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S, wait_until
from tests.test_remote_expert import addr, local_step, reference, start  # noqa: F401  the same servers and reference (fixtures)

HISTORY = [5, 17, 42, 99, 3, 250, 8, 61]


@pytest.fixture(autouse=True)
def let_workers_go(start):  # torn down before `start` stops the servers
    yield
    while Busy.held:
        Busy.held.pop().set()




def remote_a(tiny_config, ports, **fields) -> RemoteExpert:
    config = tiny_config.expert("a").model_copy(update={"addresses": [addr(p) for p in ports], **fields})
    return RemoteExpert(config)


class Busy:
    """Keeps a server's one worker thread on a job until `go()` (or `hold_s`): what follows queues."""

    held: list[threading.Event] = []  # let go after each test, whatever it asserted

    def __init__(self, server, hold_s: float = 60.0) -> None:
        self.event, started = threading.Event(), threading.Event()
        Busy.held.append(self.event)

        def hold() -> None:
            started.set()
            self.event.wait(hold_s)

        self.job = server.servicer._executor.submit(server.servicer._timed, hold)
        assert started.wait(10), "the worker did not take the busy job"  # from here on, what is submitted queues

    def go(self) -> None:
        self.event.set()
        self.job.result(10)


def step_calls(server, in_flight: int, queued: int) -> bool:
    """`in_flight` Step calls arrived, `queued` of them wait in the queue (the others the drainer took to the
    worker). The queue alone says too little: empty, or of one call, also before a call arrives, when two
    calls could then share one batch."""
    return server.servicer._in_flight == in_flight and len(server.servicer._queue) == queued


def batches_behind_busy(server) -> int:
    """Batches the drainer handed to the worker that wait behind a `Busy` job: true from the hand-over
    until the worker is let go, whatever becomes of the calls (a call in flight is not: its deadline
    ends it)."""
    return server.servicer._executor._work_queue.qsize()


def forwards(server) -> float:
    """Batched forwards the server has run (its step histogram's count)."""
    value = server.metrics.registry.get_sample_value("fusion_expert_step_seconds_count", {"expert": "a"})
    return value or 0.0


def dropped(server) -> float:
    return server.metrics.registry.get_sample_value("fusion_expert_dropped_sessions_total") or 0.0


# Deadlines here: a decode deadline far past a tiny step on a loaded host (healthy replicas must never
# miss it), paid in wall time only where a replica is held on purpose; a prefill deadline past the hang
# bound, so "the decode deadline, not the prefill one, was waited" is a wait shorter than HANG_S.
DECODE_S = 5.0
PREFILL_S = 2 * HANG_S


# -- a slow replica: one call's sessions move, the replica stays up -----------------------------------
def test_a_timed_out_call_moves_only_its_sessions_and_the_replica_stays_up(start, tiny_config, reference):
    (slow, slow_port), (_, other_port) = start(), start()
    remote = remote_a(tiny_config, [slow_port, other_port], step_timeout_s=DECODE_S, prefill_timeout_s=PREFILL_S)
    try:
        histories = {s: HISTORY + [i] for i, s in enumerate(["s1", "s2", "s3"])}
        for session, history in histories.items():  # new sessions go to the replica holding the fewest
            remote.step([StepRequest(session, history)])
        assert remote._pinned == {"s1": 0, "s2": 1, "s3": 0}

        busy = Busy(slow)
        started = time.monotonic()
        histories["s1"].append(7)
        logits = remote.step([StepRequest("s1", histories["s1"])])  # decode: times out after DECODE_S
        # one decode deadline, not the prefill one (waiting that would alone take 2 x HANG_S)
        assert DECODE_S <= time.monotonic() - started < HANG_S
        assert torch.allclose(logits[0], local_step(reference, histories["s1"]), atol=1e-4)
        assert remote._pinned == {"s1": 1, "s2": 1, "s3": 0}  # s1 moved; s3, in no failed call, stayed
        assert remote.failed_calls == 1 and remote.failovers == 1
        assert not remote._replicas[0].down  # it answered the health check: slow, not dead

        busy.go()
        assert wait_until(lambda: dropped(slow) == 1)  # the timed-out step was not computed there
        histories["s3"].append(7)
        remote.step([StepRequest("s3", histories["s3"])])
        assert remote._pinned["s3"] == 0 and remote.failovers == 1
        assert remote._replicas[0].failures == 0  # an answer resets the count
    finally:
        remote.close()


def test_prompt_work_gets_the_prefill_deadline(start, tiny_config, reference):
    (slow, slow_port), = [start()]
    remote = remote_a(tiny_config, [slow_port], step_timeout_s=DECODE_S, prefill_timeout_s=PREFILL_S)
    try:
        busy = Busy(slow, hold_s=DECODE_S + 1.0)  # longer than the decode deadline
        logits = remote.step([StepRequest("new", HISTORY)])  # a new session: prompt work
        assert remote.failed_calls == 0
        assert torch.allclose(logits[0], local_step(reference, HISTORY), atol=1e-4)
        busy.job.result(HANG_S)
        assert remote._step_timeout(0, [StepRequest("new", HISTORY + [1])]) == DECODE_S
        assert remote._step_timeout(0, [StepRequest("new", HISTORY + list(range(20)))]) == PREFILL_S
        assert remote._step_timeout(0, [StepRequest("other", HISTORY + [1])]) == PREFILL_S
    finally:
        remote.close()


def test_repeated_failures_mark_a_replica_down(start, tiny_config):
    (slow, slow_port), (_, other_port) = start(), start()
    remote = remote_a(tiny_config, [slow_port, other_port], step_timeout_s=DECODE_S, failures_before_down=3)
    try:
        sessions = [f"s{i}" for i in range(8)]
        for i, session in enumerate(sessions):
            remote.step([StepRequest(session, HISTORY + [i])])
        on_slow = [s for s in sessions if remote._pinned[s] == 0]
        assert len(on_slow) == 4
        busy = Busy(slow)
        for k, session in enumerate(on_slow[:3]):
            assert not remote._replicas[0].down
            remote.step([StepRequest(session, HISTORY + [sessions.index(session), 1])])
            assert remote._pinned[session] == 1 and remote.failed_calls == k + 1
        assert remote._replicas[0].down  # three failed calls in a row
        # Its last session moves on its next step without waiting for a deadline.
        remote.step([StepRequest(on_slow[3], HISTORY + [sessions.index(on_slow[3]), 1])])
        # no call to the down replica, so no deadline waited: a call that had timed out would count
        assert remote._pinned[on_slow[3]] == 1 and remote.failed_calls == 3
        busy.go()
    finally:
        remote.close()


class BlackHole:
    """A TCP proxy to a server that, once `frozen`, drops every byte both ways without closing anything
    (a node powered off or partitioned). It freezes itself after `freeze_after` bytes came back."""

    def __init__(self, upstream_port: int, freeze_after: int | None = None) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.freeze_after = freeze_after
        self.returned = 0
        self.frozen = threading.Event()
        self.closed = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, returning: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.frozen.is_set():
                continue  # dropped
            try:
                sink.sendall(data)
            except OSError:
                return
            if returning:
                self.returned += len(data)
                if self.freeze_after is not None and self.returned >= self.freeze_after:
                    self.frozen.set()

    def close(self) -> None:
        self.closed = True
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def test_a_black_holed_replica_costs_one_decode_deadline(loop, start, tiny_dir, tiny_config, tiny_service, reference):
    """Mid-stream, the replica holding the stream's session stops answering anything (its packets are
    dropped). The stream goes on on the other replica after one decode deadline, unchanged."""
    sampling = {"max_tokens": 120, "ignore_eos": True}
    expected = tiny_service.complete("black hole", sampling).token_ids
    (_, behind_port), (_, other_port) = start(), start()
    b, b_port = loop.run(create_expert_server(LocalExpert.load(tiny_config.expert("b")), tiny_config.limits))
    c, c_port = loop.run(create_expert_server(LocalExpert.load(tiny_config.expert("c")), tiny_config.limits))
    row_bytes = 4 * reference.info.vocab_size  # float32 logits
    hole = BlackHole(behind_port, freeze_after=8 * row_bytes)  # after a few decode steps' answers
    data = tiny_config_dict(tiny_dir, limits={"max_prompt_tokens": 256, "max_tokens": 400})
    addresses = {"a": [addr(hole.port), addr(other_port)], "b": [addr(b_port)], "c": [addr(c_port)]}
    for expert in data["experts"]:
        expert.update(addresses=addresses[expert["name"]], step_timeout_s=DECODE_S, prefill_timeout_s=PREFILL_S)
    server, port = loop.run(create_coordinator_server(parse_config(data)))
    try:
        remote = server.servicer.service.experts[0]
        with FusionClient(addr(port), timeout=PREFILL_S + HANG_S) as client:
            started = time.monotonic()
            got = [e.token.token_id for e in client.generate("black hole", sampling)]
        assert hole.frozen.is_set()
        assert got == expected
        assert remote.failed_calls == 1 and remote.failovers == 1  # one decode deadline, one session moved
        assert remote._replicas[0].down  # it did not answer the health check either
        assert time.monotonic() - started < HANG_S  # the prefill deadline (2 x HANG_S) was not waited
    finally:
        loop.run(server.stop(0))
        hole.close()
        for expert_server in (b, c):
            loop.run(expert_server.stop(0))


def test_an_unreachable_replica_is_marked_down_at_once(start, tiny_config):
    (_, port), = [start()]
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead_port = closed.getsockname()[1]
    remote = remote_a(tiny_config, [port, dead_port], step_timeout_s=DECODE_S)
    try:
        remote._pinned["s"] = 1  # pretend the session lived on the replica that is gone now
        remote._replicas[1].sessions.add("s")
        remote.step([StepRequest("s", HISTORY)])
        assert remote._replicas[1].down and remote._pinned["s"] == 0 and remote.failed_calls == 1
        assert "UNAVAILABLE" in remote._replicas[1].last_error
    finally:
        remote.close()


# -- the expert server ------------------------------------------------------------------------------
def test_a_released_session_is_refused_and_never_recreated(start, tiny_config):
    server, port = start()
    cache = server.servicer.expert.cache
    with grpc.insecure_channel(addr(port)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)

        def step(*sessions: str):
            return stub.Step.future(expert_pb2.StepRequest(sessions=[
                expert_pb2.SessionStep(session_id=s, token_ids=HISTORY) for s in sessions]), timeout=HANG_S)

        step("gone").result()
        assert len(cache) == 1
        stub.Release(expert_pb2.ReleaseRequest(session_ids=["gone"]), timeout=10)
        assert len(cache) == 0
        for call in (lambda: step("gone").result(),
                     lambda: stub.Score(expert_pb2.ExpertScoreRequest(session_id="gone", token_ids=HISTORY,
                                                                      num_positions=2), timeout=10)):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'gone'" in caught.value.details() and "released" in caught.value.details()
        assert len(cache) == 0

        # A step queued when its session is released is refused, not computed after the release.
        busy = Busy(server)
        first = step("first")  # taken by the worker's queue at once
        assert wait_until(lambda: step_calls(server, 1, queued=0))
        late = step("late")  # waits for the next forward
        assert wait_until(lambda: step_calls(server, 2, queued=1))
        release = stub.Release.future(expert_pb2.ReleaseRequest(session_ids=["late"]), timeout=HANG_S)
        assert wait_until(lambda: "late" in server.servicer.released)
        busy.go()
        first.result()
        with pytest.raises(grpc.RpcError) as caught:
            late.result()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        release.result()
        assert "late" not in cache and "first" in cache


def test_the_coordinator_side_blames_no_replica_for_a_released_session(start, tiny_config):
    (server, port), = [start()]
    remote = remote_a(tiny_config, [port])
    try:
        remote.step([StepRequest("done", HISTORY)])
        remote.release(["done"])
        assert wait_until(lambda: len(server.servicer.expert.cache) == 0)
        with pytest.raises(SessionReleasedError, match="'done'"):
            remote.step([StepRequest("done", HISTORY + [1])])
        assert remote.failed_calls == 0 and not remote._replicas[0].down
        assert len(server.servicer.expert.cache) == 0
        remote.step([StepRequest("next", HISTORY)])  # others go on
    finally:
        remote.close()


def test_a_queued_step_whose_deadline_passed_is_not_computed(start):
    server, port = start()
    with grpc.insecure_channel(addr(port)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)

        def step(session: str, timeout: float):
            return stub.Step.future(expert_pb2.StepRequest(sessions=[
                expert_pb2.SessionStep(session_id=session, token_ids=HISTORY)]), timeout=timeout)

        before = forwards(server)
        busy = Busy(server)
        handed = step("handed", 0.5)  # handed to the worker, behind the busy job
        assert wait_until(lambda: batches_behind_busy(server) == 1 and server.servicer._queue == [])
        patient = step("patient", 60)
        impatient = step("impatient", 0.5)  # queued behind `patient`
        for call in (handed, impatient):
            with pytest.raises(grpc.RpcError) as caught:
                call.result()
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        busy.go()
        patient.result()
        cache = server.servicer.expert.cache
        assert "patient" in cache and "handed" not in cache and "impatient" not in cache
        assert forwards(server) == before + 1  # only `patient`'s
        assert dropped(server) == 2


def test_limits_refuse_with_resource_exhausted_naming_the_limit(start):
    server, port = start(Limits(max_concurrent_rpcs=2, max_queued_steps=2, max_sessions_per_step=3))
    with grpc.insecure_channel(addr(port)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)

        def step(*sessions: str):
            return stub.Step.future(expert_pb2.StepRequest(sessions=[
                expert_pb2.SessionStep(session_id=s, token_ids=HISTORY) for s in sessions]), timeout=HANG_S)

        def refused(call, limit: str) -> None:
            with pytest.raises(grpc.RpcError) as caught:
                call.result()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"limits.{limit}=" in caught.value.details()

        refused(step("a", "b", "c", "d"), "max_sessions_per_step")
        busy = Busy(server)
        first = step("x")  # handed to the worker
        assert wait_until(lambda: step_calls(server, 1, queued=0))
        second = step("y", "z")  # two sessions queued
        assert wait_until(lambda: step_calls(server, 2, queued=1))
        refused(step("w"), "max_queued_steps")
        score = stub.Score.future(expert_pb2.ExpertScoreRequest(session_id="s", token_ids=HISTORY, num_positions=2),
                                  timeout=HANG_S)
        refused(score, "max_concurrent_rpcs")  # two Step calls in flight
        # Info and health still answer: they never wait for the worker.
        assert stub.Info(expert_pb2.InfoRequest(), timeout=10).name == "a"
        busy.go()
        first.result(), second.result()
        step("after").result()


def test_info_and_health_answer_while_a_long_score_runs(start):
    server, port = start()
    with grpc.insecure_channel(addr(port)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        busy = Busy(server)  # the score's forward, as long as the test wants
        score = stub.Score.future(expert_pb2.ExpertScoreRequest(session_id="s", token_ids=HISTORY, num_positions=4),
                                  timeout=HANG_S)
        assert wait_until(lambda: server.servicer._in_flight == 1)
        for _ in range(3):
            assert stub.Info(expert_pb2.InfoRequest(), timeout=HANG_S).name == "a"
            status = health.Check(health_pb2.HealthCheckRequest(service=EXPERT_SERVICE), timeout=HANG_S).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        assert not score.done()
        assert server.servicer.worker_busy_s() > 0
        busy.go()
        assert list(score.result().logits.shape) == [4, server.servicer.expert.info.vocab_size]
        assert server.servicer.worker_busy_s() == 0


def test_released_sessions_are_remembered_within_a_bound():
    from fusion.services.expert_server import ReleasedSessions

    released = ReleasedSessions(capacity=3)
    long_id = "x" * 10_000
    released.add(["a", "b", long_id])
    assert "a" in released and long_id in released and "x" * 9_999 not in released
    released.add(["c", "d"])  # the oldest are forgotten first
    assert len(released) == 3 and "a" not in released and "b" not in released
    assert released.first_of(["zz", "d", "c"]) == "d"


def test_a_release_that_timed_out_is_sent_again(start, tiny_config):
    """A replica that stalls while its sessions are released (its worker held past the deadline) frees
    them once it answers again: the release is retried with backoff, not left to its LRU."""
    server, port = start()
    config = tiny_config.expert("a").model_copy(update={"addresses": [addr(port)], "step_timeout_s": 0.5})
    remote = RemoteExpert(config, retry_after_s=0.2)
    remote.step([StepRequest("stalled-release", HISTORY)])
    assert "stalled-release" in server.servicer.expert.cache
    busy = Busy(server)
    remote.release(["stalled-release"])
    # the first release times out behind the held worker (none is in flight until its retry is sent)
    assert wait_until(lambda: not remote._releasing, interval_s=0.01)
    assert "stalled-release" in server.servicer.expert.cache
    busy.go()
    assert wait_until(lambda: "stalled-release" not in server.servicer.expert.cache)
    remote.close()


def test_a_down_replica_takes_no_sessions_until_its_health_check_passes(loop, start, tiny_config):
    """Marked down, a replica stays down until it answers its health check again: a dead (or stalled)
    replica that merely outlived a timer would get the next new sessions (it holds the fewest) and
    make each of them fail over, or stall its prefill for a whole deadline."""
    (gone, gone_port), (alive, alive_port) = start(), start()
    remote = RemoteExpert(tiny_config.expert("a").model_copy(update={"addresses": [addr(gone_port),
                                                                                   addr(alive_port)]}),
                          retry_after_s=0.2)
    loop.run(gone.stop(0))
    remote.step([StepRequest("first", HISTORY)])  # pinned to the first replica, which is gone: marked down
    assert remote._replicas[0].down and remote.failovers == 1
    wait_until(lambda: remote._replicas[0].probes >= 3, message="three health probes of the down replica")
    for i in range(3):
        remote.step([StepRequest(f"later-{i}", HISTORY)])
    assert remote.failovers == 1 and remote._replicas[0].down  # the new sessions went to the live one
    assert all(f"later-{i}" in alive.servicer.expert.cache for i in range(3))
    remote.close()
