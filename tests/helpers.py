"""Config builders for tests: real configs, built in code."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from omniflow.runtime.config import Config, parse

ECHO = "omniflow.roles.echo"


def run_in_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A test written as a coroutine, run to the end in a fresh event loop."""

    def run() -> None:
        asyncio.run(test())

    run.__name__ = run.__qualname__ = test.__name__
    run.__doc__ = test.__doc__
    return run


def echo_config(
    name: str = "t",
    upper: dict[str, Any] | None = None,
    reverse: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    stream: bool = True,
) -> Config:
    raw = {
        "name": name,
        "roles": {
            "upper": {"actor": f"{ECHO}:Upper", **(upper or {})},
            "reverse": {"actor": f"{ECHO}:Reverse", **(reverse or {})},
        },
        "graph": {
            "edges": [
                {"from": "input", "to": "upper"},
                {"from": "upper", "to": "reverse", "stream": stream},
            ]
        },
        "runtime": {
            "heartbeat_s": 0.2,
            "ttl_s": 1.0,
            "drain_timeout_s": 3.0,
            "restart_backoff_s": 0.1,
            **(runtime or {}),
        },
    }
    return parse(raw, "<test>")


def vision_llm_config(
    name: str,
    models: Path,
    llm: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    **top: Any,
) -> Config:
    """The vision encoder feeding the LLM (image in -> encoder -> LLM, joined with the
    text), tiny models under ``models``; ``llm`` adds to the LLM role's table."""
    raw = {
        "name": name,
        **top,
        "roles": {
            "vision_encoder": {
                "actor": "omniflow.roles.vision_encoder:VisionEncoderRole",
                "options": {"model_path": str(models / "vision"), "build_tiny": True, "threads": 1},
            },
            "llm": {
                "actor": "omniflow.roles.llm:LLMRole",
                "options": {
                    "model_path": str(models / "llm"),
                    "build_tiny": True,
                    "kv_cache_mb": 8,
                },
                **(llm or {}),
            },
        },
        "graph": {
            "edges": [
                {"from": "input", "to": "vision_encoder", "when": "has_image"},
                {"from": "input", "to": "llm"},
                {"from": "vision_encoder", "to": "llm"},
            ]
        },
        "cache": cache or {},
        "runtime": {"heartbeat_s": 0.2, "ttl_s": 2.0, "start_timeout_s": 120, **(runtime or {})},
    }
    return parse(raw, "<test>")


def expected_echo(text: str) -> list[str]:
    import re

    return [w.upper()[::-1] for w in re.findall(r"\S+\s*", text)]


def cli(*args: str, check: bool = True, cwd=None, timeout: float = 180):
    """Run ``python -m omniflow.cli ARGS`` as a user would; raise with its output on failure."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"omniflow {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def assert_leaves_queued(cache):
    """What makes eviction without a walk exact: every leaf a walk would find evictable is
    queued in its tier at its last access."""
    for node in cache.nodes():
        if cache._evictable(node, node.tier):
            assert cache.leaves[node.tier].queued(node, node.last_access), node.tier


@functools.cache
def _tiny_next() -> Path:
    """The one tiny LongCat-Next build of this test process (removed at its exit)."""
    import atexit
    import shutil
    import tempfile

    from omniflow.models.omni.checkpoint import ensure_next

    scratch = Path(tempfile.mkdtemp(prefix="of-next-"))
    atexit.register(shutil.rmtree, scratch, True)
    return ensure_next(scratch / "next")


def prebuilt_longcat(work: Path) -> None:
    """Put a tiny LongCat-Next checkpoint where configs/longcat.toml's roles look from
    ``work`` (models/longcat-tiny/next), as the first start builds it (seed 0, hidden 64).

    Built once per test process and copied: the build is seconds per deployment, and
    tests/roles/test_longcat.py still has its first start build it."""
    import shutil

    shutil.copytree(_tiny_next(), Path(work) / "models" / "longcat-tiny" / "next")


def qwen2_folder(folder: Path, eos_gain: float = 1.0) -> Path:
    """A tiny random Qwen2 saved by transformers: sharded safetensors + index, tokenizer.
    ``eos_gain`` scales the eos row of lm_head: past 1, replies end themselves sooner."""
    import torch
    import transformers

    from omniflow.models.tiny.tokenizer import BOS, EOS, PAD, build_tiny_tokenizer

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tiny_tokenizer(320), bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id] *= eos_gain
    model.save_pretrained(folder, max_shard_size="60KB", safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def serve_detached(folder: Path, run_dir: Path, max_model_len: int = 128):
    """`omniflow serve FOLDER -d` on a free port with a small KV cache, one thread: (what
    the CLI printed, the gateway's URL)."""
    started = cli(
        "serve", str(folder), "-d", "--port", "0", "--run-dir", str(run_dir),
        "--max-model-len", str(max_model_len), "--kv-cache-mb", "8", "--threads", "1",
        timeout=300,
    )  # fmt: skip
    return started, (run_dir / "gateway.url").read_text().strip()
