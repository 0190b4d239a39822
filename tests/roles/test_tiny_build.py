"""build_tiny writes only a folder that does not exist yet, atomically: a build killed half
way leaves nothing at model_path, and the next start builds it and serves."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.helpers import cli

pytestmark = pytest.mark.slow

# The llm role's real build, its weights' writer stopped (by SIGKILL) once config.json and
# the tokenizer are out: what a full disk or a Ctrl-C during the first start leaves.
KILLED_BUILD = """
import os, sys, time
import omniflow.models.tiny.builder as tiny
from omniflow.roles.llm import LLMRole

def stuck(tensors, folder, max_shard_bytes):
    (folder / "model.safetensors").write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(60)

tiny.save_safetensors = stuck
role = LLMRole.__new__(LLMRole)
role.path = __import__("pathlib").Path(sys.argv[1])
role._build_tiny("llama-mha", 64, 0)
"""

CONFIG = """
name = "tinybuild"
[roles.llm]
actor = "omniflow.roles.llm:LLMRole"
options = {{ model_path = "{path}", build_tiny = true, kv_cache_mb = 8 }}
[graph]
edges = [{{ from = "input", to = "llm" }}]
[runtime]
start_timeout_s = 120
"""


def test_a_build_killed_half_way_recovers_on_the_next_start(tmp_path):
    folder = tmp_path / "models" / "llm"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_BUILD), str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.stdout is not None and child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not folder.exists()  # the half-written files are in a temporary folder only
    assert [p.name for p in folder.parent.glob(".llm.building-*")]

    config = tmp_path / "tinybuild.toml"
    config.write_text(CONFIG.format(path=folder))
    run_dir = Path(tempfile.mkdtemp(prefix="of-tb-", dir="/tmp"))  # short: ipc:// paths
    cli("up", str(config), "-d", "--run-dir", str(run_dir), timeout=240)
    try:
        sent = cli("send", "--run-dir", str(run_dir), "--text", "hi", "--param", "seed=1")
        assert sent.returncode == 0
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert (folder / "config.json").is_file() and (folder / "omni" / "image_head").is_dir()
    assert not list(folder.parent.glob(".llm.building-*"))  # the stale one went


def test_build_tiny_never_writes_into_an_existing_checkpoint(tmp_path):
    from omniflow.models import build_tiny_model
    from omniflow.roles.llm import LLMRole

    folder = build_tiny_model(tmp_path / "ckpt", "llama-mha")
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    role = LLMRole.__new__(LLMRole)
    role.path = folder
    role._build_tiny("llama-mha", 64, 0)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # no omni/ heads
