"""A detached deployment shared by the CLI tests of one module."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers import cli

ECHO_TOML = str(Path(__file__).resolve().parents[2] / "configs" / "echo.toml")


@pytest.fixture(scope="module")
def detached():
    """One `omniflow up -d` of configs/echo.toml for this module; its run dir."""
    root = Path(tempfile.mkdtemp(prefix="of-cli-", dir="/tmp"))
    run_dir = root / "echo"
    cli("up", ECHO_TOML, "-d", "--run-dir", str(run_dir))
    try:
        yield run_dir
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        shutil.rmtree(root, ignore_errors=True)
