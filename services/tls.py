"""TLS for both gRPC services and their clients (the config's `security.tls`): `server_credentials` /
`channel_credentials` build gRPC credentials from the PEM files the config names; `open_channel` opens a
plaintext or TLS channel (sync or `grpc.aio`) and attaches metadata (an API key, the expert secret) to
every call. Plaintext beyond loopback logs a warning."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Any, Sequence

import grpc

from fusion.config import SecurityConfig
from fusion.errors import ConfigError

logger = logging.getLogger(__name__)


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
