"""`omniflow serve PATH` on a checkpoint transformers wrote: text through the openai client,
request limits as 400s naming the field, and the folder left byte-for-byte as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import cli, qwen2_folder, serve_detached

pytestmark = pytest.mark.slow


def hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def served():
    root = Path(tempfile.mkdtemp(prefix="of-serve-", dir="/tmp"))
    folder = qwen2_folder(root / "Qwen2-tiny")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    os.chmod(folder, 0o555)  # a read-only folder: any write there would fail the start
    before = hashes(folder)
    run_dir = root / "run"
    started, url = serve_detached(folder, run_dir)
    try:
        yield url, started, folder, before
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        os.chmod(folder, 0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_serve_streams_text_through_the_openai_client(served):
    url, started, folder, before = served
    assert url in started.stdout  # where it listens
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["Qwen2-tiny"]
    stream = client.chat.completions.create(
        model="Qwen2-tiny",
        messages=[{"role": "user", "content": "hello there"}],
        stream=True,
        max_tokens=8,
        temperature=0,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert hashes(folder) == before  # not one byte written, no file added


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": [{"role": "user", "content": "word " * 200}]}, "max_model_len"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, "max_tokens"),
    ],
)
def test_request_past_the_context_is_a_400_naming_it(served, body, field):
    url, _, folder, before = served
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "Qwen2-tiny", **body})
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"]
    assert hashes(folder) == before


def test_cli_send_past_the_context_exits_2_without_a_traceback(served):
    _, _, folder, _ = served
    run_dir = Path(folder).parent / "run"
    proc = cli("send", "--run-dir", str(run_dir), "--text", "word " * 200, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bad_request" in proc.stderr and "max_model_len 128" in proc.stderr
    logs = [p.read_text() for p in [run_dir / "supervisor.log", *run_dir.glob("logs/*.log")]]
    assert len(logs) > 1 and not any("Traceback" in log for log in logs)


def test_serve_refuses_a_folder_it_cannot_serve(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    proc = cli("serve", str(tmp_path), check=False)
    assert proc.returncode == 2 and "'BertModel'" in proc.stderr
