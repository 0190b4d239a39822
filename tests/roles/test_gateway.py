"""The HTTP gateway over real HTTP on loopback, in front of the echo pipeline started by
`omniflow up`: the official openai client, raw requests for each error status, /metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import omniflow
from omniflow.runtime.deployment import list_deployment_actors
from tests.helpers import cli, expected_echo

pytestmark = pytest.mark.slow
KEY = "sk-test-key"
CHROMIUM = "/usr/bin/chromium"
CONFIG = f"""
name = "gw"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
[roles.reverse]
actor = "omniflow.roles.echo:Reverse"
[graph]
edges = [{{ from = "input", to = "upper" }}, {{ from = "upper", to = "reverse", stream = true }}]
[runtime]
heartbeat_s = 0.2
ttl_s = 1.0
restart_backoff_s = 4.0
[gateway]
api_key = "{KEY}"
max_body_mb = 0.05
max_inflight = 4
"""


@pytest.fixture(scope="module")
def gateway():
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    (root / "gw.toml").write_text(CONFIG)
    cli("up", str(root / "gw.toml"), "--detach", "--port", "0")
    state = omniflow.runtime.find_deployment("gw")
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    yield url, state
    cli("down", "--name", "gw", check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def chat_body(text: str = "hello big world", **extra) -> dict:
    return {"model": "gw", "messages": [{"role": "user", "content": text}], **extra}


def test_streamed_chat_through_the_openai_client(gateway):
    url, _ = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    stream = client.chat.completions.create(
        model="gw",
        messages=[{"role": "user", "content": "hello big world"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert deltas == expected_echo("hello big world")  # one event per output, as they came
    assert chunks[-2].choices[0].finish_reason == "stop"
    # include_usage: OpenAI's last chunk, with no choices and the usage
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_plain_chat_models_and_health(gateway):
    url, _ = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    reply = client.chat.completions.create(
        model="gw", messages=[{"role": "user", "content": "one two"}], user="alice"
    )
    assert reply.choices[0].message.content == "".join(expected_echo("one two"))
    assert reply.usage.total_tokens == 0  # echo counts no tokens
    assert [m.id for m in client.models.list()] == ["gw"]
    health = httpx2.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["missing"] == []


def _error(response: httpx2.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", "body"),
        (b'{"model": "gw", "messages": "hi"}', "messages"),
        (b'{"model": "gw", "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
        (b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', "model"),
        (
            b'{"model": "gw", "messages": [{"role": "user", "content": [{"type": "video"}]}]}',
            "messages[0].content[0].type",
        ),
        (b'{"model": "gw", "messages": [{"role": "user", "content": "x"}], "stream": 1}', "stream"),
        (
            b'{"model": "gw", "messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}',
            "modalities",
        ),
        (
            b'{"model": "gw", "messages": [{"role": "user", "content": "x"}], '
            b'"params": {"delay_m": 1}}',
            "params.delay_m",
        ),
        (
            b'{"model": "gw", "messages": [{"role": "user", "content": "x"}], '
            b'"params": {"delay_ms": "slow"}}',
            "params.delay_ms",
        ),
    ],
)
def test_400_names_the_field(gateway, body, param):
    url, _ = gateway
    headers = {**auth(), "Content-Type": "application/json"}
    response = httpx2.post(f"{url}/v1/chat/completions", content=body, headers=headers)
    assert _error(response, 400)["param"] == param


def test_local_paths_are_refused_unless_allowed(gateway):
    url, _ = gateway
    part = {"type": "image_url", "image_url": {"url": "/etc/hostname"}}
    body = {"model": "gw", "messages": [{"role": "user", "content": [part]}]}
    response = httpx2.post(f"{url}/v1/chat/completions", json=body, headers=auth())
    assert _error(response, 400)["param"] == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_401_without_the_key(gateway, headers):
    url, _ = gateway
    response = httpx2.post(f"{url}/v1/chat/completions", json=chat_body(), headers=headers)
    assert _error(response, 401)["type"] == "authentication_error"
    assert httpx2.get(f"{url}/health").status_code == 200  # health needs no key


def test_413_too_large(gateway):
    url, _ = gateway
    body = chat_body("x" * 100_000)
    response = httpx2.post(f"{url}/v1/chat/completions", json=body, headers=auth())
    assert _error(response, 413)["code"] == "request_too_large"


def test_504_past_the_deadline(gateway):
    url, _ = gateway
    body = chat_body(timeout=0.2, params={"delay_ms": 5000})
    started = time.monotonic()
    response = httpx2.post(f"{url}/v1/chat/completions", json=body, headers=auth())
    assert _error(response, 504)["code"] == "deadline"
    assert time.monotonic() - started < 4.0  # at the deadline, not after the 5 s reply


def test_429_past_max_inflight(gateway):
    url, _ = gateway
    body = chat_body(params={"delay_ms": 600})

    def post(_):
        return httpx2.post(f"{url}/v1/chat/completions", json=body, headers=auth(), timeout=10)

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        statuses = sorted(r.status_code for r in pool.map(post, range(10)))
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1
    assert set(statuses) <= {200, 429}


def _inflight(state) -> int:
    records = asyncio.run(list_deployment_actors(state))
    return sum(r.inflight for r in records if r.role == "upper")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_the_request(gateway, stream):
    url, state = gateway
    body = json.dumps(chat_body("slow words", stream=stream, params={"delay_ms": 3000})).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(head.encode() + body)
        deadline = time.monotonic() + 2
        while _inflight(state) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _inflight(state) == 1
    # closed long before upper's 3 s delay ends: only a Cancel frees it this soon
    deadline = time.monotonic() + 1.5
    while _inflight(state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _inflight(state) == 0


def _samples(url: str) -> dict:
    text = httpx2.get(f"{url}/metrics", headers=auth()).text  # with api_key set, it needs it
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_parse_and_move_with_traffic(gateway):
    url, _ = gateway
    ok = ("omniflow_gateway_requests_total", (("code", "200"), ("route", "/v1/chat/completions")))
    bad = ("omniflow_gateway_failures_total", (("code", "400"), ("route", "/v1/chat/completions")))
    latency = ("omniflow_gateway_latency_seconds_count", (("route", "chat"),))
    before = _samples(url)
    httpx2.post(f"{url}/v1/chat/completions", json=chat_body(), headers=auth())
    httpx2.post(f"{url}/v1/chat/completions", json=chat_body(model="nope"), headers=auth())
    after = _samples(url)
    assert after[ok] == before.get(ok, 0) + 1
    assert after[bad] == before.get(bad, 0) + 1
    assert after[latency] == before.get(latency, 0) + 1
    assert after[("omniflow_gateway_inflight", ())] == 0
    assert ("omniflow_gateway_time_to_first_token_seconds_count", (("route", "chat"),)) in after
    assert ("omniflow_gateway_cached_tokens_total", ()) in after


def test_the_playground_is_one_page_with_nothing_from_elsewhere(gateway):
    url, _ = gateway
    page = httpx2.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'const model = "gw";' in page.text
    assert "src=" not in page.text and "https://" not in page.text


def _browser_missing(what: str) -> None:
    """Skip without the browser, but fail under CI, which installs it (.ci/run)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {what}: OMNIFLOW_EXTRAS=...,browser bash scripts/setup.sh")
    pytest.skip(what)


