"""`omniflow down` lets a request in flight finish through the whole graph first."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from omniflow.runtime.deployment import find_deployment, list_deployment_actors
from omniflow.runtime.holding import read_holding
from tests.helpers import cli, expected_echo


def test_down_finishes_the_request_in_flight(detached):
    sending = subprocess.Popen(
        [sys.executable, "-m", "omniflow.cli", "send", "--run-dir", str(detached)]
        + ["-t", "in flight", "-p", "delay_ms=1500", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    upper = asyncio.run(list_deployment_actors(find_deployment(run_dir=detached)))
    pid = next(r.pid for r in upper if r.role == "upper")
    until = time.monotonic() + 30
    while not read_holding(detached / "upper-0.holding", pid):  # in `upper` for 1.5 s
        assert time.monotonic() < until and sending.poll() is None
        time.sleep(0.02)
    down = cli("down", "--run-dir", str(detached), "--timeout", "20")
    out, errors = sending.communicate(timeout=60)
    assert sending.returncode == 0, errors
    assert json.loads(out)["text"] == "".join(expected_echo("in flight"))
    assert "stopped" in down.stdout
    assert not list(detached.glob("*.sock"))
