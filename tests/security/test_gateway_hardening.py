"""The gateway against hostile HTTP, over real sockets to a real deployment: absurd
numbers and sizes are 400s naming the field (never a 500, never seconds of work); a
foreign Host or Origin is a 403 and an untyped JSON post a 415 (CSRF, DNS rebinding);
/metrics takes the key."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import omniflow
from tests.helpers import cli
from tests.security.gateway_live import KEY, LiveGateway


@pytest.fixture(scope="module")
def gw(run_root_module: Path) -> Iterator[LiveGateway]:
    dep = LiveGateway(f"gh{os.getpid() % 10000}")
    try:
        yield dep
    finally:
        dep.close()


TYPED = {"Content-Type": "application/json"}


def json_bytes(body: dict) -> bytes:
    return json.dumps(body).encode()


def _param(body: dict) -> str | None:
    return body.get("error", {}).get("param")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_completion_tokens": 2**63}, "max_completion_tokens"),
        ({"seed": 2**64 - 1}, "seed"),
        ({"params": {"delay_ms": 2**64}}, "params.delay_ms"),
    ],
)
def test_integers_past_64_bits_are_400s_naming_the_field(gw, extra, field):
    status, body = gw.chat(**extra)
    assert (status, _param(body)) == (400, field), body


def test_an_image_request_with_absurd_numbers_is_a_400(gw):
    for body, field in (
        ({"prompt": "a cat", "n": 2, "seed": 2**64 - 1}, "seed"),
        ({"prompt": "a cat", "size": "1" * 5000 + "x32"}, "size"),
    ):
        status, answer, _ = gw.request("POST", "/v1/images/generations", body)
        assert (status, _param(answer)) == (400, field), answer


def test_a_huge_prompt_is_refused_at_once(gw):
    text = "word " * 1_200_000  # 6 MB: past max_prompt_chars' 1M default
    started = time.monotonic()
    status, body = gw.chat(text)
    took = time.monotonic() - started
    assert (status, _param(body)) == (400, "messages"), body
    assert "max_prompt_chars" in body["error"]["message"]
    assert took < 3.0, f"{took:.1f} s to refuse"
    status, body, _ = gw.request(
        "POST", "/v1/completions", {"model": gw.name, "prompt": "x" * 1_000_001}
    )
    assert (status, _param(body)) == (400, "prompt"), body
    assert gw.chat("still here")[0] == 200


def test_the_python_api_refuses_the_same_by_name(gw):
    rt = gw.rt

    async def refused(inputs, params):
        with pytest.raises(omniflow.InvalidRequest) as e:
            await rt.call(inputs, params=params, timeout=10)
        return e.value.field

    fut = gw.submit(refused({"text": "hi"}, {"delay_ms": 2**64}))
    assert fut.result(30) == "params.delay_ms"
    fut = gw.submit(refused({"text": "x" * 1_000_001}, {}))
    assert fut.result(30) == "inputs.text"


def test_omniflow_send_refuses_the_same_by_name(gw, tmp_path):
    for args, field in (
        (["--max-tokens", str(2**64)], "--param max_tokens"),
        (["--param", "seed=" + "9" * 5000], "--param seed"),
        (["--size", "1" * 5000 + "x32"], "--size"),
    ):
        proc = cli(
            "send", "--name", gw.name, "--text", "hi", "--out", str(tmp_path), *args, check=False
        )
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert field in proc.stderr + proc.stdout, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_a_foreign_host_or_origin_and_an_untyped_post_are_refused(gw):
    body = {"model": gw.name, "messages": [{"role": "user", "content": "hi"}]}
    chat = "/v1/chat/completions"
    for headers, status, param in (
        ({"Content-Type": "text/plain"}, 415, "Content-Type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        ({"Host": f"evil.example:{gw.port}"}, 403, "Host"),
        ({"Host": f"127.0.0.1.evil.example:{gw.port}"}, 403, "Host"),
        ({"Origin": "http://evil.example"}, 403, "Origin"),
        ({"Origin": "null"}, 403, "Origin"),
        ({"Origin": f"http://localhost:{gw.port + 1}"}, 403, "Origin"),
    ):
        got, answer, _ = gw.request("POST", chat, json_bytes(body), {**TYPED, **headers})
        assert (got, _param(answer)) == (status, param), (headers, answer)
    # The gateway's own page (same origin), and a Host of a loopback name, are served.
    for headers in (
        {"Origin": f"http://127.0.0.1:{gw.port}"},
        {"Host": f"localhost:{gw.port}"},
        {"Host": f"[::1]:{gw.port}", "Origin": f"http://[::1]:{gw.port}"},
    ):
        got, answer, _ = gw.request("POST", chat, json_bytes(body), {**TYPED, **headers})
        assert got == 200, (headers, answer)


def test_metrics_need_the_key_and_health_does_not(gw):
    bare = {"Authorization": ""}
    assert gw.request("GET", "/metrics", headers=bare)[0] == 401
    assert gw.request("GET", "/metrics")[0] == 200
    assert gw.request("GET", "/health", headers=bare)[0] == 200
    assert gw.request("GET", "/", headers=bare)[0] == 200  # the playground page asks for it


def test_a_websocket_upgrade_from_a_foreign_origin_is_refused(gw):
    import websockets

    ws_url = f"ws://{gw.host}:{gw.port}/v1/realtime?model={gw.name}"
    header = {"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"}

    async def main():
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url, additional_headers=header):
                pass
        return refused.value.response.status_code

    assert asyncio.run(main()) == 403
