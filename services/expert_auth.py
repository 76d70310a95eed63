"""The Expert service's caller check: `ExpertSecretInterceptor` accepts only callers sending the shared
secret in `x-fusion-expert-secret` (compared in constant time); with `tls.require_client_auth` the TLS
handshake itself refuses callers without a client certificate signed by the CA.
`check_expert_exposure`: an Expert server beyond loopback needs the secret or client certificates,
unless told `insecure`."""

from __future__ import annotations

import hmac
import logging

import grpc

from fusion.config import SecurityConfig
from fusion.errors import ConfigError
from fusion.services.config_secrets import configured_secret
from fusion.services.status import call_metadata, refusing
from fusion.services.tls import is_loopback

logger = logging.getLogger(__name__)

EXPERT_SECRET_HEADER = "x-fusion-expert-secret"


def expert_secret(security: SecurityConfig) -> str | None:
    """The shared coordinator↔expert secret the config names (None: none configured)."""
    return configured_secret(security, "expert_secret")


def expert_channel_metadata(security: SecurityConfig | None) -> list[tuple[str, str]]:
    secret = expert_secret(security) if security is not None else None
    return [(EXPERT_SECRET_HEADER, secret)] if secret else []


class ExpertSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every Expert-service call without the shared secret (health and reflection stay open)."""

    def __init__(self, secret: str, service: str) -> None:
        self._secret = secret.encode("utf-8")
        self._prefix = f"/{service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        given = call_metadata(handler_call_details).get(EXPERT_SECRET_HEADER, "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._secret):
            return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
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
