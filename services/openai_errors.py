"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every route of the
HTTP API. A domain error's message names the field it refuses first (`temperature: ...`); `client_field`
turns that into `param` under the name the client sent (`top_logprobs` for the sampler's `logprobs`,
`fusion.weights`, ...), so a client sees its own field named, never the service's."""

from __future__ import annotations

import re
from typing import Any, Mapping

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable_error"}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; `param` names the request field it refuses."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # a 429's Retry-After

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def client_field(message: str, renames: Mapping[str, str]) -> tuple[str | None, str]:
    """(the field a domain error's message names first, the message), both with the field as the
    client called it (`top_logprobs: ...` for the sampler's `logprobs: ...`)."""
    match = _FIELD.match(message)
    if match is None:
        return None, message
    param = match.group(1)
    base = re.match(r"[A-Za-z_]\w*", param).group(0)
    if base in renames:
        param = renames[base] + param[len(base):]
    return param, f"{param}: {message[match.end():]}"
