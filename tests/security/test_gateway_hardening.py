"""The gateway against hostile HTTP, over real sockets to a real deployment: absurd
numbers and sizes are 400s naming the field (never a 500, never seconds of work)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import omniflow
from tests.helpers import cli
from tests.security.gateway_live import LiveGateway


@pytest.fixture(scope="module")
def gw(run_root_module: Path) -> Iterator[LiveGateway]:
    dep = LiveGateway(f"gh{os.getpid() % 10000}")
    try:
        yield dep
    finally:
        dep.close()


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
