"""A reply that ends with its eos, then the dialogue sent on: with a session or resent
whole, the prompt is the same, and the turn's end is in it once (the template's).

The checkpoint's eos row of lm_head is scaled up, so a sampled reply often ends itself
after a token or two, as a real model's does, within a few seeds."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import openai
import pytest

from tests.helpers import cli, qwen2_folder, serve_detached

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    root = Path(tempfile.mkdtemp(prefix="of-end-", dir="/tmp"))
    folder = qwen2_folder(root / "Qwen2-ends", eos_gain=40.0)
    run_dir = root / "run"
    _, url = serve_detached(folder, run_dir, max_model_len=256)
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        shutil.rmtree(root, ignore_errors=True)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(
        model="Qwen2-ends", messages=messages, max_tokens=8, **kwargs
    )


def a_reply_that_ends_itself(client, turn1) -> int:
    for seed in range(80):
        choice = chat(client, turn1, temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason == "stop" and choice.message.content:
            return seed
    raise AssertionError("no sampled reply ended with its eos in 80 seeds")


def test_a_session_after_a_reply_that_ended_itself_prompts_as_a_resend(client):
    turn1 = [{"role": "user", "content": "tell me a story"}]
    seed = a_reply_that_ends_itself(client, turn1)
    first = chat(client, turn1, temperature=1.0, seed=seed, extra_body={"session": "ends-1"})
    assert first.choices[0].finish_reason == "stop"
    text = first.choices[0].message.content
    extended = [*turn1, {"role": "assistant", "content": text}, {"role": "user", "content": "on"}]
    with_session = chat(client, extended, temperature=0, extra_headers={"X-Session-Id": "ends-1"})
    resent = chat(client, extended, temperature=0)
    # the reply's ids without their eos, then the closing the template renders: both ways
    assert with_session.usage.prompt_tokens == resent.usage.prompt_tokens
    assert with_session.choices[0].message.content == resent.choices[0].message.content
    # the session went on from its own tokens: its first turn's full pages all cached
    kept = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # less the eos
    assert with_session.usage.prompt_tokens_details.cached_tokens >= kept // 16 * 16
