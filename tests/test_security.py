"""Security of a shared cluster: TLS (and mutual TLS to experts), API keys with per-key limits on the
Fusion service, the coordinator's secret on the Expert service, per-key usage metrics.

Real servers on loopback with tiny experts; a throwaway CA and certificates made in tmp_path.
"""

from __future__ import annotations

import datetime
import ipaddress
import threading
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fusion.config import SecurityConfig, parse_config
from fusion.errors import ConfigError, ExpertUnavailableError
from fusion.experts.expert import LocalExpert
from fusion.services import api_keys, expert_auth, key_gate, tls
from fusion.services.client import FusionClient
from fusion.services.coordinator import create_coordinator_server
from fusion.services.expert_server import create_expert_server
from fusion.services.protos import expert_pb2, expert_pb2_grpc, fusion_pb2, fusion_pb2_grpc
from fusion.services.api_keys import ApiKeyStore, create_key, hash_key, pbkdf2_hash_key, revoke_key, verify_key
from tests.conftest import tiny_config_dict
from tests.helpers import HANG_S, wait_until

LIMITS = {"max_prompt_tokens": 256, "max_tokens": 400}
UNAUTH, EXHAUSTED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED


def addr(port: int) -> str:
    return f"127.0.0.1:{port}"


# -- certificates ----------------------------------------------------------------------------------
def _name(common: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path, key, cert) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(path, common: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, _ = _write(path, key, cert)
    return key, cert, cert_file


def make_leaf(path, ca, common: str, *, server: bool) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, ca_cert, _ = ca
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(path, key, builder.sign(ca_key, hashes.SHA256()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca", "fusion test CA")
    rogue = make_ca(root / "rogue-ca", "rogue CA")
    server_cert, server_key = make_leaf(root / "server", ca, "localhost", server=True)
    client_cert, client_key = make_leaf(root / "coordinator", ca, "coordinator", server=False)
    rogue_cert, rogue_key = make_leaf(root / "rogue-client", rogue, "coordinator", server=False)
    return {"ca": ca[2], "rogue_ca": rogue[2], "server": (server_cert, server_key),
            "client": (client_cert, client_key), "rogue_client": (rogue_cert, rogue_key)}


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- config --------------------------------------------------------------------------------------
def test_security_config_is_explicit(tiny_dir):
    assert parse_config(tiny_config_dict(tiny_dir)).security.plaintext  # today's configs: plaintext
    with pytest.raises(ConfigError, match="plaintext: false needs a tls section"):
        parse_config(tiny_config_dict(tiny_dir, security={"plaintext": False}))
    with pytest.raises(ConfigError, match="either plaintext: true or a tls section"):
        parse_config(tiny_config_dict(tiny_dir, security={"plaintext": True, "tls": {"ca_file": "x"}}))
    with pytest.raises(ConfigError, match="require_client_auth needs ca_file"):
        parse_config(tiny_config_dict(tiny_dir, security={"tls": {"require_client_auth": True}}))
    with pytest.raises(ConfigError, match="cert_file and key_file"):
        parse_config(tiny_config_dict(tiny_dir, security={"tls": {"cert_file": "x"}}))
    with pytest.raises(ConfigError, match="security.tlz"):
        parse_config(tiny_config_dict(tiny_dir, security={"tlz": {}}))
    tls = parse_config(tiny_config_dict(tiny_dir, security={"tls": {"ca_file": "ca.pem"}})).security
    assert tls.plaintext is False


def test_plaintext_warning_only_off_loopback(caplog):
    with caplog.at_level("WARNING", logger="fusion.services.tls"):
        tls.warn_if_plaintext("127.0.0.1:0", "svc")
        tls.warn_if_plaintext("localhost:5", "svc")
        tls.warn_if_plaintext("[::1]:5", "svc")
        assert not caplog.records
        tls.warn_if_plaintext("0.0.0.0:50051", "svc")
        assert "PLAINTEXT" in caplog.text


# -- keys ----------------------------------------------------------------------------------------
def test_keys_are_stored_hashed_and_checked(tmp_path):
    path = tmp_path / "keys.yaml"
    key = create_key(path, "team-a", limits={"tokens_per_minute": 100, "max_concurrent_streams": None})
    assert key.startswith("fsk_team-a_") and len(key) > 40
    text = path.read_text()
    assert key not in text and key.split("_", 2)[2] not in text
    assert (path.stat().st_mode & 0o777) == 0o600
    entry = yaml.safe_load(text)["team-a"]
    assert entry["limits"] == {"tokens_per_minute": 100} and entry["revoked"] is False
    assert verify_key(key, entry["hash"]) and not verify_key(key + "x", entry["hash"])
    assert verify_key("abc", "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    assert not verify_key("abc", "md5$1$2$3") and not verify_key("abc", "garbage")
    with pytest.raises(ConfigError, match="exists"):
        create_key(path, "team-a")
    with pytest.raises(ConfigError, match="no key id 'team-b' to reissue"):
        create_key(path, "team-b", reissue=True)
    with pytest.raises(ConfigError, match="key id"):
        create_key(path, "bad_id")

    store = ApiKeyStore(path=path)
    record, why = store.authenticate(key)
    assert record.key_id == "team-a" and record.limits.tokens_per_minute == 100 and why == ""
    assert store.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B"))[0] is None
    assert store.authenticate("fsk_nobody_xyz") == (None, "unknown API key")
    assert store.authenticate("not a key")[0] is None
    revoke_key(path, "team-a")
    assert store.authenticate(key) == (None, "API key 'team-a' is revoked")  # file re-read on change


def test_keys_from_environment(monkeypatch):
    key = "fsk_env-team_secretvalue"
    monkeypatch.setenv("FUSION_KEYS", yaml.safe_dump({"env-team": {"hash": hash_key(key)}}))
    store = ApiKeyStore.from_config(SecurityConfig(api_keys_env="FUSION_KEYS"))
    assert store.authenticate(key)[0].key_id == "env-team"
    monkeypatch.delenv("FUSION_KEYS")
    with pytest.raises(ConfigError, match="FUSION_KEYS"):
        ApiKeyStore.from_config(SecurityConfig(api_keys_env="FUSION_KEYS"))


def test_new_keys_use_a_keyed_hash(tmp_path, monkeypatch):
    """`hmac-sha256$HEX` under the server's pepper: microseconds to check, and useless without the pepper."""
    path = tmp_path / "keys.yaml"
    key = create_key(path, "team-a")
    stored = yaml.safe_load(path.read_text())["team-a"]["hash"]
    assert stored.startswith("hmac-sha256$") and len(stored) == len("hmac-sha256$") + 64
    assert stored == hash_key(key) and not api_keys.is_slow_hash(stored)
    assert verify_key(key, stored) and not verify_key(key, stored, pepper=b"another pepper")

    # a configured pepper: keys made with it verify on a server with it, and only there
    monkeypatch.setenv("FUSION_PEPPER", "pepper-from-a-secret")
    sec = SecurityConfig(api_keys_file=str(path), api_keys_pepper_env="FUSION_PEPPER")
    peppered = create_key(path, "team-b", pepper=api_keys.key_pepper(sec))
    assert ApiKeyStore.from_config(sec).authenticate(peppered)[0].key_id == "team-b"
    assert ApiKeyStore.from_config(sec).authenticate(key)[0] is None  # made with the default pepper
    assert ApiKeyStore(path=path).authenticate(peppered)[0] is None
    pepper_file = tmp_path / "pepper"
    pepper_file.write_text("pepper-from-a-secret\n")
    by_file = SecurityConfig(api_keys_file=str(path), api_keys_pepper_file=str(pepper_file))
    assert ApiKeyStore.from_config(by_file).authenticate(peppered)[0].key_id == "team-b"
    monkeypatch.delenv("FUSION_PEPPER")
    with pytest.raises(ConfigError, match="FUSION_PEPPER"):
        ApiKeyStore.from_config(sec)
    with pytest.raises(ValueError, match="api_keys_pepper_env or api_keys_pepper_file"):
        SecurityConfig(api_keys_pepper_env="X", api_keys_pepper_file="y")

    # reissuing an id: a new key in the current format, the old one stops working, limits kept
    legacy = tmp_path / "legacy.yaml"
    old_key = "fsk_old_" + "s" * 43
    api_keys.write_keys_file(legacy, {"old": {"hash": pbkdf2_hash_key(old_key, iterations=1000),
                                              "limits": {"tokens_per_minute": 7}}})
    assert ApiKeyStore(path=legacy).authenticate(old_key)[0].key_id == "old"  # legacy hashes still verify
    new = create_key(legacy, "old", reissue=True)
    entry = yaml.safe_load(legacy.read_text())["old"]
    assert entry["hash"].startswith("hmac-sha256$") and entry["limits"] == {"tokens_per_minute": 7}
    assert ApiKeyStore(path=legacy).authenticate(new)[0].key_id == "old"
    assert ApiKeyStore(path=legacy).authenticate(old_key)[0] is None


def test_revoke_replaces_the_file_atomically(tmp_path, monkeypatch):
    """Servers re-read the keys file while `fusion keys` writes it: every write goes to a temporary file
    in the same folder, then os.replace; a reader never sees half a file."""
    import os

    path = tmp_path / "keys.yaml"
    ids = [f"team-{i}" for i in range(100)]
    api_keys.write_keys_file(path, {i: {"hash": "sha256:" + "0" * 64, "revoked": False} for i in ids})
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        assert os.path.dirname(os.fspath(src)) == os.path.dirname(os.fspath(dst))
        assert set(yaml.safe_load(open(src).read())) == set(ids)  # the new text is whole before it appears
        replaced.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(api_keys.os, "replace", spy)
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            seen.append(set(yaml.safe_load(path.read_text()) or {}))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for key_id in ids[:20]:
            revoke_key(path, key_id)
    finally:
        stop.set()
        thread.join(10)
    assert len(replaced) == 20 and all(dst == str(path) and src != dst for src, dst in replaced)
    assert seen and all(keys == set(ids) for keys in seen)
    assert sorted(os.listdir(tmp_path)) == ["keys.yaml"]  # no temporary file left behind
    assert (path.stat().st_mode & 0o777) == 0o600
    assert sum(entry["revoked"] for entry in yaml.safe_load(path.read_text()).values()) == 20


@pytest.mark.parametrize("entry, message", [
    ({"hash": 3}, "hash"),
    ({"hash": "x", "limits": {"tokens_per_minute": -1}}, "tokens_per_minute"),
    ({"hash": "x", "limits": {"rpm": 1}}, "limits"),
    ({"hash": "x", "colour": 1}, "unknown fields"),
])
def test_bad_keys_file_is_named(tmp_path, entry, message):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"k": entry}))
    with pytest.raises(ConfigError, match=message):
        ApiKeyStore(path=path)


# -- API keys on the Fusion service ----------------------------------------------------------------
KEY_LIMITS = {
    "one-stream": {"max_concurrent_streams": 1},
    "free": {},
    "rate": {"tokens_per_minute": 90},
    "prompt-rate": {"tokens_per_minute": 30},
    "short": {"max_tokens_per_request": 4},
    "gone": {},
}


@pytest.fixture(scope="module")
def keyed(loop, tiny_dir, tmp_path_factory):
    """A coordinator (in-process experts) requiring API keys; yields (server, port, {id: key})."""
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = {key_id: create_key(path, key_id, limits=limits) for key_id, limits in KEY_LIMITS.items()}
    revoke_key(path, "gone")
    config = parse_config(tiny_config_dict(tiny_dir, limits=LIMITS, security={"api_keys_file": str(path)}))
    server, port = loop.run(create_coordinator_server(config, metrics_port=0, metrics_host="127.0.0.1"))
    yield server, port, keys
    loop.run(server.stop(0))


def generate_code(port: int, metadata=(), **sampling) -> grpc.StatusCode | int:
    """The status of a Generate call, or the number of tokens streamed when it succeeds."""
    sampling = {"max_tokens": 3, "ignore_eos": True} | sampling
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        request = fusion_pb2.GenerateRequest(prompt="hello", sampling=fusion_pb2.SamplingParams(**sampling))
        try:
            return len(list(stub.Generate(request, metadata=list(metadata), timeout=HANG_S)))
        except grpc.RpcError as err:
            return err.code()


def test_unauthenticated_callers_are_refused(keyed):
    _, port, keys = keyed
    assert generate_code(port) == UNAUTH
    assert generate_code(port, [("authorization", "Bearer fsk_free_wrongsecret")]) == UNAUTH
    assert generate_code(port, [("authorization", "Bearer " + keys["free"][:-2])]) == UNAUTH
    assert generate_code(port, [("x-api-key", "garbage")]) == UNAUTH
    assert generate_code(port, [("authorization", "Basic " + keys["free"])]) == UNAUTH
    assert generate_code(port, [("authorization", "Bearer " + keys["gone"])]) == UNAUTH  # revoked
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        for call, request in ((stub.Score, fusion_pb2.ScoreRequest(prompt="a", continuation="b")),
                              (stub.Describe, fusion_pb2.DescribeRequest())):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=10)
            assert caught.value.code() == UNAUTH and "API key" in caught.value.details()
        # health stays open for probes
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # both headers work, and every method answers a valid key
    assert generate_code(port, [("authorization", "Bearer " + keys["free"])]) == 3
    assert generate_code(port, [("x-api-key", keys["free"])]) == 3
    with FusionClient(addr(port), timeout=HANG_S, api_key=keys["free"]) as client:
        assert client.describe().experts and client.score("a b", " c").token_ids
        assert len(list(client.generate("hi", {"max_tokens": 2, "ignore_eos": True}))) == 2
    with FusionClient(addr(port), timeout=HANG_S, api_key=keys["gone"]) as client:
        with pytest.raises(Exception, match="revoked"):
            client.describe()


