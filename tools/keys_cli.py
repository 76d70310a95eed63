"""`fusion keys ...`: create, reissue and revoke the Fusion service's API keys (only their keyed hashes
are stored; see fusion.services.api_keys). Keys stored as legacy PBKDF2 hashes cannot be rehashed without
the key itself: `fusion keys create --id ID --reissue` gives the id a new key in the current format."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

keys_app = typer.Typer(no_args_is_help=True, help="Create and revoke API keys of the Fusion service.")

FileOption = typer.Option(..., "--file", "-f", help="The API keys file (security.api_keys_file).")
PepperEnvOption = typer.Option(None, "--pepper-env", help="The variable holding the hash pepper "
                               "(security.api_keys_pepper_env); default: the built-in pepper.")
PepperFileOption = typer.Option(None, "--pepper-file", help="The file holding the hash pepper "
                                "(security.api_keys_pepper_file).")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@keys_app.command("create")
def create(
    file: Path = FileOption,
    key_id: str = typer.Option(..., "--id", help="The key's id (shown in metrics and logs), e.g. team-a."),
    max_concurrent_streams: Optional[int] = typer.Option(None, "--max-concurrent-streams", min=1),
    tokens_per_minute: Optional[int] = typer.Option(None, "--tokens-per-minute", min=1),
    max_tokens_per_request: Optional[int] = typer.Option(None, "--max-tokens-per-request", min=1),
    weight: Optional[float] = typer.Option(None, "--weight", min=0.001, help="The key's share of every queue "
                                           "against other waiting keys (default 1)."),
    reissue: bool = typer.Option(False, "--reissue", help="Give an existing id a new key (the old one stops "
                                 "working; its limits stay unless given)."),
    pepper_env: Optional[str] = PepperEnvOption,
    pepper_file: Optional[str] = PepperFileOption,
) -> None:
    """Create a key: prints it once (store it now); the file keeps only its keyed hash."""
    from pydantic import ValidationError

    from fusion.config import SecurityConfig, format_validation_error
    from fusion.errors import FusionError
    from fusion.services.api_keys import create_key, key_pepper

    limits = {"max_concurrent_streams": max_concurrent_streams, "tokens_per_minute": tokens_per_minute,
              "max_tokens_per_request": max_tokens_per_request, "weight": weight}
    try:
        pepper = key_pepper(SecurityConfig(api_keys_pepper_env=pepper_env, api_keys_pepper_file=pepper_file))
        key = create_key(file, key_id, limits=limits, reissue=reissue, pepper=pepper)
    except ValidationError as err:
        _fail(format_validation_error(err))
    except FusionError as err:
        _fail(str(err))
    typer.echo(key)
    typer.secho(f"key {key_id!r} {'reissued in' if reissue else 'added to'} {file}; it is shown only now", err=True)


@keys_app.command("revoke")
def revoke(file: Path = FileOption, key_id: str = typer.Option(..., "--id")) -> None:
    """Revoke a key (servers reading the file refuse it from their next request)."""
    from fusion.errors import FusionError
    from fusion.services.api_keys import revoke_key

    try:
        revoke_key(file, key_id)
    except FusionError as err:
        _fail(str(err))
    typer.secho(f"key {key_id!r} revoked in {file}", err=True)
