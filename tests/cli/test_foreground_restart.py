"""A foreground `omniflow up` reports a restart on the terminal once the bar is gone."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omniflow.runtime.deployment import (
    DeploymentNotFound,
    find_deployment,
    list_deployment_actors,
)
from tests.cli.conftest import ECHO_TOML


def _reverse_1(run_dir: Path) -> tuple[int, str]:
    try:
        records = asyncio.run(list_deployment_actors(find_deployment(run_dir=run_dir)))
    except DeploymentNotFound:
        return 0, ""
    return next(
        ((r.pid, r.state) for r in records if r.role == "reverse" and r.replica == 1), (0, "")
    )


def test_foreground_up_prints_a_restart():
    run_dir = Path(tempfile.mkdtemp(prefix="of-fg-", dir="/tmp")) / "echo"
    up = subprocess.Popen(
        [sys.executable, "-m", "omniflow.cli", "up", ECHO_TOML, "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until = time.monotonic() + 120
        while not (victim := _reverse_1(run_dir)[0]):
            assert time.monotonic() < until and up.poll() is None
            time.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        while _reverse_1(run_dir)[0] in (victim, 0) or _reverse_1(run_dir)[1] != "ready":
            assert time.monotonic() < until
            time.sleep(0.2)
    finally:
        up.send_signal(signal.SIGTERM)
        _, errors = up.communicate(timeout=60)
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    assert up.returncode == 0, errors
    after_ready = errors.split("stop with Ctrl-C")[-1]
    assert "reverse/1 ready" in after_ready, errors
    assert "Traceback" not in errors