def test_stream_limit_is_per_key(keyed):
    _, port, keys = keyed
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        long = fusion_pb2.GenerateRequest(prompt="hello", sampling=fusion_pb2.SamplingParams(
            max_tokens=300, ignore_eos=True))
        first = stub.Generate(long, metadata=[("x-api-key", keys["one-stream"])], timeout=HANG_S)
        next(first)  # the stream is open
        # a second stream of the same key is refused, naming the limit
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(long, metadata=[("x-api-key", keys["one-stream"])], timeout=HANG_S))
        assert caught.value.code() == EXHAUSTED and "max_concurrent_streams" in caught.value.details()
        # other keys' clients keep streaming, concurrently
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            generate_code(port, [("x-api-key", keys["free"])], max_tokens=20))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [20, 20, 20]
        rest = list(first)
        assert len(rest) == 299 and rest[-1].finish_reason == "length"
    # the slot is free again once the stream ended
    assert generate_code(port, [("x-api-key", keys["one-stream"])]) == 3


def test_closing_a_stream_frees_its_slot(keyed):
    _, port, keys = keyed
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        call = stub.Generate(fusion_pb2.GenerateRequest(prompt="x", sampling=fusion_pb2.SamplingParams(
            max_tokens=300, ignore_eos=True)), metadata=[("x-api-key", keys["one-stream"])], timeout=HANG_S)
        next(call)
        call.cancel()
    # the slot is free again once the cancelled stream ends: a call is served its 3 tokens
    assert wait_until(lambda: generate_code(port, [("x-api-key", keys["one-stream"])]) == 3,
                      interval_s=0.1)


