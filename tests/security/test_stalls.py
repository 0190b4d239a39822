"""A stall is not an outage: SIGSTOP the supervisor (which serves the embedded registry)
or an idle role past the TTL, SIGCONT it, and `/health` is 200 again within 2 TTLs.

Before the fix a keepalive for a reaped lease answered ok and an idle worker re-put its
record only when its counters changed, so every role stayed missing for good.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx2
import pytest

import omniflow
from omniflow.runtime.deployment import list_deployment_actors
from tests.helpers import cli

pytestmark = pytest.mark.slow
TTL = 2.0  # long enough for a loaded 2-core CI machine; both stops still outlast it
CONFIG = f"""
name = "stall"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
[roles.reverse]
actor = "omniflow.roles.echo:Reverse"
[graph]
edges = [{{ from = "input", to = "upper" }}, {{ from = "upper", to = "reverse", stream = true }}]
[runtime]
heartbeat_s = 0.2
ttl_s = {TTL}
restart_backoff_s = 0.5
[gateway]
max_inflight = 4
"""


@pytest.fixture
def deployment(run_root: Path):
    (run_root / "stall.toml").write_text(CONFIG)
    cli("up", str(run_root / "stall.toml"), "--detach", "--port", "0")
    state = omniflow.runtime.find_deployment("stall")
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    try:
        yield url, state
    finally:
        cli("down", "--name", "stall", check=False)


def _status(url: str) -> int:
    try:
        return httpx2.get(f"{url}/health", timeout=1.0).status_code
    except httpx2.HTTPError:
        return 0


def _stall(pid: int, seconds: float) -> float:
    """Stop ``pid`` for ``seconds``; returns the monotonic time of the SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return time.monotonic()


def _healthy_within(url: str, since: float, limit: float) -> float:
    while _status(url) != 200:
        if time.monotonic() - since > limit:
            body = httpx2.get(f"{url}/health", timeout=1.0).text
            pytest.fail(f"/health not 200 {limit:g}s after SIGCONT: {body}")
        time.sleep(0.05)
    return time.monotonic() - since


def test_health_comes_back_after_the_supervisor_and_a_role_were_stopped(deployment):
    url, state = deployment
    assert _status(url) == 200
    resumed = _stall(state["pid"], 5.0)
    print("supervisor: healthy", _healthy_within(url, resumed, 2 * TTL), "s after SIGCONT")
    time.sleep(2 * TTL)  # and stays so: the re-put records are refreshed
    assert _status(url) == 200

    records = asyncio.run(list_deployment_actors(state))
    (upper,) = [r for r in records if r.role == "upper"]
    os.kill(upper.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        deadline = time.monotonic() + 5 * TTL
        while _status(url) == 200:  # the stopped role drops out within its TTL
            assert time.monotonic() < deadline, "a stopped role stayed in /health"
            time.sleep(0.05)
        time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped)))  # the 10 s of issue #40
    finally:
        os.kill(upper.pid, signal.SIGCONT)
    resumed = time.monotonic()
    print("role: healthy", _healthy_within(url, resumed, 2 * TTL), "s after SIGCONT")
    # The same process answers: nobody restarted it, it put itself back.
    records = asyncio.run(list_deployment_actors(state))
    assert [r.pid for r in records if r.role == "upper"] == [upper.pid]
