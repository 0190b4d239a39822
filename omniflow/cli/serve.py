"""omniflow serve PATH: one checkpoint folder, served with the gateway, no TOML to write.

The architecture comes from the folder's ``config.json``: a Llama / Qwen2 / DeepSeek-V2 /
LongCat-Flash LLM runs as a one-role ``llm`` deployment (text; a folder without LongCat
heads in ``omni/`` makes text only); a HunyuanImage-3 folder runs configs/hunyuan_image3.toml
with every role on it. The folder is only read: nothing is built or written there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import typer

from omniflow.cli.common import EXIT_USAGE, LogFormatOpt, RunDirOpt, fail, use_log_format
from omniflow.runtime.config import ConfigError, parse

LLM_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "DeepseekV2ForCausalLM",
    "LongcatFlashForCausalLM",
)
HUNYUAN_ARCHITECTURES = ("HunyuanImage3ForCausalMM",)
HUNYUAN_TOML = Path(__file__).resolve().parents[2] / "configs" / "hunyuan_image3.toml"
LLM_ACTOR = "omniflow.roles.llm:LLMRole"


def architecture(path: Path) -> str:
    """The architecture named by ``path/config.json`` (an error naming what is wrong)."""
    config = path / "config.json"
    if not path.is_dir():
        fail(f"serve: {path} is not a folder", EXIT_USAGE)
    try:
        raw = json.loads(config.read_text())
    except OSError as e:
        fail(f"serve: cannot read {config}: {e.strerror}", EXIT_USAGE)
    except json.JSONDecodeError as e:
        fail(f"serve: {config} is not JSON: {e}", EXIT_USAGE)
    names = raw.get("architectures") if isinstance(raw, dict) else None
    if not (isinstance(names, list) and names and isinstance(names[0], str)):
        fail(f"serve: {config} names no architectures", EXIT_USAGE)
    return str(names[0])


def deployment_name(path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.resolve().name).strip("-.")
    return (name or "model")[:40]


def serve_config(path: Path, name: str, port: int, llm: dict[str, Any]) -> dict[str, Any]:
    """The deployment ``omniflow serve`` runs for the folder ``path``, as a config table."""
    arch = architecture(path)
    folder = str(path.resolve())
    if arch in LLM_ARCHITECTURES:
        options = {"model_path": folder, **{k: v for k, v in llm.items() if v is not None}}
        return {
            "name": name,
            "roles": {"llm": {"actor": LLM_ACTOR, "options": options}},
            "graph": {"edges": [{"from": "input", "to": "llm"}]},
            "runtime": {"start_timeout_s": 600},
            "gateway": {"port": port},
        }
    if arch in HUNYUAN_ARCHITECTURES:
        raw = msgspec.toml.decode(HUNYUAN_TOML.read_bytes())
        for role in raw["roles"].values():
            options = role.get("options", {})
            options["model_path"], options["build_tiny"] = folder, False
        raw["name"], raw["gateway"]["port"] = name, port
        return raw
    known = ", ".join(LLM_ARCHITECTURES + HUNYUAN_ARCHITECTURES)
    fail(f"serve: {path}: architecture {arch!r} is not one omniflow serves ({known})", EXIT_USAGE)


def serve(
    path: Path = typer.Argument(..., help="A checkpoint folder (config.json, *.safetensors)."),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Return once ready; run in the background."
    ),
    port: int = typer.Option(
        8000, "--port", min=0, max=65535, help="The HTTP gateway's port (0: any free one)."
    ),
    name: str | None = typer.Option(
        None, "--name", "-n", help="Deployment (and model) name (default: the folder's)."
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", min=1, help="Longest prompt + output (default: the model's)."
    ),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto, float32, bfloat16 or float16 (auto: float32 on CPU)."
    ),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs", min=1, help="Requests batched."),
    kv_cache_mb: int = typer.Option(512, "--kv-cache-mb", min=1, help="KV cache MiB."),
    max_tokens: int = typer.Option(
        4096, "--max-tokens", min=1, help="Cap on a request's max_tokens."
    ),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="Model threads (default: every core)."
    ),
    run_dir: Path | None = RunDirOpt,
    log_format: str = LogFormatOpt,
    ready_fd: int = typer.Option(-1, hidden=True),
) -> None:
    """Serve one checkpoint folder with the OpenAI-compatible gateway: the architecture
    comes from its config.json; nothing is written into the folder."""
    from omniflow.cli.app import start

    use_log_format(log_format)

    llm = {
        "max_model_len": max_model_len,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "kv_cache_mb": kv_cache_mb,
        "max_tokens": max_tokens,
        "threads": threads or os.cpu_count() or 1,
    }
    raw = serve_config(path, name or deployment_name(path), port, llm)
    try:
        cfg = parse(raw, f"omniflow serve {path}")
    except ConfigError as e:
        fail(f"config error: {e}", EXIT_USAGE)
    argv = ["serve", str(path), "--port", str(port), "--name", cfg.name]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in llm.items() if v is not None]
    argv += ["--log-format", log_format]
    raise typer.Exit(start(cfg, run_dir, detach, argv, ready_fd))