def run_stream(port: int, key: str, prompt: str = "hello", **sampling):
    """(the responses streamed, the RpcError that ended the stream or None)."""
    sampling = {"max_tokens": 3, "ignore_eos": True} | sampling
    got = []
    with grpc.insecure_channel(addr(port)) as channel:
        call = fusion_pb2_grpc.FusionStub(channel).Generate(fusion_pb2.GenerateRequest(
            prompt=prompt, sampling=fusion_pb2.SamplingParams(**sampling)), metadata=[("x-api-key", key)], timeout=HANG_S)
        try:
            for response in call:
                got.append(response)
        except grpc.RpcError as err:
            return got, err
    return got, None


def pushback_ms(error: grpc.RpcError) -> int | None:
    """gRPC's retry pushback trailer of a refusal, in milliseconds (None: not sent)."""
    trailers = dict(error.trailing_metadata() or ())
    return int(trailers["grpc-retry-pushback-ms"]) if "grpc-retry-pushback-ms" in trailers else None


def test_tokens_per_minute_are_reserved_before_the_work(keyed, monkeypatch):
    """A stream reserves its prompt + max_tokens on the key's window before any work and gives back what
    it did not use; one that does not fit is refused up front with a retry time, never cut half-way."""
    _, port, keys = keyed
    limit = KEY_LIMITS["rate"]["tokens_per_minute"]
    md = [("x-api-key", keys["rate"])]
    first, error = run_stream(port, keys["rate"], max_tokens=6, temperature=0.0)
    assert error is None and len(first) == 6
    prompt = first[-1].usage.prompt_tokens  # the chat-templated "hello"
    assert 0 < prompt and prompt + 6 + prompt + 12 < limit < prompt + 6 + prompt + 60
    # prompt + 60 no longer fits the window: refused before its first token, with when to retry
    got, error = run_stream(port, keys["rate"], max_tokens=60)
    assert got == [] and error.code() == EXHAUSTED and "tokens_per_minute" in error.details()
    assert 0 < pushback_ms(error) <= 61_000
    # a stream that stops early gives back its unused reservation: it asked for 12 tokens
    stop_id = first[3].token_id
    stopped_after = [r.token_id for r in first].index(stop_id) + 1
    got, error = run_stream(port, keys["rate"], max_tokens=12, temperature=0.0, stop_token_ids=[stop_id])
    assert error is None and len(got) == stopped_after
    left = limit - (prompt + 6) - (prompt + stopped_after) - prompt
    assert generate_code(port, md, max_tokens=left) == left  # exactly what is left fits
    assert generate_code(port, md, max_tokens=1) == EXHAUSTED  # up front now
    assert generate_code(port, [("x-api-key", keys["free"])]) == 3  # other keys are unaffected
    with FusionClient(addr(port), timeout=HANG_S, api_key=keys["rate"]) as client:
        with pytest.raises(Exception, match="tokens_per_minute"):
            client.score("a", "b")
    # the window slides: tokens older than the window no longer count
    monkeypatch.setattr(key_gate, "WINDOW_S", 0.5)
    threading.Event().wait(0.6)
    # more than the whole window can ever hold: INVALID_ARGUMENT, a retry would never succeed
    assert generate_code(port, md, max_tokens=limit + 1) == grpc.StatusCode.INVALID_ARGUMENT
    assert generate_code(port, md) == 3


