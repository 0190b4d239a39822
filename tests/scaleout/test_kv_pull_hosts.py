"""A prefix's KV pages pulled from one network-namespace host into another, over tcp with
CurveZMQ: the bytes equal a local prefill's, and the continuation is the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniflow.engine import LLMEngine
from omniflow.models import build_tiny_model
from omniflow.runtime.config import generate_keys
from tests.engine.kv_pull_peers import engine_config, greedy
from tests.scaleout.kv_hosts import PAGE, pages_digest
from tests.scaleout.netns import Hosts, namespaces_or_skip

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.randint(3, 500, (8 * PAGE + 3,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def two_hosts():
    namespaces_or_skip()
    hosts = Hosts(("a", "b")).make()
    try:
        yield hosts
    finally:
        hosts.remove()


def test_a_prefix_pulled_across_hosts_is_bit_exact(two_hosts, tmp_path):
    hosts = two_hosts
    model = build_tiny_model(tmp_path / "model", "llama-mha", seed=0, max_shard_bytes=60_000)
    keys = tmp_path / "keys"
    generate_keys(str(keys))
    prompt = PROMPT.tolist()
    command = [sys.executable, "-m", "tests.scaleout.kv_hosts"]
    bind = f"tcp://{hosts.address['b']}:*"
    holder = hosts.popen("b", [*command, "hold", str(model), bind, str(keys), json.dumps(prompt)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline().strip()
        assert line.startswith(f"ENDPOINT tcp://{hosts.address['b']}:"), line
        endpoint = line.split(" ", 1)[1]
        pulled = hosts.run("a", [*command, "pull", str(model), endpoint, str(keys), json.dumps(prompt)],
                           cwd=ROOT, timeout=180)  # fmt: skip
        assert pulled.returncode == 0, pulled.stderr
        got = json.loads(pulled.stdout.strip().splitlines()[-1])
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(30)

    local = LLMEngine(model, engine_config())
    expected_tokens, _ = greedy(local, "local", prompt)
    digest, num_tokens = pages_digest(local, prompt[:-1])
    assert got["pulled_tokens"] == got["num_tokens"] == num_tokens == 8 * PAGE
    assert got["digest"] == digest  # the same K/V bytes as a local prefill
    assert got["cached"] == 8 * PAGE  # the continuation ran on the pulled pages
    assert got["tokens"] == expected_tokens
