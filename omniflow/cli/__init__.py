"""The ``omniflow`` command line (typer)."""

from omniflow.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()