def test_score_reserves_its_tokens_and_holds_a_slot(keyed):
    """Score reserves its prompt and continuation tokens before it runs, and takes one of the key's
    call slots while it runs (so a key's Scores count against max_concurrent_streams and key_share)."""
    server, port, keys = keyed
    key_id, key = "prompt-rate", keys["prompt-rate"]
    limit = KEY_LIMITS[key_id]["tokens_per_minute"]

    def charged() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=HANG_S).read().decode()
        line = f'fusion_key_tokens_total{{key_id="{key_id}"}}'
        return sum(float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(line))

    got, error = run_stream(port, key, max_tokens=2)
    assert error is None and len(got) == 2
    prompt = got[-1].usage.prompt_tokens
    assert charged() == prompt + 2
    with FusionClient(addr(port), timeout=HANG_S, api_key=key) as client:
        scored = client.score("a b", " c")
    score_tokens = charged() - prompt - 2
    assert score_tokens > len(scored.token_ids)  # the prompt's tokens too
    assert prompt + 2 + score_tokens + prompt + 10 > limit
    got, error = run_stream(port, key, max_tokens=10)
    assert got == [] and error.code() == EXHAUSTED and "tokens_per_minute" in error.details()
    one = keys["one-stream"]
    with FusionClient(addr(port), timeout=HANG_S, api_key=one) as client:
        held = client.generate("hi", {"max_tokens": 400, "ignore_eos": True})
        next(held)  # the key's one slot
        with pytest.raises(Exception, match="max_concurrent_streams"):
            client.score("a", "b")
        held.close()
        assert wait_until(lambda: server.servicer.service.active == 0)
        assert client.score("a", "b").token_ids


def test_max_tokens_per_request_caps_or_refuses(keyed):
    """A request without max_tokens is capped to the key's max_tokens_per_request; one that asks for
    more is INVALID_ARGUMENT (a retry can never succeed)."""
    _, port, keys = keyed
    md = [("x-api-key", keys["short"])]
    assert generate_code(port, md, max_tokens=4) == 4
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        request = fusion_pb2.GenerateRequest(prompt="hi", sampling=fusion_pb2.SamplingParams(max_tokens=5))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, metadata=md, timeout=HANG_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens_per_request=4" in caught.value.details() and pushback_ms(caught.value) is None
        unset = fusion_pb2.GenerateRequest(prompt="hi", sampling=fusion_pb2.SamplingParams(ignore_eos=True))
        assert len(list(stub.Generate(unset, metadata=md, timeout=HANG_S))) == 4


def test_per_key_metrics(keyed):
    server, port, keys = keyed
    assert generate_code(port, [("x-api-key", keys["free"])], max_tokens=5) == 5
    assert generate_code(port, [("x-api-key", "fsk_free_wrong")]) == UNAUTH
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=HANG_S).read().decode()

    def value(line_start: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))

    assert value('fusion_key_requests_total{key_id="free",method="Generate"}') >= 1
    assert value('fusion_key_tokens_total{key_id="free"}') >= 5
    assert value('fusion_key_refusals_total{key_id="-",reason="bad_key"}') >= 1
    assert value('fusion_key_refusals_total{key_id="-",reason="no_key"}') >= 0
    for key in keys.values():
        assert key not in text and key.rsplit("_", 1)[1] not in text
    assert "fsk_free_wrong" not in text


