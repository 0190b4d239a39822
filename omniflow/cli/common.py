"""What every omniflow command shares: the app, plain-text consoles, exit codes, lookups."""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from omniflow.runtime.config import ConfigError, load
from omniflow.runtime.deployment import DeploymentNotFound, SeveralDeployments, find_deployment

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown")
# Messages are plain text: no markup (errors quote "[bad_request]", "[h, w]", "[roles.x]"),
# no highlighting, and no wrapping (a piped line stays one line for grep).
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
# Piped, a table is as wide as its cells (no column cropped to fit 80).
out = Console(
    markup=False, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 10_000
)

EXIT_START, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_REQUEST = 1, 2, 3, 4

NameOpt = typer.Option(
    None, "--name", "-n", help="Deployment name (default: the only one running)."
)
RunDirOpt = typer.Option(None, "--run-dir", help="The deployment's run directory.")
LogFormatOpt = typer.Option(
    "text", "--log-format", help="Log lines of every process: text, or json (one object each)."
)


def use_log_format(fmt: str) -> None:
    """Check ``--log-format`` and hand it to the supervisor and workers (the environment)."""
    import os

    from omniflow.runtime.logs import FORMAT_ENV, FORMATS

    if fmt not in FORMATS:
        fail(f"--log-format: one of {', '.join(FORMATS)}, not {fmt!r}", EXIT_USAGE)
    os.environ[FORMAT_ENV] = fmt


RegistryOpt = typer.Option(
    None,
    "--registry",
    envvar="OMNIFLOW_REGISTRY_URL",
    help="etcd://HOST:PORT of a multi-host deployment (with --name): no local run dir needed.",
)
HostIdOpt = typer.Option(
    None,
    "--host-id",
    envvar="OMNIFLOW_HOST_ID",
    help="This host's id in a multi-host deployment (default: the hostname).",
)


def load_config(config: Path) -> Any:
    try:
        return load(config)
    except ConfigError as e:
        fail(f"config error: {e}", EXIT_USAGE)


def fail(message: str, code: int) -> typing.NoReturn:
    err.print(message, style="red")
    raise typer.Exit(code)


def find_running(
    name: str | None, run_dir: Path | None, host_id: str | None = None, any_host: bool = False
) -> dict[str, Any]:
    try:
        return find_deployment(name, run_dir, host_id, any_host)
    except SeveralDeployments as e:
        fail(str(e), EXIT_USAGE)
    except DeploymentNotFound as e:
        fail(str(e), EXIT_NOT_RUNNING)
