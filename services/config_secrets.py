"""Secrets the config names by environment variable or file (`security.<field>_env` / `_file`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path


from fusion.config import SecurityConfig
from fusion.errors import ConfigError

logger = logging.getLogger(__name__)


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