# -- TLS and the expert's caller ----------------------------------------------------------------
@pytest.fixture(scope="module")
def secure_cluster(loop, tiny_dir, pki, tmp_path_factory):
    """Expert servers with TLS, client certificates and a secret; a TLS coordinator with API keys."""
    secret_file = tmp_path_factory.mktemp("secret") / "expert-secret"
    secret_file.write_text("s3cret-for-experts\n")
    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    key = create_key(keys_file, "team-tls")
    tls = {"cert_file": pki["server"][0], "key_file": pki["server"][1], "ca_file": pki["ca"],
           "client_cert_file": pki["client"][0], "client_key_file": pki["client"][1], "require_client_auth": True}
    sec = {"tls": tls, "expert_secret_file": str(secret_file), "api_keys_file": str(keys_file)}
    base = parse_config(tiny_config_dict(tiny_dir, names=("a", "b"), limits=LIMITS, security=sec))
    experts = {e.name: loop.run(create_expert_server(LocalExpert.load(e), base.limits, security=base.security))
               for e in base.experts}
    data = tiny_config_dict(tiny_dir, names=("a", "b"), limits=LIMITS, security=sec)
    for expert in data["experts"]:
        expert["addresses"] = [f"localhost:{experts[expert['name']][1]}"]
    config = parse_config(data)
    coordinator, port = loop.run(create_coordinator_server(config))
    yield {"config": config, "experts": experts, "port": port, "key": key, "secret": "s3cret-for-experts"}
    loop.run(coordinator.stop(0))
    for server, _ in experts.values():
        loop.run(server.stop(0))


def test_tls_end_to_end(secure_cluster, tiny_dir):
    from fusion.frontdoor.service import FusionService

    cluster = secure_cluster
    with FusionClient(f"localhost:{cluster['port']}", timeout=HANG_S, api_key=cluster["key"],
                      security=cluster["config"].security) as client:
        events = list(client.generate("hello world", {"max_tokens": 8, "ignore_eos": True}))
    local = FusionService.from_config(parse_config(tiny_config_dict(tiny_dir, names=("a", "b"))))
    try:
        assert [e.token.token_id for e in events] == local.complete(
            "hello world", {"max_tokens": 8, "ignore_eos": True}).token_ids
    finally:
        local.close()


