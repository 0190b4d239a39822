"""configs/deepseek_v2.toml end to end: `omniflow up`, then `omniflow send --text` streams
the tiny DeepSeek-V2's tokens as they are made."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

import pytest

import omniflow
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp("deepseek")
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    (work / "configs").mkdir()
    config = (ROOT / "configs" / "deepseek_v2.toml").read_text()
    (work / "configs" / "deepseek_v2.toml").write_text(config)
    cli("up", "configs/deepseek_v2.toml", "--detach", cwd=work)
    yield omniflow.runtime.find_deployment("deepseek_v2"), work
    cli("down", "--name", "deepseek_v2", check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def test_send_streams_text(deepseek):
    state, work = deepseek
    assert json.loads((work / "models" / "deepseek-v2-tiny" / "config.json").read_text())[
        "architectures"
    ] == ["DeepseekV2ForCausalLM"]
    proc = cli("send", "--name", "deepseek_v2", "--text", "hello there", "--json", cwd=work)
    reply = json.loads(proc.stdout)
    assert reply["usage"]["completion_tokens"] > 0

    async def stream():
        conn = await omniflow.connect(run_dir=state["run_dir"])
        try:
            params = {"max_tokens": 8, "temperature": 0.0}
            events = [e async for e in conn.stream({"text": "hi"}, params=params, timeout=60)]
            return events[:-1], events[-1]
        finally:
            await conn.close()

    outputs, result = asyncio.run(stream())
    assert len(outputs) > 1  # one output per token (or few), not one at the end
    assert all(o.role == "llm" for o in outputs)
    assert result.usage["completion_tokens"] == 8


def test_the_gateway_streams_it_over_http(deepseek):
    import openai

    state, _ = deepseek
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    chunks = client.chat.completions.create(
        model="deepseek_v2",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
    )
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(deltas) > 1  # streamed token by token, not one piece at the end
