"""API keys (Fusion service): `ApiKeyStore` reads `key id → {hash, revoked, limits}` from a YAML file
(re-read when it changes, so a revocation takes effect without a restart) or from the YAML text of an
environment variable. Keys look like `fsk_<id>_<secret>` (a 256-bit random secret); only a keyed hash
is stored, `hmac-sha256$HEX` under the server's pepper (`hash_key` says why a fast hash is right for
random secrets). Files written before keep working: `pbkdf2_sha256$...` and `sha256:HEX` entries still
verify. A PBKDF2 hash cannot be rehashed without the key itself, so there is no offline migration:
`fusion keys create --id ID --reissue` gives the id a new key in the current format (until then,
legacy entries verify through the bounded path in `fusion.services.key_gate`). Writes replace the file
atomically (temporary file, then os.replace)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from fusion.config import SecurityConfig
from fusion.errors import ConfigError
from fusion.services.config_secrets import configured_secret

logger = logging.getLogger(__name__)

KEY_PREFIX = "fsk_"
HMAC_SCHEME = "hmac-sha256"
# The pepper when the config names none. Public on purpose: key secrets are 256 bits of randomness,
# so their hashes cannot be brute-forced with or without a secret pepper (see `hash_key`).
DEFAULT_PEPPER = b"fusion-api-keys/hmac-sha256/v1"
LEGACY_PBKDF2_ITERATIONS = 200_000  # what `fusion keys create` wrote before the keyed hash
API_KEY_HEADER = "x-api-key"


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
