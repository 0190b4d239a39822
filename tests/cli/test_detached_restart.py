"""A detached deployment (`omniflow up -d`) restarts a worker killed with -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from omniflow.runtime.deployment import find_deployment, list_deployment_actors
from tests.helpers import cli, expected_echo


def _actors(run_dir: Path) -> dict[str, tuple[int, str]]:
    records = asyncio.run(list_deployment_actors(find_deployment(run_dir=run_dir)))
    return {f"{r.role}/{r.replica}": (r.pid, r.state) for r in records}


def _recorded(run_dir, role, replica):
    for actor in json.loads((run_dir / "state.json").read_text())["actors"]:
        if (actor["role"], actor["replica"]) == (role, replica):
            return actor["pid"], actor["state"], actor["restarts"]
    return None


def test_detached_deployment_restarts_a_killed_worker(detached):
    victim, _ = _actors(detached)["reverse/1"]
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    until = time.monotonic() + 60
    while True:
        pid, state = _actors(detached).get("reverse/1", (victim, ""))
        if pid != victim and state == "ready":
            break
        assert time.monotonic() < until, "reverse/1 was not restarted"
        time.sleep(0.2)
    # The supervisor saw the restart through: its Ready was taken, its state file rewritten.
    until = time.monotonic() + 10
    while _recorded(detached, "reverse", 1) != (pid, "ready", 1):
        assert time.monotonic() < until, _recorded(detached, "reverse", 1)
        time.sleep(0.2)
    assert json.loads((detached / "state.json").read_text())["started"] > killed
    log = (detached / "supervisor.log").read_text()
    assert "Traceback" not in log, log
    assert "reverse/1 ready" in log
    for _ in range(4):  # round robin: both replicas answer
        sent = cli("send", "--run-dir", str(detached), "-t", "ab cd", "--json")
        assert json.loads(sent.stdout)["text"] == "".join(expected_echo("ab cd"))