def _client_error(port: int, credentials, *, api_key: str) -> grpc.StatusCode:
    with FusionClient(f"localhost:{port}", timeout=10, api_key=api_key, credentials=credentials) as client:
        try:
            client.stub.Describe(fusion_pb2.DescribeRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_untrusted_certificates_fail_the_handshake(secure_cluster, pki):
    port, key = secure_cluster["port"], secure_cluster["key"]
    assert _client_error(port, grpc.ssl_channel_credentials(read(pki["ca"])), api_key=key) == grpc.StatusCode.OK
    # a client trusting another CA does not accept the server's certificate
    assert _client_error(port, grpc.ssl_channel_credentials(read(pki["rogue_ca"])),
                         api_key=key) == grpc.StatusCode.UNAVAILABLE
    # a plaintext client cannot talk to a TLS server
    with grpc.insecure_channel(f"localhost:{port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            fusion_pb2_grpc.FusionStub(channel).Describe(fusion_pb2.DescribeRequest(),
                                                         metadata=[("x-api-key", key)], timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def _expert_info(port: int, credentials, metadata=()) -> grpc.StatusCode:
    channel = (grpc.secure_channel(f"localhost:{port}", credentials) if credentials is not None
               else grpc.insecure_channel(f"localhost:{port}"))
    with channel:
        try:
            expert_pb2_grpc.ExpertStub(channel).Info(expert_pb2.InfoRequest(), metadata=list(metadata), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_expert_answers_only_the_coordinator(secure_cluster, pki):
    port = secure_cluster["experts"]["a"][1]
    secret = [(expert_auth.EXPERT_SECRET_HEADER, secure_cluster["secret"])]
    ca = read(pki["ca"])
    coordinator_creds = grpc.ssl_channel_credentials(ca, read(pki["client"][1]), read(pki["client"][0]))
    assert _expert_info(port, coordinator_creds, secret) == grpc.StatusCode.OK
    # no client certificate, or one from another CA: the handshake fails
    assert _expert_info(port, grpc.ssl_channel_credentials(ca), secret) == grpc.StatusCode.UNAVAILABLE
    rogue = grpc.ssl_channel_credentials(ca, read(pki["rogue_client"][1]), read(pki["rogue_client"][0]))
    assert _expert_info(port, rogue, secret) == grpc.StatusCode.UNAVAILABLE
    assert _expert_info(port, None, secret) == grpc.StatusCode.UNAVAILABLE  # plaintext
    # the right certificate without the secret, or with a wrong one
    assert _expert_info(port, coordinator_creds) == UNAUTH
    assert _expert_info(port, coordinator_creds, [(expert_auth.EXPERT_SECRET_HEADER, "guess")]) == UNAUTH


def test_expert_secret_without_tls(loop, tiny_config, monkeypatch, tiny_dir):
    monkeypatch.setenv("FUSION_EXPERT_SECRET", "shared-secret")
    sec = SecurityConfig(plaintext=True, expert_secret_env="FUSION_EXPERT_SECRET")
    expert = tiny_config.experts[0]
    server, port = loop.run(create_expert_server(LocalExpert.load(expert), tiny_config.limits, security=sec))
    try:
        assert _expert_info(port, None) == UNAUTH
        assert _expert_info(port, None, [(expert_auth.EXPERT_SECRET_HEADER, "shared-secreT")]) == UNAUTH
        assert _expert_info(port, None, [(expert_auth.EXPERT_SECRET_HEADER, "shared-secret")]) == grpc.StatusCode.OK
        with grpc.insecure_channel(addr(port)) as channel:  # probes need no secret
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as caught:
                expert_pb2_grpc.ExpertStub(channel).Step(expert_pb2.StepRequest(sessions=[
                    expert_pb2.SessionStep(session_id="s", token_ids=[1, 2])]), timeout=10)
            assert caught.value.code() == UNAUTH
        # a coordinator with the secret connects; one without it is refused, naming the expert
        data = tiny_config_dict(tiny_dir, names=("a",))
        data["experts"][0]["addresses"] = [addr(port)]
        with_secret = parse_config(data | {"security": {"expert_secret_env": "FUSION_EXPERT_SECRET"}})
        coordinator, _ = loop.run(create_coordinator_server(with_secret))
        loop.run(coordinator.stop(0))
        with pytest.raises(ExpertUnavailableError, match="UNAUTHENTICATED"):
            loop.run(create_coordinator_server(parse_config(data)))
        monkeypatch.delenv("FUSION_EXPERT_SECRET")
        with pytest.raises(ConfigError, match="FUSION_EXPERT_SECRET"):
            loop.run(create_coordinator_server(with_secret))
    finally:
        loop.run(server.stop(0))


def test_keys_cli_and_remote_generate(tmp_path, keyed, monkeypatch):
    from typer.testing import CliRunner

    from fusion.tools.cli import app
    from fusion.services.client import stream_remote

    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    result = runner.invoke(app, ["keys", "create", "--file", str(path), "--id", "team-a", "--tokens-per-minute", "50"])
    assert result.exit_code == 0, result.output
    key = result.stdout.strip().splitlines()[0]
    assert key.startswith("fsk_team-a_") and key not in path.read_text()
    assert ApiKeyStore(path=path).authenticate(key)[0].limits.tokens_per_minute == 50
    again = runner.invoke(app, ["keys", "create", "--file", str(path), "--id", "team-a"])
    assert again.exit_code == 2 and "exists" in again.output
    reissued = runner.invoke(app, ["keys", "create", "--file", str(path), "--id", "team-a", "--reissue"])
    assert reissued.exit_code == 0, reissued.output
    new_key = reissued.stdout.strip().splitlines()[0]
    assert ApiKeyStore(path=path).authenticate(key)[0] is None
    assert ApiKeyStore(path=path).authenticate(new_key)[0].limits.tokens_per_minute == 50
    key = new_key
    monkeypatch.setenv("FUSION_PEPPER", "cli-pepper")
    peppered = runner.invoke(app, ["keys", "create", "--file", str(path), "--id", "team-p", "--pepper-env",
                                   "FUSION_PEPPER"])
    assert peppered.exit_code == 0, peppered.output
    store = ApiKeyStore.from_config(SecurityConfig(api_keys_file=str(path), api_keys_pepper_env="FUSION_PEPPER"))
    assert store.authenticate(peppered.stdout.strip().splitlines()[0])[0].key_id == "team-p"
    assert runner.invoke(app, ["keys", "revoke", "--file", str(path), "--id", "team-a"]).exit_code == 0
    assert ApiKeyStore(path=path).authenticate(key)[0] is None

    # `fusion generate --server` sends $FUSION_API_KEY
    _, port, keys = keyed
    monkeypatch.setenv("FUSION_API_KEY", keys["free"])
    events = list(stream_remote(addr(port), "hi", {"max_tokens": 2, "ignore_eos": True}, None))
    assert len(events) == 2


def test_undecodable_request_is_invalid_argument(keyed):
    _, port, keys = keyed
    with grpc.insecure_channel(addr(port)) as channel:
        for method, stream in (("Describe", False), ("Generate", True), ("Score", False)):
            multi = (channel.unary_stream if stream else channel.unary_unary)(f"/fusion.v1.Fusion/{method}")
            with pytest.raises(grpc.RpcError) as caught:
                result = multi(b"\x0a\x05ab", metadata=[("x-api-key", keys["free"])], timeout=10)
                list(result) if stream else None
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid message" in caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:  # authentication comes first
                result = multi(b"\x0a\x05ab", timeout=10)
                list(result) if stream else None
            assert caught.value.code() == UNAUTH


def test_coordinator_without_client_certificate_is_refused_by_experts(secure_cluster, loop, pki):
    """mTLS: a coordinator that presents no client certificate cannot reach the experts."""
    config = secure_cluster["config"]
    tls = config.security.tls.model_copy(update={"client_cert_file": None, "client_key_file": None})
    no_cert = config.model_copy(update={"security": config.security.model_copy(update={"tls": tls})})
    with pytest.raises(ExpertUnavailableError, match="UNAVAILABLE"):
        loop.run(create_coordinator_server(no_cert))


def test_usage_state_stays_bounded_for_a_key_without_limits():
    """Usage is kept in one-second buckets over the window, trimmed as tokens arrive: a key that streams
    for ten minutes holds at most WINDOW_S + 1 buckets, and the window total is exact."""
    from fusion.services.key_gate import WINDOW_S, _Usage

    usage = _Usage()
    now = 1000.0
    for _ in range(100_000):  # 100k tokens at ~166 per second for 10 minutes
        now += 0.006
        usage.add_tokens(now, 1)
        assert len(usage.tokens) <= WINDOW_S + 1
    in_window = usage.tokens_in_window(now)
    assert abs(in_window - WINDOW_S / 0.006) <= 1.0 / 0.006 + 1  # a minute's tokens, give or take a bucket
    assert usage.tokens_in_window(now + WINDOW_S + 1) == 0 and not usage.tokens


# -- failed authentication: bounded work, bounded state ------------------------------------------
LEGACY_ITERATIONS = api_keys.LEGACY_PBKDF2_ITERATIONS  # what old key files hold: ~50 ms per check


@pytest.fixture
def pbkdf2_runs(monkeypatch):
    """Counts the PBKDF2 computations of fusion.services.api_keys (the real function runs)."""
    runs = []
    real = api_keys._pbkdf2_hmac

    def counting(*args):
        runs.append(args[3])
        return real(*args)

    monkeypatch.setattr(api_keys, "_pbkdf2_hmac", counting)
    return runs


@pytest.fixture(scope="module")
def legacy(loop, tiny_dir, tmp_path_factory):
    """A coordinator whose keys file was written before the keyed hash: a PBKDF2 entry and a sha256:
    entry, next to a new key."""
    import hashlib

    path = tmp_path_factory.mktemp("legacy-keys") / "keys.yaml"
    keys = {"legacy": "fsk_legacy_" + "L" * 43, "old-sha": "fsk_old-sha_" + "S" * 43}
    api_keys.write_keys_file(path, {
        "legacy": {"hash": pbkdf2_hash_key(keys["legacy"], iterations=LEGACY_ITERATIONS)},
        "old-sha": {"hash": "sha256:" + hashlib.sha256(keys["old-sha"].encode()).hexdigest()},
    })
    keys["fresh"] = create_key(path, "fresh")
    config = parse_config(tiny_config_dict(tiny_dir, limits=LIMITS, security={"api_keys_file": str(path)}))
    server, port = loop.run(create_coordinator_server(config, metrics_port=0, metrics_host="127.0.0.1"))
    yield server, port, keys
    loop.run(server.stop(0))


def describe_code(stub, key: str) -> grpc.StatusCode:
    try:
        stub.Describe(fusion_pb2.DescribeRequest(), metadata=[("x-api-key", key)], timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_legacy_hashes_still_authenticate(legacy, pbkdf2_runs):
    _, port, keys = legacy
    for key_id in ("legacy", "old-sha", "fresh"):
        assert generate_code(port, [("x-api-key", keys[key_id])]) == 3, key_id
    # the legacy key ran PBKDF2 at most once: from then on its fingerprint is recognised
    assert generate_code(port, [("x-api-key", keys["legacy"])]) == 3
    assert len(pbkdf2_runs) <= 1
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        assert describe_code(stub, keys["old-sha"][:-1] + "x") == UNAUTH


def test_a_burst_of_wrong_secrets_is_refused_without_hashing(legacy, pbkdf2_runs):
    """200 wrong secrets for a known legacy-hashed id: PBKDF2 runs at most the per-id burst, the rest are
    refused at once; the key's holder keeps working, and so does the holder of a new key whose id is
    being guessed at."""
    import collections

    server, port, keys = legacy
    wrong = [f"fsk_legacy_{i:043d}" for i in range(200)]
    with grpc.insecure_channel(addr(port)) as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        assert describe_code(stub, keys["legacy"]) == grpc.StatusCode.OK  # its holder, verified before
        pbkdf2_runs.clear()
        # the gate's clock stands still: no failure allowance refills, however long a loaded host
        # takes for the calls
        clock, server.gate.clock = server.gate.clock, lambda now=server.gate.clock(): now
        try:
            codes = [describe_code(stub, key) for key in wrong]
            assert 1 <= len(pbkdf2_runs) <= key_gate.FAILURE_BURST_PER_KEY, len(pbkdf2_runs)
            counts = collections.Counter(codes)
            assert set(counts) == {UNAUTH, EXHAUSTED} and counts[UNAUTH] == len(pbkdf2_runs)
            assert codes[-1] == EXHAUSTED
            with pytest.raises(grpc.RpcError) as caught:
                stub.Describe(fusion_pb2.DescribeRequest(), metadata=[("x-api-key", wrong[0])], timeout=10)
            assert "too many failed attempts" in caught.value.details() and "retry in" in caught.value.details()
            assert describe_code(stub, keys["legacy"]) == grpc.StatusCode.OK  # not locked out
            # a new key's id: wrong secrets are rate-limited too, but its holder is never locked out
            hashed = len(pbkdf2_runs)
            fresh_wrong = [f"fsk_fresh_{i:043d}" for i in range(50)]
            fresh_codes = collections.Counter(describe_code(stub, key) for key in fresh_wrong)
            assert fresh_codes[EXHAUSTED] >= 40 and fresh_codes[UNAUTH] <= key_gate.FAILURE_BURST_PER_KEY
            assert describe_code(stub, keys["fresh"]) == grpc.StatusCode.OK
            assert len(pbkdf2_runs) == hashed  # new-format hashes run no PBKDF2
        finally:
            server.gate.clock = clock
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=HANG_S).read().decode()
    assert 'fusion_key_refusals_total{key_id="-",reason="auth_rate_limited"}' in text
    assert "fusion_key_slow_verifications_total" in text


def test_slow_verification_has_its_own_bounded_executor(loop):
    """At most `capacity` slow verifications run or wait, on the verifier's own thread: past that, refused
    at once (None) instead of queueing; a caller that goes away keeps its place until the thread is done."""
    import asyncio
    import contextlib

    verifier = key_gate.SlowVerifier(workers=1, capacity=2)
    release = threading.Event()
    threads = []

    def slow() -> bool:
        threads.append(threading.current_thread().name)
        release.wait(10)
        return True

    async def scenario():
        first = asyncio.ensure_future(verifier.run(slow))
        second = asyncio.ensure_future(verifier.run(slow))
        await asyncio.sleep(0)  # one turn of the loop: both tasks run up to their wait on the thread
        assert verifier.pending == 2
        full = await asyncio.wait_for(verifier.run(slow), 1)  # answered at once
        first.cancel()  # its caller goes away mid-hash: the place stays taken until the thread is done
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert first.cancelled() and verifier.pending == 2
        still_full = await asyncio.wait_for(verifier.run(slow), 1)
        release.set()
        return full, still_full, await second

    try:
        assert loop.run(scenario(), timeout=HANG_S) == (None, None, True)
        assert threads and all(name.startswith("fusion-key-verify") for name in threads)
        assert wait_until(lambda: verifier.pending == 0)
        assert loop.run(verifier.run(lambda: False), timeout=10) is False
    finally:
        release.set()
        verifier.close()


def test_gate_state_stays_bounded_under_wrong_keys(loop, tmp_path, pbkdf2_runs):
    """Thousands of distinct wrong keys (unknown ids, known ids with wrong secrets) add no per-key state:
    every map holds only ids of configured keys, and shrinks when a key leaves the file. Legacy hashes
    over all ids are held to the global rate; new-format hashes need no thread."""
    from prometheus_client import CollectorRegistry

    path = tmp_path / "keys.yaml"
    legacy_keys = {f"old-{i}": f"fsk_old-{i}_" + "x" * 43 for i in range(4)}
    api_keys.write_keys_file(path, {key_id: {"hash": pbkdf2_hash_key(key, iterations=1000)}
                                    for key_id, key in legacy_keys.items()})
    fresh = create_key(path, "fresh")
    registry = CollectorRegistry()
    gate = key_gate.KeyGate(ApiKeyStore(path=path), registry, slow_burst=3, slow_per_s=0.001)

    async def attempt(key):
        try:
            return (await gate.authenticate(key)).key_id
        except key_gate.Refusal as refusal:
            return refusal.status

    try:
        assert loop.run(attempt(fresh)) == "fresh" and gate.verifier._pool is None  # no thread for a keyed hash
        pbkdf2_runs.clear()
        for i in range(3000):
            key_id = ("fresh", "old-0", "old-1", "old-2", "old-3", f"nobody{i}")[i % 6]
            loop.run(attempt(f"fsk_{key_id}_{i:043d}"))
        sizes = gate.state_sizes()
        assert all(size <= 5 for size in sizes.values()), sizes
        assert len(pbkdf2_runs) <= 3  # the global rate of legacy verifications, over all four ids
        labels = {s.labels.get("key_id") for m in registry.collect() for s in m.samples if "key_id" in s.labels}
        assert labels <= {"-", "fresh"}
        # a key leaves the file: its state goes with it
        data = api_keys.read_keys_file(path)
        for key_id in ("old-0", "old-1", "old-2"):
            del data[key_id]
        api_keys.write_keys_file(path, data)
        assert loop.run(attempt(fresh)) == "fresh"
        assert all(size <= 2 for size in gate.state_sizes().values()), gate.state_sizes()
    finally:
        gate.close()


# -- fair share of the service's slots between keys --------------------------------------------------
def test_one_key_holds_at_most_its_share_of_the_slots(loop, tiny_dir, tmp_path):
    """max_concurrent_sessions 4, key_share 0.5: key A gets 2 streams, its 3rd is RESOURCE_EXHAUSTED naming
    key_share, while key B still gets a stream."""
    path = tmp_path / "keys.yaml"
    keys = {key_id: create_key(path, key_id) for key_id in ("team-a", "team-b")}
    limits = LIMITS | {"max_concurrent_sessions": 4, "key_share": 0.5}
    config = parse_config(tiny_config_dict(tiny_dir, limits=limits, security={"api_keys_file": str(path)}))
    server, port = loop.run(create_coordinator_server(config))
    long = fusion_pb2.GenerateRequest(prompt="hello", sampling=fusion_pb2.SamplingParams(max_tokens=300,
                                                                                         ignore_eos=True))
    try:
        with grpc.insecure_channel(addr(port)) as channel:
            stub = fusion_pb2_grpc.FusionStub(channel)
            streams = [stub.Generate(long, metadata=[("x-api-key", keys["team-a"])], timeout=HANG_S) for _ in range(2)]
            for stream in streams:
                next(stream)  # both are open
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(long, metadata=[("x-api-key", keys["team-a"])], timeout=HANG_S))
            details = caught.value.details()
            assert caught.value.code() == EXHAUSTED and "key_share" in details, details
            assert "0.5 of max_concurrent_sessions 4 allows 2 calls per key" in details
            assert generate_code(port, [("x-api-key", keys["team-b"])]) == 3  # the other key is served
            for stream in streams:
                stream.cancel()
        # the slots come back once A's streams end
        assert wait_until(lambda: generate_code(port, [("x-api-key", keys["team-a"])]) == 3,
                          interval_s=0.1)
    finally:
        loop.run(server.stop(0))

    from prometheus_client import CollectorRegistry

    def share(sessions: int, fraction: float) -> int:
        gate = key_gate.KeyGate(ApiKeyStore(path=path), CollectorRegistry(), max_concurrent_sessions=sessions,
                                key_share=fraction)
        return gate.streams_per_key

    assert (share(4, 0.5), share(1, 0.5), share(10, 0.3), share(64, 1.0), share(3, 0.1)) == (2, 1, 3, 64, 1)
    with pytest.raises(ConfigError, match="key_share"):
        parse_config(tiny_config_dict(tiny_dir, limits={"key_share": 0}))
    with pytest.raises(ConfigError, match="key_share"):
        parse_config(tiny_config_dict(tiny_dir, limits={"key_share": 1.5}))


def test_an_expert_server_beyond_loopback_needs_a_guard(loop, tiny_config, tmp_path, monkeypatch):
    """No secret and no client certificates: refused on a non-loopback address unless insecure."""
    expert = LocalExpert.load(tiny_config.expert("a"))
    with pytest.raises(ConfigError, match="would answer any caller on 0.0.0.0:0.*--insecure"):
        loop.run(create_expert_server(expert, tiny_config.limits, "0.0.0.0:0", security=SecurityConfig()))
    server, port = loop.run(create_expert_server(expert, tiny_config.limits, "0.0.0.0:0", security=SecurityConfig(),
                                                 insecure=True))
    loop.run(server.stop(0))
    monkeypatch.setenv("FUSION_TEST_EXPERT_SECRET", "s3cret")
    guarded = SecurityConfig(expert_secret_env="FUSION_TEST_EXPERT_SECRET")
    server, port = loop.run(create_expert_server(expert, tiny_config.limits, "0.0.0.0:0", security=guarded))
    loop.run(server.stop(0))
    server, port = loop.run(create_expert_server(expert, tiny_config.limits, "127.0.0.1:0"))  # loopback: fine
    loop.run(server.stop(0))
