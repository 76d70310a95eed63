"""`fusion keys ...`: create and revoke the Fusion service's API keys (only their hashes are stored)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

keys_app = typer.Typer(no_args_is_help=True, help="Create and revoke API keys of the Fusion service.")

FileOption = typer.Option(..., "--file", "-f", help="The API keys file (security.api_keys_file).")


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
) -> None:
    """Create a key: prints it once (store it now); the file keeps only its hash."""
    from fusion.errors import FusionError
    from services.security import create_key

    limits = {"max_concurrent_streams": max_concurrent_streams, "tokens_per_minute": tokens_per_minute,
              "max_tokens_per_request": max_tokens_per_request}
    try:
        key = create_key(file, key_id, limits=limits)
    except FusionError as err:
        _fail(str(err))
    typer.echo(key)
    typer.secho(f"key {key_id!r} added to {file}; it is shown only now", err=True)


@keys_app.command("revoke")
def revoke(file: Path = FileOption, key_id: str = typer.Option(..., "--id")) -> None:
    """Revoke a key (servers reading the file refuse it from their next request)."""
    from fusion.errors import FusionError
    from services.security import revoke_key

    try:
        revoke_key(file, key_id)
    except FusionError as err:
        _fail(str(err))
    typer.secho(f"key {key_id!r} revoked in {file}", err=True)
