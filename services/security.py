"""Transport security and authentication for both gRPC services (the config's `security:` section).

- TLS: `server_credentials` / `channel_credentials` build gRPC credentials from the PEM files the
  config names; `open_channel` opens a plaintext or TLS channel (sync or `grpc.aio`) and attaches
  metadata (an API key, the expert secret) to every call.
- API keys (Fusion service): `ApiKeyStore` reads `key id → {hash, revoked, limits}` from a YAML file
  (re-read when it changes, so a revocation takes effect without a restart) or from the YAML text
  of an environment variable. Keys look like `fsk_<id>_<secret>` (a 256-bit random secret); only
  a keyed hash is stored, `hmac-sha256$HEX` under the server's pepper (`hash_key` says why a fast
  hash is right for random secrets). Files written before keep working: `pbkdf2_sha256$...` and
  `sha256:HEX` entries still verify. A PBKDF2 hash cannot be rehashed without the key itself, so
  there is no offline migration: `fusion keys create --id ID --reissue` gives the id a new key in the
  current format (until then, legacy entries verify through the bounded path below). Writes
  replace the file atomically (temporary file, then os.replace).
- `KeyGate` is the per-key gate with no transport in it: it authenticates a key and enforces the
  key's limits: concurrent calls (Generate and Score each hold a slot), its share of the service's
  slots (`limits.key_share` of `max_concurrent_sessions`, so one key never takes every slot while
  another waits). `KeyGate.tenant` gives the runtime the key as a `Tenant`: its weight in every
  queue, its max tokens per request, and its tokens per minute as a quota on which the service
  reserves a request's tokens at admission (`KeyQuota`, a sliding 60 s window; settled with what the
  request used). Keyed hashes are checked inline in microseconds; wrong secrets are rate-limited per
  key id, and legacy PBKDF2 checks also globally, refused before any hashing past the rate and run
  on their own bounded executor. Its per-key state is bounded by the configured keys.
  `ApiKeyInterceptor`, its gRPC adapter, reads `authorization: Bearer <key>` or `x-api-key: <key>`
  on every Fusion method (health and reflection stay open for probes). Refusals: UNAUTHENTICATED,
  or RESOURCE_EXHAUSTED naming the limit (or too many failed attempts) with a retry pushback. The
  HTTP API (`services.http_server`) calls the same gate and answers `Refusal.http_status` (401, 429
  with Retry-After).
- `check_expert_exposure`: an Expert server beyond loopback needs the secret or client certificates,
  unless told `insecure`.
- Expert service: `ExpertSecretInterceptor` accepts only callers sending the shared secret in
  `x-fusion-expert-secret` (compared in constant time); with `tls.require_client_auth` the TLS
  handshake itself refuses callers without a client certificate signed by the CA.
- Per-key usage counters (`fusion_key_*`) carry the key id, never the key.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import secrets
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import grpc
import yaml
from prometheus_client import CollectorRegistry, Counter

from fusion.config import Limits, SecurityConfig
from fusion.errors import ConfigError, InvalidArgumentError, ServiceBusyError
from fusion.tenancy import LOCAL, Tenant
from services.status import abort_with_retry

logger = logging.getLogger(__name__)

API_KEY_HEADER = "x-api-key"
EXPERT_SECRET_HEADER = "x-fusion-expert-secret"
KEY_PREFIX = "fsk_"
HMAC_SCHEME = "hmac-sha256"
# The pepper when the config names none. Public on purpose: key secrets are 256 bits of randomness,
# so their hashes cannot be brute-forced with or without a secret pepper (see `hash_key`).
DEFAULT_PEPPER = b"fusion-api-keys/hmac-sha256/v1"
LEGACY_PBKDF2_ITERATIONS = 200_000  # what `fusion keys create` wrote before the keyed hash
WINDOW_S = 60.0
_ANONYMOUS = "-"  # key id label of callers without a valid key (never their key or a made-up id)


# -- TLS -----------------------------------------------------------------------------------------
def _read(path: str | None, field_name: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"security.tls.{field_name}: cannot read {path!r}: {err.strerror or err}") from None


def server_credentials(security: SecurityConfig, *, expert: bool) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None: plaintext). Expert servers require client certificates
    when `tls.require_client_auth` is set; the coordinator authenticates clients by API key."""
    tls = security.tls
    if security.plaintext or tls is None:
        return None
    if tls.cert_file is None:
        raise ConfigError("security.tls.cert_file: a TLS server needs a certificate and key")
    pair = (_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))
    require = bool(expert and tls.require_client_auth)
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(tls.ca_file, "ca_file") if require else None,
        require_client_auth=require,
    )


