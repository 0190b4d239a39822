"""hypothesis against everything a stranger can send: each input ends in a clear error or
is served, the actor keeps serving, nothing leaks from the pool.

CI-sized (the ``ci`` profile, conftest.py); ``OMNIFLOW_FUZZ=long`` for a deep run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from hypothesis import example, given

from tests.security.fuzzing import (
    MediaChecker,
    Tally,
    WireChecker,
    check_config,
    check_http,
    config_inputs,
    http_inputs,
    media_inputs,
    wire_inputs,
)
from tests.security.live import LiveDeployment, Probe


@pytest.fixture(scope="module")
def wire(live):
    probe = Probe(live.replica.endpoint, str(live.rt.supervisor.run_dir))
    before = live.pool.stats().used_pages
    yield WireChecker(live, probe, Tally()), before
    probe.close()


@given(wire_inputs())
def test_wire_inputs_end_in_clear_errors(wire, item) -> None:
    checker, _ = wire
    checker.check(item)
    assert checker.tally.unclear == []
    assert checker.live.alive()


def test_after_the_wire_fuzz_the_actor_serves_and_the_pool_is_whole(wire) -> None:
    checker, before = wire
    assert checker.probe.served()
    deadline = time.monotonic() + 10  # streams cancelled by the fuzz wind down
    while checker.live.pool.stats().used_pages != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checker.live.pool.stats().used_pages == before
    assert checker.live.replica.restarts == 0


GATEWAY_KEY = "sk-fuzz"
# On a loaded machine a 1 s ttl can drop a busy replica from the registry (a 503).
_LENIENT = {"heartbeat_s": 0.5, "ttl_s": 10.0}


@pytest.fixture(scope="module")
def gateway(run_root_module):
    from tests.helpers import echo_config

    config = echo_config("fz", runtime=_LENIENT)
    from omniflow.runtime.config import GatewayConfig

    config.gateway = GatewayConfig(port=0, api_key=GATEWAY_KEY, max_body_mb=0.25)
    dep = LiveDeployment(config, role="upper")
    url_file = Path(dep.rt.supervisor.run_dir) / "gateway.url"
    deadline = time.monotonic() + 30
    while not url_file.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client = httpx.Client()
    yield dep, url_file.read_text().strip(), client
    client.close()
    dep.close()


@given(http_inputs())
@example(("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000, {}))  # was a 500
def test_http_inputs_end_in_clear_errors(gateway, item) -> None:
    dep, url, client = gateway
    tally = Tally()
    check_http(client, url, item, tally, GATEWAY_KEY)
    assert tally.unclear == []


def test_after_the_http_fuzz_the_gateway_serves(gateway) -> None:
    _, url, client = gateway
    body = {"model": "fz", "messages": [{"role": "user", "content": "hi there"}]}
    r = client.post(f"{url}/v1/chat/completions", json=body, headers=_auth(), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    typed = {**_auth(), "content-type": "application/json"}
    huge = client.post(f"{url}/v1/chat/completions", content=b"x" * (1 << 20), headers=typed)
    assert huge.status_code == 413 and huge.json()["error"]["message"]


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {GATEWAY_KEY}"}


@given(config_inputs())
def test_config_inputs_end_in_config_errors(tmp_path_factory, item) -> None:
    tally = Tally()
    check_config(tmp_path_factory.getbasetemp() / f"fuzz-{os.getpid()}.toml", item, tally)
    assert tally.unclear == []


_media = MediaChecker()
_RUNTIME_ERROR_WAV = (
    b"RIFF\xa4\x00\x00\x00WAVEfmt \x10Q\x00\x00\x01\x00\x01\x00\x80>\x00\x00\x00}\x00\x00"
    b"\x02\x00\x10\x00data\x80\x00\x00\x00" + b"\x01\x02" * 8
)


@given(media_inputs())
@example(("wav", _RUNTIME_ERROR_WAV))  # a fmt chunk whose size lies: was a RuntimeError
def test_media_bytes_end_in_bad_requests(item) -> None:
    tally = Tally()
    _media.check(item, tally)
    assert tally.unclear == []
