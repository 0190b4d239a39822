"""``omniflow keys DIR``: a deployment's CurveZMQ key pairs, for ``[security] keys = "DIR"``."""

from __future__ import annotations

from pathlib import Path

import typer

from omniflow.cli.common import EXIT_USAGE, fail
from omniflow.runtime.config import KeysError, generate_keys


def keys(
    folder: Path = typer.Argument(..., help="Where to write them (created owner-only)."),
    force: bool = typer.Option(False, "--force", help="Replace keys already there."),
) -> None:
    """Generate a deployment's CurveZMQ server and client key pairs."""
    try:
        made = generate_keys(folder, force=force)
    except (KeysError, OSError) as e:
        fail(f"error: {e}", EXIT_USAGE)
    typer.echo(f"wrote server and client key pairs to {made.folder} (secrets 0600)")
    typer.echo(f'use them with:  [security] keys = "{made.folder.resolve()}"')
    typer.echo(f"admit another client: copy its public *.key into {made.authorized}/")