def channel_credentials(security: SecurityConfig, *, to_expert: bool) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel (None: plaintext). Channels to experts present the client
    certificate when the config names one."""
    tls = security.tls
    if security.plaintext or tls is None:
        return None
    key = cert = None
    if to_expert and tls.client_cert_file is not None:
        key = _read(tls.client_key_file, "client_key_file")
        cert = _read(tls.client_cert_file, "client_cert_file")
    return grpc.ssl_channel_credentials(_read(tls.ca_file, "ca_file"), key, cert)


def tls_options(security: SecurityConfig) -> list[tuple[str, Any]]:
    if security.plaintext or security.tls is None or not security.tls.server_name:
        return []
    return [("grpc.ssl_target_name_override", security.tls.server_name)]


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_plaintext(address: str, service: str) -> None:
    if not is_loopback(address):
        logger.warning("%s serves PLAINTEXT on %s (security.plaintext): traffic and API keys are not "
                       "encrypted; give a security.tls section on a shared network", service, address)


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata to every call of a sync channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = list(metadata)

    def _details(self, details):
        return details._replace(metadata=list(details.metadata or []) + self.metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _AioMetadataInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = list(metadata)

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ())), *self.metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def open_channel(
    address: str,
    security: SecurityConfig | None = None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    to_expert: bool = False,
    metadata: Sequence[tuple[str, str]] = (),
    aio: bool = False,
    credentials: grpc.ChannelCredentials | None = None,
):
    """A channel to `address`: TLS where the config (or `credentials`) says so, else plaintext;
    `metadata` goes with every call (an API key, the expert secret)."""
    security = security or SecurityConfig()
    creds = credentials or channel_credentials(security, to_expert=to_expert)
    options = list(options) + tls_options(security)
    if aio:
        interceptors = [_AioMetadataInterceptor(metadata)] if metadata else None
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    channel = (grpc.insecure_channel(address, options=options) if creds is None
               else grpc.secure_channel(address, creds, options=options))
    return grpc.intercept_channel(channel, _MetadataInterceptor(metadata)) if metadata else channel


def api_key_metadata(api_key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")] if api_key else []


# -- the expert secret ---------------------------------------------------------------------------
def configured_secret(security: SecurityConfig, field: str) -> str | None:
    """The secret that `security.<field>_env` (an environment variable) or `security.<field>_file`
    names, stripped; None when neither is set. Unset, empty or unreadable: ConfigError naming the field."""
    env, file = getattr(security, f"{field}_env"), getattr(security, f"{field}_file")
    if env is not None:
        value = os.environ.get(env, "")
        if not value:
            raise ConfigError(f"security.{field}_env: the environment variable {env!r} is unset or empty")
        return value
    if file is not None:
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"security.{field}_file: cannot read {file!r}: {err}") from None
        if not value:
            raise ConfigError(f"security.{field}_file: {file!r} is empty")
        return value
    return None


def expert_secret(security: SecurityConfig) -> str | None:
    """The shared coordinator↔expert secret the config names (None: none configured)."""
    return configured_secret(security, "expert_secret")


def expert_channel_metadata(security: SecurityConfig | None) -> list[tuple[str, str]]:
    secret = expert_secret(security) if security is not None else None
    return [(EXPERT_SECRET_HEADER, secret)] if secret else []


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
              retry_after_s: float | None = None) -> grpc.RpcMethodHandler:
    """The same method (same deserialisers), answering only `code`."""

    async def unary(request, context):
        await abort_with_retry(context, code, message, retry_after_s)

    async def stream(request, context):
        await abort_with_retry(context, code, message, retry_after_s)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=stream)
    return handler  # client-streaming methods: none in these services


def _metadata(details: grpc.HandlerCallDetails) -> dict[str, str]:
    out = {}
    for key, value in details.invocation_metadata or ():
        if isinstance(value, bytes):
            continue
        out.setdefault(key.lower(), value)
    return out


class ExpertSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every Expert-service call without the shared secret (health and reflection stay open)."""

    def __init__(self, secret: str, service: str) -> None:
        self._secret = secret.encode("utf-8")
        self._prefix = f"/{service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        given = _metadata(handler_call_details).get(EXPERT_SECRET_HEADER, "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._secret):
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                             "the Expert service answers only the coordinator: missing or wrong "
                             f"{EXPERT_SECRET_HEADER}")
        return handler


def check_expert_exposure(security: SecurityConfig | None, address: str, insecure: bool) -> None:
    """An Expert service that would answer anyone beyond loopback is refused unless `insecure`: on a
    shared network any caller could step, score and release sessions (one large Release froze a live
    stream for seconds)."""
    host = address.rpartition(":")[0].strip("[]")
    guarded = security is not None and (expert_secret(security) is not None or (
        security.tls is not None and not security.plaintext and security.tls.require_client_auth))
    if guarded or insecure or is_loopback(host):
        return
    raise ConfigError(f"the Expert service would answer any caller on {address}: set security.expert_secret_env "
                      "(or expert_secret_file, or tls.require_client_auth), listen on loopback, or pass --insecure "
                      "(deploy args: insecure_experts: true) on a network you trust")


def expert_interceptors(security: SecurityConfig | None, service: str) -> list[grpc.aio.ServerInterceptor]:
    if security is None:
        return []
    secret = expert_secret(security)
    if secret is None:
        if not (security.tls is not None and security.tls.require_client_auth):
            logger.warning("the Expert service accepts any caller: set security.expert_secret_env (or _file) "
                           "or security.tls.require_client_auth")
        return []
    return [ExpertSecretInterceptor(secret, service)]


# -- API keys ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyLimits:
    max_concurrent_streams: int | None = None
    tokens_per_minute: int | None = None
    max_tokens_per_request: int | None = None
    weight: float | None = None  # the key's share of every queue against other waiting keys (default 1)


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    hash: str
    revoked: bool = False
    limits: KeyLimits = KeyLimits()