@pytest.mark.browser
def test_the_playground_chats_in_headless_chromium(gateway):
    if not Path(CHROMIUM).exists():
        _browser_missing(f"no {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright import sync_api
    except ImportError:
        _browser_missing("no playwright (the browser extra: pip install -e .[browser])")
    url, _ = gateway
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            requested: list[str] = []
            page.on("request", lambda r: requested.append(r.url))
            page.goto(f"{url}/")
            page.fill("#key", KEY)
            page.fill("#message", "hello big world")
            page.click("#send")
            page.wait_for_function("document.getElementById('usage').textContent.length > 0")
            assert page.text_content("#output") == "".join(expected_echo("hello big world"))
            assert page.text_content("#error") == ""
            page.uncheck("#stream")
            page.fill("#message", "one two")
            page.click("#send")
            page.wait_for_function("document.getElementById('usage').textContent.length > 0")
            assert page.text_content("#output") == "".join(expected_echo("one two"))
        finally:
            browser.close()
    assert requested and all(u.startswith(url) for u in requested)  # no CDN


def test_503_while_a_role_has_no_replica(gateway):
    url, state = gateway
    records = asyncio.run(list_deployment_actors(state))
    (upper,) = [r for r in records if r.role == "upper"]
    os.kill(upper.pid, signal.SIGKILL)  # restarted after restart_backoff_s = 4
    deadline = time.monotonic() + 3
    while httpx2.get(f"{url}/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx2.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["missing"] == ["upper"]
    response = httpx2.post(f"{url}/v1/chat/completions", json=chat_body(), headers=auth())
    assert _error(response, 503)["type"] == "service_unavailable"
    deadline = time.monotonic() + 30
    while httpx2.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx2.get(f"{url}/health").status_code == 200


def test_a_port_in_use_fails_up_with_a_message_naming_it(tmp_path, run_root):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "busy.toml"
        config.write_text(CONFIG.replace('name = "gw"', 'name = "busy"'))
        proc = cli("up", str(config), "--detach", "--port", str(port), check=False)
    assert proc.returncode == 1
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"gateway cannot listen on 127.0.0.1:{port}: Address already in use" in said
    assert not list(run_root.rglob("*.sock"))
