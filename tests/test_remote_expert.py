"""`services/remote_expert.py` on its own: the Expert protocol over gRPC, against the local expert it
serves. Real expert servers on loopback ports, tiny experts: whatever a remote expert answers (step,
score, extend, its description) must be what the same expert answers in process, however the work is
split into calls, whichever replica holds a session and whatever dtype the logits travel in.

How a remote expert survives a slow, hung or lost replica is tests/test_failover.py's subject.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from fusion.config import Limits
from fusion.errors import ConfigError, ExpertUnavailableError, InvalidArgumentError, ResourceExhaustedError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.services.remote_expert import MESSAGE_MARGIN_BYTES, RemoteExpert
from tests.helpers import HANG_S, wait_until

HISTORY = [5, 17, 42, 99, 3, 250, 8, 61]
ATOL = 1e-4  # a batched forward on the replica may round differently from a lone one here


def addr(port: int) -> str:
    return f"127.0.0.1:{port}"


@pytest.fixture
def start(start_expert_server):
    return start_expert_server


@pytest.fixture(scope="module")
def reference(tiny_config):
    """Expert a in process: what every remote answer is compared with."""
    return LocalExpert.load(tiny_config.expert("a"))


@pytest.fixture
def remote(tiny_config):
    """remote(ports, **options) -> a RemoteExpert of expert a over those replicas, closed after the test."""
    opened = []

    def make(ports, config_fields=None, **options) -> RemoteExpert:
        config = tiny_config.expert("a").model_copy(update={"addresses": [addr(p) for p in ports],
                                                            **(config_fields or {})})
        expert = RemoteExpert(config, **options)
        opened.append(expert)
        return expert

    yield make
    for expert in opened:
        expert.close()


def local_step(reference: LocalExpert, history: list[int]) -> torch.Tensor:
    """The in-process logits after `history`, in a session of its own (released at once)."""
    session = f"reference-{time.monotonic_ns()}"
    try:
        return reference.step([StepRequest(session, history)])[0]
    finally:
        reference.release([session])


def cached(server) -> set[str]:
    """The sessions a replica holds now."""
    return set(server.servicer.expert.cache.sessions())


# -- the expert contract, against the local expert -------------------------------------------------------
def test_step_logits_equal_the_local_experts_for_the_same_ids(start, remote, reference):
    _, port = start()
    expert = remote([port])
    histories = {"s0": HISTORY, "s1": HISTORY[:3], "s2": [7] * 20}
    for _ in range(3):  # the prompts, then two decode steps on the replica's cached sessions
        logits = expert.step([StepRequest(s, h) for s, h in histories.items()])
        assert logits.shape == (3, reference.info.vocab_size) and logits.dtype == torch.float32
        for row, history in zip(logits, histories.values()):
            assert torch.allclose(row, local_step(reference, history), atol=ATOL)
        histories = {s: h + [int(row.argmax())] for (s, h), row in zip(histories.items(), logits)}
    assert expert.step([]).shape == (0, reference.info.vocab_size)


def watch_steps(monkeypatch) -> list[list[tuple[str, int, int]]]:
    """Each Step call replicas started from now on receive, as (session, known_length, ids sent) per
    session (before a server starts: it binds its handlers then)."""
    from fusion.services.expert_server import ExpertServicer

    calls = []
    step = ExpertServicer.Step

    async def seen(self, request, context):
        calls.append([(s.session_id, s.known_length, len(s.token_ids)) for s in request.sessions])
        return await step(self, request, context)

    monkeypatch.setattr(ExpertServicer, "Step", seen)
    return calls


def test_a_decoding_session_sends_only_its_new_ids_and_the_same_logits_come_back(start, remote, reference,
                                                                                monkeypatch):
    calls = watch_steps(monkeypatch)
    _, port = start()
    expert = remote([port])
    history = list(HISTORY)
    for _ in range(4):
        [row] = expert.step([StepRequest("s", history)])
        assert torch.allclose(row, local_step(reference, history), atol=ATOL)
        history.append(int(row.argmax()))
    # the prompt whole, then each step its one new id after what the replica holds
    assert calls == [[("s", 0, len(HISTORY))]] + [[("s", len(HISTORY) + k, 1)] for k in range(3)]
    # a history that does not continue the last one is sent whole
    expert.step([StepRequest("s", [9] + history[1:])])
    assert calls[-1] == [("s", 0, len(history))]


def test_a_replica_without_the_history_gets_it_whole_on_the_same_call(start, remote, reference, monkeypatch):
    calls = watch_steps(monkeypatch)
    server, port = start()
    expert = remote([port])
    expert.step([StepRequest("s", HISTORY), StepRequest("t", HISTORY[:4])])
    server.servicer.histories.discard(["s"])  # as a restarted replica, or one that dropped its record
    [row, _] = expert.step([StepRequest("s", HISTORY + [7]), StepRequest("t", HISTORY[:4] + [7])])
    assert torch.allclose(row, local_step(reference, HISTORY + [7]), atol=ATOL)
    assert calls[1:] == [[("s", len(HISTORY), 1), ("t", 4, 1)],  # answered ABORTED
                         [("s", 0, len(HISTORY) + 1), ("t", 0, 5)]]
    assert expert.failovers == 0


def test_a_replica_from_before_kept_histories_gets_every_history_whole(start, remote, reference, monkeypatch):
    """A replica whose Info does not say it keeps histories (one from before the field) would read new
    ids alone as a whole history: it is sent whole histories."""
    from fusion.services.expert_server import ExpertServicer

    calls = watch_steps(monkeypatch)
    info = ExpertServicer.Info

    async def older(self, request, context):
        answer = await info(self, request, context)
        answer.keeps_histories = False
        return answer

    monkeypatch.setattr(ExpertServicer, "Info", older)
    _, port = start()
    expert = remote([port])
    history = list(HISTORY)
    for _ in range(3):
        [row] = expert.step([StepRequest("s", history)])
        assert torch.allclose(row, local_step(reference, history), atol=ATOL)
        history.append(int(row.argmax()))
    assert [known for [(_, known, _)] in calls] == [0, 0, 0]


def test_a_step_of_new_ids_the_replica_cannot_place_is_refused_by_name(start):
    from fusion.services.protos import expert_pb2, expert_pb2_grpc
    import grpc

    _, port = start()
    with grpc.insecure_channel(addr(port)) as channel:
        stub = expert_pb2_grpc.ExpertStub(channel)
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Step(expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(
                session_id="never-seen", token_ids=[5], known_length=3)]), timeout=HANG_S)
        assert unknown.value.code() == grpc.StatusCode.ABORTED and "send it whole" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as negative:
            stub.Step(expert_pb2.StepRequest(sessions=[expert_pb2.SessionStep(
                session_id="s", token_ids=[5], known_length=-1)]), timeout=HANG_S)
        assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sessions[0].known_length" in negative.value.details()


def test_the_histories_a_replica_keeps_are_bounded_in_ids():
    from fusion.services.expert_server import SessionHistories

    histories = SessionHistories(capacity=10)
    histories.record("a", [1] * 6)
    histories.record("b", [2] * 4)
    histories.record("c", [3] * 3)  # past 10 ids: the least recently stepped goes
    assert len(histories) == 2 and histories._total == 7
    histories.record("big", [4] * 11)  # longer than everything: not kept
    assert len(histories) == 2


def test_score_and_extend_equal_the_local_experts(start, remote, reference):
    _, port = start()
    expert = remote([port])
    ids = [(11 * k + 2) % reference.info.vocab_size for k in range(24)]
    try:
        assert torch.allclose(expert.score("score", ids, 9), reference.score("score", ids, 9), atol=ATOL)
        extensions = [[], [5], [17, 9], [40, 41, 42]]
        got = expert.extend("extend", ids, extensions)
        assert got.shape == (len(extensions), reference.info.vocab_size)
        assert torch.allclose(got, reference.extend("extend", ids, extensions), atol=ATOL)
    finally:
        reference.release(["score", "extend"])


def test_a_bad_request_raises_what_the_local_expert_raises(start, remote, reference):
    _, port = start()
    expert = remote([port])
    with pytest.raises(InvalidArgumentError, match="num_positions"):
        reference.score("bad", HISTORY, len(HISTORY))
    with pytest.raises(InvalidArgumentError, match="num_positions") as caught:
        expert.score("bad", HISTORY, len(HISTORY))
    assert "'a'" in str(caught.value)  # names the expert (and its replica)
    assert not expert._replicas[0].down and expert.failed_calls == 0  # the caller's fault, not the replica's


def test_the_description_is_the_replicas_under_the_configs_name(start, remote, reference):
    _, port = start()
    expert = remote([port], config_fields={"name": "renamed"})
    ours, theirs = expert.info, reference.info
    assert ours.name == "renamed" and expert.name == "renamed" and expert.replica_info.name == "a"
    for field in ("vocab_size", "tokenizer_size", "tokenizer_fingerprint", "eos_token_ids", "dtype", "max_positions"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.device == "cpu"  # logits land on this machine's CPU
    assert expert.describe().device == theirs.device  # where the replicas compute
    assert expert.addresses == [addr(port)]


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_logits_sent_in_a_narrower_dtype_are_the_local_ones_rounded(start, remote, reference, wire):
    _, port = start()
    expert = remote([port], wire_dtype=wire)
    got = expert.step([StepRequest("narrow", HISTORY)])[0]
    narrow = getattr(torch, wire)
    assert got.dtype == torch.float32 and torch.equal(got, got.to(narrow).float())  # exactly representable
    assert torch.allclose(got, local_step(reference, HISTORY).to(narrow).float(), rtol=2 ** -7, atol=ATOL)


# -- calls and replicas ------------------------------------------------------------------------------------
def test_a_step_is_split_into_calls_the_replica_accepts(start, remote, reference):
    _, port = start(Limits(max_sessions_per_step=2))
    histories = [HISTORY + [i] for i in range(5)]
    with pytest.raises(ResourceExhaustedError, match="max_sessions_per_step"):
        remote([port]).step([StepRequest(f"whole-{i}", h) for i, h in enumerate(histories)])
    split = remote([port], max_sessions_per_call=2)
    logits = split.step([StepRequest(f"split-{i}", h) for i, h in enumerate(histories)])
    for row, history in zip(logits, histories):  # each row back in its request's place
        assert torch.allclose(row, local_step(reference, history), atol=ATOL)


def test_sessions_stick_to_their_replica_and_new_ones_go_to_the_least_loaded(start, remote, reference):
    (first, first_port), (second, second_port) = start(), start()
    expert = remote([first_port, second_port])
    for i in range(4):
        expert.step([StepRequest(f"s{i}", HISTORY + [i])])
    assert cached(first) == {"s0", "s2"} and cached(second) == {"s1", "s3"}
    computed = first.servicer.expert.cache.misses
    logits = expert.step([StepRequest("s0", HISTORY + [0, 9])])  # a decode step where s0's cache is
    assert first.servicer.expert.cache.misses - computed == 1  # only the new id was computed
    assert cached(second) == {"s1", "s3"}
    assert torch.allclose(logits[0], local_step(reference, HISTORY + [0, 9]), atol=ATOL)
    assert expert.failovers == 0 and expert.failed_calls == 0


def test_release_frees_the_sessions_on_their_replicas(start, remote):
    (first, first_port), (second, second_port) = start(), start()
    expert = remote([first_port, second_port])
    for i in range(4):
        expert.step([StepRequest(f"s{i}", HISTORY)])
    expert.release(["s0", "s1", "s2"])
    wait_until(lambda: cached(first) == set() and cached(second) == {"s3"},
               message="the released sessions freed on both replicas")
    assert expert._pinned == {"s3": 1}


def test_a_session_left_idle_loses_its_cache_and_a_late_step_re_prefills_it(start, remote, reference, tiny_config):
    # a coordinator that died never releases its sessions: the replica drops them once idle
    # The cache's clock is the test's: idleness is decided by it, not by how fast a loaded host steps.
    server, port = start(tiny_config.limits.model_copy(update={"session_idle_s": 0.4}))
    now = [1000.0]
    server.servicer.expert.cache._clock = lambda: now[0]
    expert = remote([port])
    expert.step([StepRequest("orphan", HISTORY)])
    expert.step([StepRequest("kept", HISTORY)])
    assert cached(server) == {"orphan", "kept"}
    now[0] += 0.3
    expert.step([StepRequest("kept", HISTORY)])  # stepped again: idle for 0.2 s when the orphan is for 0.5
    now[0] += 0.2
    wait_until(lambda: "orphan" not in cached(server), message="the idle session dropped by the sweep")
    assert cached(server) == {"kept"}
    # not refused as released: a caller that was only slow re-prefills its history there
    logits = expert.step([StepRequest("orphan", HISTORY + [3])])
    assert torch.allclose(logits[0], local_step(reference, HISTORY + [3]), atol=ATOL)
    assert cached(server) == {"orphan", "kept"}


def test_a_changed_replica_set_moves_sessions_to_the_replicas_now_listed(start, remote, reference):
    (old, old_port), (new, new_port) = start(), start()
    expert = remote([old_port])
    expert.step([StepRequest("moved", HISTORY)])
    assert cached(old) == {"moved"}
    expert.set_addresses([addr(new_port)])
    assert expert.addresses == [addr(new_port)]
    logits = expert.step([StepRequest("moved", HISTORY + [3]), StepRequest("new", HISTORY)])
    assert torch.allclose(logits[0], local_step(reference, HISTORY + [3]), atol=ATOL)  # re-prefilled there
    assert torch.allclose(logits[1], local_step(reference, HISTORY), atol=ATOL)
    assert cached(new) == {"moved", "new"} and expert.failovers == 1
    expert.set_addresses([])  # an empty list keeps the last known replicas
    assert expert.addresses == [addr(new_port)]
    expert.release(["moved", "new"])  # also on the retired replica, which still caches the session
    wait_until(lambda: cached(old) == set() and cached(new) == set(),
               message="the moved session freed on the retired replica too")


def test_a_remote_score_too_large_for_one_message_comes_in_chunks(start, tiny_config, reference):
    server, port = start()
    vocab = reference.info.vocab_size
    config = tiny_config.expert("a").model_copy(update={"addresses": [addr(port)]})
    remote = RemoteExpert(config, max_message_bytes=MESSAGE_MARGIN_BYTES + 3 * 4 * vocab + 100)
    try:
        assert remote.score_rows_per_call() == 3
        token_ids = [(7 * k + 3) % vocab for k in range(40)]
        computed = server.servicer.expert.cache.misses
        got = remote.score("long", token_ids, 11)  # 4 calls: 3 + 3 + 3 + 2 positions
        local = reference.score("long", token_ids, 11)
        reference.release(["long"])
        assert got.shape == (11, vocab)
        assert torch.allclose(got, local, atol=1e-4)
        # The replica kept the session between chunks: each id was computed once.
        assert server.servicer.expert.cache.misses - computed == len(token_ids) - 1
        assert torch.allclose(remote.score("short", token_ids, 2), reference.score("short", token_ids, 2), atol=1e-4)
    finally:
        remote.close()


# -- construction ------------------------------------------------------------------------------------------
def test_an_expert_without_a_reachable_replica_is_refused(tiny_config):
    with pytest.raises(ConfigError, match="addresses"):
        RemoteExpert(tiny_config.expert("a").model_copy(update={"addresses": []}))
    with socket.create_server(("127.0.0.1", 0)) as closed:
        gone = closed.getsockname()[1]
    with pytest.raises(ExpertUnavailableError, match="expert 'a': no replica answered Info"):
        RemoteExpert(tiny_config.expert("a").model_copy(update={"addresses": [addr(gone)]}))