def key_pepper(security: SecurityConfig | None) -> bytes:
    """The pepper of API key hashes the config names (`api_keys_pepper_env` or `_file`), else
    DEFAULT_PEPPER. Servers and `fusion keys create` must use the same one."""
    if security is None:
        return DEFAULT_PEPPER
    value = configured_secret(security, "api_keys_pepper")
    return value.encode("utf-8") if value is not None else DEFAULT_PEPPER


def hash_key(key: str, *, pepper: bytes = DEFAULT_PEPPER) -> str:
    """`hmac-sha256$HEX`: HMAC-SHA256 of the whole key under the server's pepper.

    A fast keyed hash is enough, and safer for the server than a slow one: the secrets are 256-bit
    random values, not passwords, so no dictionary or brute force can find one from its hash (a slow
    KDF only helps low-entropy secrets), while a slow hash makes every wrong guess cost the server
    CPU. The pepper is defence in depth: a leaked keys file without it cannot even confirm a stolen
    candidate key offline. Without a configured pepper, DEFAULT_PEPPER is used, which is still safe
    for the reason above."""
    return f"{HMAC_SCHEME}${hmac.digest(pepper, key.encode('utf-8'), 'sha256').hex()}"


def pbkdf2_hash_key(key: str, *, iterations: int = LEGACY_PBKDF2_ITERATIONS, salt: bytes | None = None) -> str:
    """The legacy `pbkdf2_sha256$ITER$SALT$HEX` format (still verified; no longer written)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = _pbkdf2_hmac("sha256", key.encode("utf-8"), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


_pbkdf2_hmac = hashlib.pbkdf2_hmac  # one name for every PBKDF2 run (tests count them)


def is_slow_hash(stored: str) -> bool:
    """Whether verifying against `stored` is slow (a legacy PBKDF2 hash) rather than microseconds."""
    return stored.startswith("pbkdf2_sha256$")


def verify_key(key: str, stored: str, *, pepper: bytes = DEFAULT_PEPPER) -> bool:
    """Check `key` against a stored hash: `hmac-sha256$HEX` (under `pepper`), or the legacy
    `pbkdf2_sha256$ITER$SALT$HEX` and `sha256:HEX`."""
    try:
        data = key.encode("utf-8")
        if stored.startswith(HMAC_SCHEME + "$"):
            return hmac.compare_digest(hmac.digest(pepper, data, "sha256").hex(), stored[len(HMAC_SCHEME) + 1:])
        if stored.startswith("sha256:"):
            return hmac.compare_digest(hashlib.sha256(data).hexdigest(), stored[7:])
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != "pbkdf2_sha256":
            return False
        computed = _pbkdf2_hmac("sha256", data, bytes.fromhex(salt), int(iterations))
        return hmac.compare_digest(computed.hex(), digest)
    except (ValueError, UnicodeEncodeError):
        return False


def new_key(key_id: str) -> str:
    if not key_id or "_" in key_id or not all(c.isalnum() or c in "-." for c in key_id):
        raise ConfigError(f"key id {key_id!r}: use letters, digits, '-' and '.'")
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=").replace("_", "-")
    return f"{KEY_PREFIX}{key_id}_{secret}"


def key_id_of(key: str) -> str | None:
    if not key.startswith(KEY_PREFIX):
        return None
    body = key[len(KEY_PREFIX):]
    key_id, sep, _ = body.partition("_")
    return key_id if sep and key_id else None


_LIMIT_FIELDS = {"max_concurrent_streams", "tokens_per_minute", "max_tokens_per_request", "weight"}


def parse_keys(data: Any, source: str) -> dict[str, ApiKey]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of key id -> {{hash, revoked, limits}}")
    keys = {}
    for key_id, entry in data.items():
        where = f"{source}: {key_id}"
        if not isinstance(entry, dict) or not isinstance(entry.get("hash"), str):
            raise ConfigError(f"{where}: needs a 'hash' string")
        unknown = set(entry) - {"hash", "revoked", "limits", "created"}
        if unknown:
            raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
        limits = entry.get("limits") or {}
        if not isinstance(limits, dict) or set(limits) - _LIMIT_FIELDS:
            raise ConfigError(f"{where}.limits: expected some of {sorted(_LIMIT_FIELDS)}, got {limits!r}")
        for name, value in limits.items():
            if value is None:
                continue
            if name == "weight":  # a share, relative to other keys' weights
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1e-3 <= value <= 1e3:
                    raise ConfigError(f"{where}.limits.weight: must be a number from 0.001 to 1000, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}.limits.{name}: must be a positive integer, got {value!r}")
        keys[str(key_id)] = ApiKey(str(key_id), entry["hash"], bool(entry.get("revoked", False)), KeyLimits(**limits))
    return keys


def read_keys_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"API keys file {path}: {err}".replace("\n", " ")) from None
    return data or {}


def write_keys_file(path: str | Path, data: Mapping[str, Any]) -> None:
    """Replace the keys file atomically (a temporary file in the same folder, mode 0600, then
    os.replace): servers re-read it while it is written and must never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yaml.safe_dump(dict(data), out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def create_key(path: str | Path, key_id: str, *, limits: Mapping[str, float | None] | None = None,
               reissue: bool = False, pepper: bytes = DEFAULT_PEPPER) -> str:
    """Add key `key_id` to the keys file (created if missing, mode 0600); returns the key, which is
    stored only as its keyed hash. Refuses to replace an existing id unless `reissue`: then the id
    gets a new secret (the old key stops working; its limits stay unless `limits` sets them)."""
    path = Path(path)
    data = read_keys_file(path)
    parse_keys(data, str(path))
    if key_id in data and not reissue:
        raise ConfigError(f"API keys file {path}: key id {key_id!r} exists (revoke it, choose another id, "
                          "or reissue it with --reissue)")
    if reissue and key_id not in data:
        raise ConfigError(f"API keys file {path}: no key id {key_id!r} to reissue")
    key = new_key(key_id)
    entry: dict[str, Any] = {"hash": hash_key(key, pepper=pepper), "revoked": False,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    kept = dict(data[key_id].get("limits") or {}) if reissue else {}
    clean = kept | {k: v for k, v in (limits or {}).items() if v is not None}
    if clean:
        entry["limits"] = clean
    data[key_id] = entry
    parse_keys(data, str(path))
    write_keys_file(path, data)
    return key


def revoke_key(path: str | Path, key_id: str) -> None:
    path = Path(path)
    data = read_keys_file(path)
    if key_id not in data:
        raise ConfigError(f"API keys file {path}: no key id {key_id!r}")
    data[key_id]["revoked"] = True
    write_keys_file(path, data)


class ApiKeyStore:
    """The keys of a file (re-read when it changes: another inode, mtime or size) or of an environment
    variable, and the pepper of their hashes. Holds nothing per caller: see `KeyGate`."""

    def __init__(self, *, path: str | Path | None = None, env: str | None = None,
                 pepper: bytes = DEFAULT_PEPPER) -> None:
        self.path = Path(path) if path is not None else None
        self.env = env
        self.pepper = pepper
        self.generation = 0  # counts the reads of the file: per-key state elsewhere is pruned on a change
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[str, ApiKey] = {}
        self._lock = threading.Lock()
        if env is not None:
            text = os.environ.get(env)
            if text is None:
                raise ConfigError(f"security.api_keys_env: the environment variable {env!r} is unset")
            try:
                self._keys = parse_keys(yaml.safe_load(text), f"${env}")
            except yaml.YAMLError as err:
                message = f"security.api_keys_env: ${env} is not valid YAML: {err}".replace("\n", " ")
                raise ConfigError(message) from None
        else:
            self._reload()

    @classmethod
    def from_config(cls, security: SecurityConfig | None) -> ApiKeyStore | None:
        if security is None or (security.api_keys_file is None and security.api_keys_env is None):
            return None
        return cls(path=security.api_keys_file, env=security.api_keys_env, pepper=key_pepper(security))

    def _reload(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp and self._stamp is not None:
            return
        try:
            keys = parse_keys(read_keys_file(self.path), str(self.path))
        except ConfigError:
            if self._stamp is None:
                raise
            logger.exception("API keys file %s is invalid; keeping the keys read before", self.path)
            return
        with self._lock:
            self._keys, self._stamp = keys, stamp
            self.generation += 1

    def key_ids(self) -> set[str]:
        with self._lock:
            return set(self._keys)

    def lookup(self, key: str) -> ApiKey | None:
        """The record of the id `key` names (the file re-read if it changed), not yet verified."""
        self._reload()
        key_id = key_id_of(key)
        with self._lock:
            return self._keys.get(key_id) if key_id is not None else None

    def verify(self, key: str, record: ApiKey) -> bool:
        return verify_key(key, record.hash, pepper=self.pepper)

    def authenticate(self, key: str) -> tuple[ApiKey | None, str]:
        """(the key's record, "") or (None, why it was refused), verifying in the calling thread
        (legacy PBKDF2 hashes too): for tools. Servers go through `KeyGate`, which bounds that work."""
        record = self.lookup(key)
        if record is None or not self.verify(key, record):
            return None, "unknown API key"
        if record.revoked:
            return None, f"API key {record.key_id!r} is revoked"
        return record, ""


# -- per-key usage and limits: the transport-neutral gate ----------------------------------------
# Failed authentication, per key id: a burst of wrong secrets, then one every 1 / rate seconds.
# What a refusal for a key's slots suggests to wait: a slot frees when a call ends, which no one knows.
STREAM_RETRY_S = 1.0
FAILURE_BURST_PER_KEY = 5
FAILURES_PER_S_PER_KEY = 0.2
# Legacy PBKDF2 verifications of wrong keys, over all ids: a burst, then this rate.
SLOW_VERIFY_BURST = 10
SLOW_VERIFIES_PER_S = 1.0
SLOW_VERIFY_WORKERS = 1
SLOW_VERIFY_CAPACITY = 4  # PBKDF2 verifications running or waiting; past that, refused at once


class KeyMetrics:
    """Per-key counters (key id label only, never the key)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("fusion_key_requests", "Authenticated requests, by API key id and method",
                                ["key_id", "method"], registry=registry)
        self.tokens = Counter("fusion_key_tokens", "Tokens charged to tokens_per_minute (prompts, generated and "
                              "scored tokens), by API key id", ["key_id"], registry=registry)
        self.refusals = Counter("fusion_key_refusals", "Refused requests, by API key id ('-': no valid key) and reason",
                                ["key_id", "reason"], registry=registry)
        self.slow_verifications = Counter("fusion_key_slow_verifications",
                                          "Legacy PBKDF2 key verifications run (bounded and rate-limited)",
                                          registry=registry)


@dataclass
class _Usage:
    """A key's open streams and its tokens over the last WINDOW_S seconds, in one-second buckets: at
    most WINDOW_S + 1 entries per key, whether or not the key has a tokens_per_minute limit."""

    streams: int = 0
    tokens: deque = field(default_factory=deque)  # [monotonic time of the bucket's first token, count]
    window_total: int = 0

    def tokens_in_window(self, now: float) -> int:
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.window_total -= self.tokens.popleft()[1]
        return self.window_total

    def add_tokens(self, now: float, count: int) -> list:
        """Count `count` tokens now; the bucket they went into."""
        if self.tokens and now - self.tokens[-1][0] < 1.0:  # the current one-second bucket
            self.tokens[-1][1] += count
        else:
            self.tokens.append([now, count])
        self.window_total += count
        self.tokens_in_window(now)  # trims what left the window
        return self.tokens[-1] if self.tokens else [now, 0]

    def give_back(self, bucket: list, count: int, now: float) -> None:
        """Take `count` tokens out of `bucket` if it is still in the window (else they left already)."""
        self.tokens_in_window(now)
        if count > 0 and any(b is bucket for b in self.tokens):
            bucket[1] -= count
            self.window_total -= count

    def wait_until_free(self, tokens: int, now: float) -> float:
        """Seconds until `tokens` of the window's tokens have left it."""
        freed = 0
        for start, count in self.tokens:
            freed += count
            if freed >= tokens:
                return max(0.0, start + WINDOW_S - now)
        return WINDOW_S


class TokenBucket:
    """`burst` tokens, refilled at `rate` per second."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, float(burst), now

    def _refill(self, now: float) -> None:
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def available(self, now: float, count: float = 1.0) -> bool:
        self._refill(now)
        return self.tokens >= count

    def take(self, now: float, count: float = 1.0) -> bool:
        if not self.available(now, count):
            return False
        self.tokens -= count
        return True

    def give_back(self) -> None:
        self.tokens = min(float(self.burst), self.tokens + 1.0)

    def wait_s(self, now: float, count: float = 1.0) -> float:
        self._refill(now)
        return 0.0 if self.tokens >= count else (count - self.tokens) / self.rate


class SlowVerifier:
    """Runs slow (legacy PBKDF2) verifications on its own executor: `workers` threads and at most
    `capacity` verifications running or waiting, counted until the thread finishes one (a caller that
    goes away does not free its place early); past that, `run` answers None at once. Never the event
    loop's shared default executor, so a flood of guesses cannot delay other work that uses it."""

    def __init__(self, workers: int = SLOW_VERIFY_WORKERS, capacity: int = SLOW_VERIFY_CAPACITY) -> None:
        self.workers, self.capacity = workers, capacity
        self._pool: ThreadPoolExecutor | None = None
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    def _done(self, _future) -> None:
        with self._lock:
            self._pending -= 1

    async def run(self, fn: Callable[..., bool], *args: Any) -> bool | None:
        with self._lock:
            if self._pending >= self.capacity:
                return None
            self._pending += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fusion-key-verify")
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_CALLER: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("fusion_key_tenant", default=None)


def current_tenant() -> Tenant:
    """The tenant of the gRPC call in progress (its API key, set by `ApiKeyInterceptor` around the
    handler, in the call's task); the local tenant without API keys."""
    return _CALLER.get() or LOCAL


UNAUTHENTICATED, RESOURCE_EXHAUSTED = "unauthenticated", "resource_exhausted"
_GRPC_CODES = {UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED, RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED}
_HTTP_CODES = {UNAUTHENTICATED: 401, RESOURCE_EXHAUSTED: 429}


class Refusal(Exception):
    """Why the gate refuses a call: `status` is UNAUTHENTICATED or RESOURCE_EXHAUSTED (as a gRPC code:
    `grpc_code`; as an HTTP status: `http_status`); `reason` labels the refusal metric;
    `retry_after_s`, when a retry can succeed, says when."""

    def __init__(self, status: str, message: str, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.reason, self.retry_after_s = status, message, reason, retry_after_s

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES[self.status]

    @property
    def http_status(self) -> int:
        return _HTTP_CODES[self.status]


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The key in `authorization: Bearer <key>` or `x-api-key: <key>` (header names in lower case)."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None
    return headers.get(API_KEY_HEADER) or None


class KeyStream:
    """One admitted call of a key (a stream or a Score): holds one of its slots until `close`
    (idempotent)."""

    def __init__(self, gate: KeyGate, record: ApiKey, usage: _Usage) -> None:
        self.gate, self.record, self.usage = gate, record, usage
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.gate._stream_closed(self.record.key_id, self.usage)


class KeyReservation:
    """Tokens a key's window holds for one request, added to the second they were reserved in; `settle`
    gives back what the request did not use."""

    def __init__(self, gate: KeyGate, record: ApiKey, usage: _Usage, bucket: list, tokens: int) -> None:
        self.gate, self.record, self.usage, self.bucket, self.tokens = gate, record, usage, bucket, tokens

    def settle(self, used: int) -> None:
        used = max(0, min(used, self.tokens))
        with self.gate.lock:
            self.usage.give_back(self.bucket, self.tokens - used, self.gate.clock())
        self.gate.metrics.tokens.labels(key_id=self.record.key_id).inc(used)


class KeyQuota:
    """A key's tokens_per_minute as the runtime's `Quota`: a request reserves what it may use (its
    prompt and max_tokens; a Score its prompt and continuation) before any work."""

    def __init__(self, gate: KeyGate, record: ApiKey) -> None:
        self.gate, self.record = gate, record

    def reserve(self, tokens: int) -> KeyReservation:
        gate, record = self.gate, self.record
        limit = record.limits.tokens_per_minute
        with gate.lock:
            usage = gate.usage(record.key_id)
            now = gate.clock()
            if limit is not None:
                if tokens > limit:
                    gate.metrics.refusals.labels(key_id=record.key_id, reason="tokens_per_minute").inc()
                    raise InvalidArgumentError(
                        f"max_tokens: the request needs {tokens} tokens (prompt + max_tokens) and API key "
                        f"{record.key_id!r} has tokens_per_minute={limit}: ask for fewer tokens")
                used = usage.tokens_in_window(now)
                if used + tokens > limit:
                    wait = usage.wait_until_free(used + tokens - limit, now)
                    gate.metrics.refusals.labels(key_id=record.key_id, reason="tokens_per_minute").inc()
                    raise ServiceBusyError(
                        f"API key {record.key_id!r}: tokens_per_minute {limit} would be exceeded ({used} used in "
                        f"the last {WINDOW_S:g} s, this request needs {tokens}); retry in {math.ceil(wait)} s",
                        retry_after_s=wait)
            bucket = usage.add_tokens(now, tokens)
        return KeyReservation(gate, record, usage, bucket, tokens)


class KeyGate:
    """The per-key gate of a front end, with no transport in it: `authenticate` a key, `open_stream`
    or `check_rate` under the key's limits, count tokens. The gRPC `ApiKeyInterceptor` is a thin
    adapter over it; an HTTP front end would call the same methods and answer `Refusal.http_status`.

    Authentication costs microseconds: keyed hashes are checked inline. Wrong secrets are
    rate-limited per key id (a token bucket, FAILURE_BURST_PER_KEY then FAILURES_PER_S_PER_KEY);
    past it a wrong secret gets RESOURCE_EXHAUSTED. A fast hash is still checked then (a microsecond),
    so someone guessing at a public key id cannot lock out its holder. Legacy PBKDF2 hashes are the
    costly case: past the per-id or the global rate (SLOW_VERIFY_BURST, SLOW_VERIFIES_PER_S) the
    attempt is refused before any hashing, and the verifications that do run go to a bounded
    `SlowVerifier`, never the shared default executor; a legacy key that verified once is
    recognised by its SHA-256 fingerprint from then on (one entry per key id).

    Every per-key map (usage, failure buckets, verified legacy keys) holds only ids of the store's
    keys and is pruned when the keys file changes: wrong keys, however many, add no state."""

    def __init__(self, store: ApiKeyStore, registry: CollectorRegistry, *,
                 max_concurrent_sessions: int | None = None, key_share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, verifier: SlowVerifier | None = None,
                 failure_burst: int = FAILURE_BURST_PER_KEY, failures_per_s: float = FAILURES_PER_S_PER_KEY,
                 slow_burst: int = SLOW_VERIFY_BURST, slow_per_s: float = SLOW_VERIFIES_PER_S) -> None:
        self.store = store
        self.metrics = KeyMetrics(registry)
        self.max_concurrent_sessions, self.key_share = max_concurrent_sessions, key_share
        # limits.key_share: the streams one key may hold of the service's slots (at least one)
        self.streams_per_key = (None if max_concurrent_sessions is None
                                else max(1, math.floor(key_share * max_concurrent_sessions + 1e-9)))
        self.clock = clock
        self.verifier = verifier or SlowVerifier()
        self.failure_burst, self.failures_per_s = failure_burst, failures_per_s
        self._slow = TokenBucket(slow_per_s, slow_burst, clock())
        self._usage: dict[str, _Usage] = {}
        self.lock = threading.Lock()  # windows are reserved from admission threads and settled anywhere
        self._failures: dict[str, TokenBucket] = {}
        self._verified: dict[str, tuple[bytes, str]] = {}  # key id -> (sha256 of its key, the hash it matched)
        self._generation = store.generation
        self._known = store.key_ids()

    @classmethod
    def from_config(cls, security: SecurityConfig | None, registry: CollectorRegistry, *,
                    limits: Limits | None = None) -> KeyGate | None:
        """The gate of the config's keys (None without keys); `limits` gives key_share of
        max_concurrent_sessions."""
        store = ApiKeyStore.from_config(security)
        if store is None:
            return None
        limits = limits or Limits()
        return cls(store, registry, max_concurrent_sessions=limits.max_concurrent_sessions,
                   key_share=limits.key_share)

    def close(self) -> None:
        self.verifier.close()

    # -- state, bounded by the store's key ids ----------------------------------------------------
    def usage(self, key_id: str) -> _Usage:
        return self._usage.setdefault(key_id, _Usage())

    def state_sizes(self) -> dict[str, int]:
        return {"usage": len(self._usage), "failures": len(self._failures), "verified": len(self._verified)}

    def _prune(self) -> None:
        if self.store.generation == self._generation:
            return
        self._generation, self._known = self.store.generation, self.store.key_ids()
        for table in (self._failures, self._verified):
            for key_id in [k for k in table if k not in self._known]:
                del table[key_id]
        for key_id in [k for k, usage in self._usage.items() if k not in self._known and not usage.streams]:
            del self._usage[key_id]

    def _stream_closed(self, key_id: str, usage: _Usage) -> None:
        usage.streams -= 1
        if not usage.streams and key_id not in self._known and self._usage.get(key_id) is usage:
            del self._usage[key_id]

    # -- authentication -----------------------------------------------------------------------------
    def _unauthenticated(self, message: str, reason: str, key_id: str = _ANONYMOUS) -> Refusal:
        self.metrics.refusals.labels(key_id=key_id, reason=reason).inc()
        return Refusal(UNAUTHENTICATED, message, reason)

    def _too_many_failures(self, key_id: str, wait_s: float, scope: str) -> Refusal:
        self.metrics.refusals.labels(key_id=_ANONYMOUS, reason="auth_rate_limited").inc()
        return Refusal(RESOURCE_EXHAUSTED, f"too many failed attempts {scope} (key id {key_id!r}); retry in "
                       f"{max(1, math.ceil(wait_s))} s", "auth_rate_limited", max(wait_s, 0.001))

    def _failures_of(self, key_id: str, now: float) -> TokenBucket:
        bucket = self._failures.get(key_id)
        if bucket is None:
            bucket = self._failures[key_id] = TokenBucket(self.failures_per_s, self.failure_burst, now)
        return bucket

    async def authenticate(self, key: str | None) -> ApiKey:
        """The record of a valid, unrevoked key; else raises Refusal (UNAUTHENTICATED, or
        RESOURCE_EXHAUSTED past the rate of failed attempts or when slow verification is busy)."""
        if key is None:
            raise self._unauthenticated("an API key is required: send 'authorization: Bearer <key>' or "
                                        "'x-api-key: <key>'", "no_key")
        record = self.store.lookup(key)
        self._prune()
        if record is None:
            raise self._unauthenticated("unknown API key", "bad_key")
        if is_slow_hash(record.hash):
            valid = await self._verify_slow(key, record)
        else:
            valid = self.store.verify(key, record)
            if not valid:
                now = self.clock()
                bucket = self._failures_of(record.key_id, now)
                if not bucket.take(now):
                    raise self._too_many_failures(record.key_id, bucket.wait_s(now), "for this key")
        if not valid:
            raise self._unauthenticated("unknown API key", "bad_key")
        if record.revoked:
            raise self._unauthenticated(f"API key {record.key_id!r} is revoked", "revoked", record.key_id)
        return record

    async def _verify_slow(self, key: str, record: ApiKey) -> bool:
        fingerprint = hashlib.sha256(key.encode("utf-8", "replace")).digest()
        if self._verified.get(record.key_id) == (fingerprint, record.hash):
            return True
        now = self.clock()
        bucket = self._failures_of(record.key_id, now)
        if not bucket.available(now):
            raise self._too_many_failures(record.key_id, bucket.wait_s(now), "for this key")
        if not self._slow.available(now):
            raise self._too_many_failures(record.key_id, self._slow.wait_s(now), "on legacy-hashed keys")
        bucket.take(now)  # charged before hashing, so concurrent guesses cannot pass the rate; given back if right
        self._slow.take(now)
        valid = await self.verifier.run(self.store.verify, key, record)
        if valid is None:
            bucket.give_back()
            self._slow.give_back()
            self.metrics.refusals.labels(key_id=_ANONYMOUS, reason="auth_busy").inc()
            raise Refusal(RESOURCE_EXHAUSTED, "key verification is busy (a legacy-hashed key); retry shortly",
                          "auth_busy", STREAM_RETRY_S)
        self.metrics.slow_verifications.inc()
        if valid:
            bucket.give_back()
            self._slow.give_back()
            if record.key_id in self._known:
                self._verified[record.key_id] = (fingerprint, record.hash)
        return valid

    # -- limits ------------------------------------------------------------------------------------
    def count_request(self, record: ApiKey, method: str) -> None:
        self.metrics.requests.labels(key_id=record.key_id, method=method).inc()

    def refuse(self, record: ApiKey, limit: str, message: str, retry_after_s: float | None = None) -> Refusal:
        self.metrics.refusals.labels(key_id=record.key_id, reason=limit).inc()
        return Refusal(RESOURCE_EXHAUSTED, f"API key {record.key_id!r}: {limit} {message}", limit, retry_after_s)

    def tenant(self, record: ApiKey) -> Tenant:
        """The key as the runtime sees it: its weight, its per-request cap and its token quota."""
        limits = record.limits
        return Tenant(record.key_id, float(limits.weight or 1.0), limits.max_tokens_per_request,
                      KeyQuota(self, record))

    @contextlib.contextmanager
    def calling_as(self, record: ApiKey) -> Iterator[None]:
        """Within: `current_tenant()` is `record`'s key (the handler runs in the same task)."""
        token = _CALLER.set(self.tenant(record))
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):  # a stream closed from another context (a finalizer)
                _CALLER.reset(token)

    def check_rate(self, record: ApiKey) -> None:
        """Raises Refusal, with the time until tokens leave it, while the key's window is used up."""
        limit = record.limits.tokens_per_minute
        if limit is not None:
            usage, now = self.usage(record.key_id), self.clock()
            used = usage.tokens_in_window(now)
            if used >= limit:
                wait = usage.wait_until_free(used - limit + 1, now)
                raise self.refuse(record, "tokens_per_minute", f"limit {limit} reached ({used} tokens in the "
                                  f"last {WINDOW_S:g} s); retry in {math.ceil(wait)} s", retry_after_s=wait)

    def open_stream(self, record: ApiKey) -> KeyStream:
        """Admit a call of the key (a stream or a Score) into one of its slots, or raise Refusal naming
        the limit. Its tokens are reserved at admission (`KeyQuota`), once they are known."""
        limits = record.limits
        self.check_rate(record)
        usage = self.usage(record.key_id)
        if limits.max_concurrent_streams is not None and usage.streams >= limits.max_concurrent_streams:
            raise self.refuse(record, "max_concurrent_streams",
                              f"limit {limits.max_concurrent_streams} reached; wait for a call to end",
                              retry_after_s=STREAM_RETRY_S)
        if self.streams_per_key is not None and usage.streams >= self.streams_per_key:
            raise self.refuse(record, "key_share",
                              f"{self.key_share:g} of max_concurrent_sessions {self.max_concurrent_sessions} "
                              f"allows {self.streams_per_key} calls per key and {usage.streams} are open; "
                              "wait for one to end", retry_after_s=STREAM_RETRY_S)
        usage.streams += 1
        return KeyStream(self, record, usage)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The gRPC adapter of a `KeyGate`: every call of `service` (health and reflection stay open)
    is authenticated; Generate and Score each hold one of the key's slots while they run, and the
    handler runs as the key's tenant (`current_tenant`), whose quota the service reserves tokens on
    at admission. Refusals become status codes, with a retry pushback where a retry can succeed."""

    SLOTTED = ("Generate", "Score")

    def __init__(self, gate: KeyGate, service: str) -> None:
        self.gate = gate
        self._prefix = f"/{service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        try:
            record = await self.gate.authenticate(api_key_from_headers(_metadata(handler_call_details)))
        except Refusal as refusal:
            return _refusing(handler, refusal.grpc_code, refusal.message, refusal.retry_after_s)
        name = method[len(self._prefix):]
        self.gate.count_request(record, name)
        slotted = name in self.SLOTTED
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, record, slotted))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, record, slotted))
        return handler

    def _unary(self, behaviour, record: ApiKey, slotted: bool):
        async def unary(request, context):
            try:
                ticket = self.gate.open_stream(record) if slotted else None
            except Refusal as refusal:
                await abort_with_retry(context, refusal.grpc_code, refusal.message, refusal.retry_after_s)
            try:
                with self.gate.calling_as(record):
                    return await behaviour(request, context)
            finally:
                if ticket is not None:
                    ticket.close()

        return unary

    def _stream(self, behaviour, record: ApiKey, slotted: bool):
        async def stream(request, context):
            try:
                ticket = self.gate.open_stream(record) if slotted else None
            except Refusal as refusal:
                await abort_with_retry(context, refusal.grpc_code, refusal.message, refusal.retry_after_s)
            try:
                with self.gate.calling_as(record):
                    async with contextlib.aclosing(behaviour(request, context)) as responses:  # closing cancels
                        async for response in responses:
                            yield response
            finally:
                if ticket is not None:
                    ticket.close()

        return stream


def fusion_interceptors(gate: KeyGate | None, service: str) -> list[grpc.aio.ServerInterceptor]:
    """The Fusion service's interceptors: its key gate's adapter (none without API keys). The HTTP API
    of the same coordinator holds the same gate, so a key's limits count both."""
    return [] if gate is None else [ApiKeyInterceptor(gate, service)]


# -- malformed requests --------------------------------------------------------------------------
class _Undecodable:
    """What a request that does not parse as its message type becomes (instead of gRPC's UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as err:  # DecodeError, bad UTF-8, wrong wire types
            return _Undecodable(err)

    return deserialize


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request get INVALID_ARGUMENT naming the message type
    (gRPC itself answers UNKNOWN and logs a traceback). Install innermost: authentication first."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        method = handler_call_details.method

        def message(request: _Undecodable) -> str:
            first = (str(request.error).splitlines() or [type(request.error).__name__])[0]
            return f"{method}: the request is not a valid message: {first[:200]}"

        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                return await behaviour(request, context)

            return handler._replace(unary_unary=unary, request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_stream is not None:
            behaviour = handler.unary_stream

            async def stream(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                async with contextlib.aclosing(behaviour(request, context)) as responses:  # closed with us
                    async for response in responses:
                        yield response

            return handler._replace(unary_stream=stream, request_deserializer=_lenient(handler.request_deserializer))
        return handler
