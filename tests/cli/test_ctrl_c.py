"""Ctrl-C on a foreground `omniflow up` drains like `omniflow down`: the terminal's SIGINT
goes to its whole process group, and the workers (in their own groups) are left to the
supervisor, which lets the request in flight finish."""

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

import omniflow
from tests.helpers import expected_echo

CONFIG = """
name = "ctrlc"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
[roles.reverse]
actor = "omniflow.roles.echo:Reverse"
[graph]
edges = [{ from = "input", to = "upper" }, { from = "upper", to = "reverse", stream = true }]
[runtime]
drain_timeout_s = 20.0
"""


def test_sigint_to_a_foreground_up_lets_the_request_in_flight_finish():
    root = Path(tempfile.mkdtemp(prefix="of-cc-", dir="/tmp"))
    (root / "ctrlc.toml").write_text(CONFIG)
    run_dir = root / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "omniflow.cli", "up", str(root / "ctrlc.toml")]
        + ["--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # as a shell runs it: a foreground process group of its own
    )
    try:
        until = time.monotonic() + 120
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("ready ctrlc"):
                break
            assert time.monotonic() < until and up.poll() is None, line

        async def main():
            async with await omniflow.connect(run_dir=run_dir) as conn:
                call = asyncio.create_task(
                    conn.call({"text": "in flight"}, params={"delay_ms": 1500}, timeout=30)
                )
                await asyncio.sleep(0.5)  # in upper
                os.killpg(up.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
                outs, _ = await call
                return [o.data["text"] for o in outs]

        assert asyncio.run(main()) == expected_echo("in flight")
        assert up.wait(timeout=30) == 0
        assert not list(run_dir.glob("*.sock"))
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
