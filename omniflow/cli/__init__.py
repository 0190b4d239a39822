"""The ``omniflow`` command line (typer)."""

from omniflow.cli import keys as _keys  # noqa: F401  (registers `omniflow keys`)
from omniflow.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()
