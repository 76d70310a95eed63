"""Domain errors. Each maps to one gRPC status code and one CLI exit message at the edges."""


class FusionError(Exception):
    """Base class: a clear, user-facing message; never a bare traceback at the edges."""


class ConfigError(FusionError, ValueError):
    """A configuration file or value is invalid (names the field and the bad value)."""


class InvalidArgumentError(FusionError, ValueError):
    """A request field is invalid (names the field and the bad value)."""


class NotFoundError(FusionError, KeyError):
    """An expert, profile, rule or session that does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it plain
        return str(self.args[0]) if self.args else ""


class ResourceExhaustedError(FusionError):
    """A configured limit (prompt length, max_tokens, concurrent sessions) was exceeded."""


class ServiceBusyError(ResourceExhaustedError):
    """The service has no free slot (max_concurrent_sessions), a key's window or share is used up for
    now, or the service is shutting down: the same request may succeed later, after `retry_after_s`
    when known (HTTP answers 429 with Retry-After here, and 400 for a request past a size limit)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ExpertUnavailableError(FusionError):
    """No replica of an expert could answer."""


class SessionReleasedError(FusionError):
    """A step or score named a session its caller had already released (the request is over)."""


class SessionHistoryUnknownError(FusionError):
    """A step sent a session's new ids only, after a history this replica does not hold (it restarted,
    the session moved here, or its record was dropped): the caller sends the whole history again."""


class AssetError(FusionError):
    """A model asset could not be fetched, verified, converted or found."""


class ExpertOutputError(FusionError):
    """An expert returned unusable output (NaN or +inf logits, or no finite logit at all)."""
