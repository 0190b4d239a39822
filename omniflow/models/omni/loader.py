"""Save, load and build our stand-in omni models (depth heads, code embedders): a folder with ``config.json`` + ``model.safetensors``. The vision and audio tokenizers are read
from the published LongCat-Next layout instead (``checkpoint.py``, ``next_*.py``).

``config.json`` holds ``{"kind": ..., <the model's config fields>}``; the weights are a flat
safetensors state dict with the module's own parameter names. Loading is strict (a missing or
unexpected tensor is an error naming it), so the same code loads a real checkpoint converted
to this layout. ``build_tiny_<x>`` writes a random-weight model, seeded, for tests and for a
fresh checkout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from omniflow.models.omni.depth_head import DepthHead, DepthHeadConfig
from omniflow.models.omni.embedder import CodeEmbedder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclasses.dataclass
class CodeEmbedderConfig:
    codebook_sizes: list[int] = dataclasses.field(default_factory=lambda: [1024] * 8)
    code_dim: int = 32
    hidden_size: int = 64


class StoredCodeEmbedder(CodeEmbedder):
    """A CodeEmbedder saved on its own (the LLM's input side for generated codes)."""

    def __init__(self, config: CodeEmbedderConfig) -> None:
        super().__init__(config.codebook_sizes, config.code_dim, config.hidden_size)
        self.config = config


KINDS: dict[str, tuple[type, type[nn.Module]]] = {
    "code_embedder": (CodeEmbedderConfig, StoredCodeEmbedder),
    "depth_head": (DepthHeadConfig, DepthHead),
}


class ModelFormatError(ValueError):
    """A model folder is missing a file or holds the wrong thing; the message names which."""


def _config_from_dict(kind: str, raw: dict[str, Any], source: str) -> Any:
    config_cls = KINDS[kind][0]
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ModelFormatError(f"{source}: unknown {kind} config field(s) {unknown}")
    return config_cls(**raw)


def has_model(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def save_model(model: nn.Module, kind: str, path: str | Path) -> Path:
    """Write ``model`` (a KINDS module with a ``config``) into the folder ``path``, atomically.

    The files are written into a sibling temporary folder and renamed into place, so two
    replicas building the same path at once never leave a half-written model; the loser of
    the race keeps the winner's files.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model_config = model.config
        if not dataclasses.is_dataclass(model_config) or isinstance(model_config, type):
            raise TypeError(f"{kind} model config is not a dataclass instance: {model_config!r}")
        config = {"kind": kind, **dataclasses.asdict(model_config)}
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
        save_file(state, str(staging / WEIGHTS_FILE), metadata={"kind": kind})
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        try:
            os.rename(staging, path)
        except OSError:
            if not has_model(path):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def load_model(
    kind: str,
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The ``kind`` model stored in the folder ``path``, in eval mode on ``device``."""
    if kind not in KINDS:
        raise ModelFormatError(f"unknown model kind {kind!r}; known: {sorted(KINDS)}")
    path = Path(path)
    if not has_model(path):
        raise ModelFormatError(f"{path}: expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    raw = json.loads((path / CONFIG_FILE).read_text())
    stored_kind = raw.pop("kind", None)
    if stored_kind != kind:
        raise ModelFormatError(f"{path}: holds a {stored_kind!r} model, expected {kind!r}")
    config = _config_from_dict(kind, raw, str(path / CONFIG_FILE))
    model = KINDS[kind][1](config)
    state = load_file(str(path / WEIGHTS_FILE))
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ModelFormatError(
            f"{path / WEIGHTS_FILE}: missing tensors {result.missing_keys[:5]}, "
            f"unexpected tensors {result.unexpected_keys[:5]}"
        )
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


def build_tiny(kind: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight ``kind`` model (config defaults + ``overrides``) seeded by ``seed``."""
    config = _config_from_dict(kind, overrides, f"build_tiny({kind!r})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = KINDS[kind][1](config)
    return save_model(model, kind, path)


def ensure_model(kind: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """``path``, after building the tiny ``kind`` model there if it holds no model yet."""
    if not has_model(path):
        build_tiny(kind, path, seed, **overrides)
    return Path(path)


def build_tiny_depth_head(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    return build_tiny("depth_head", path, seed, **overrides)


def _load_as(kind: str, cls: type[Any], path: str | Path, device: str | torch.device) -> Any:
    model = load_model(kind, path, device)
    if not isinstance(model, cls):
        raise ModelFormatError(f"{path}: loaded a {type(model).__name__}, expected {cls.__name__}")
    return model


def load_depth_head(path: str | Path, device: str | torch.device = "cpu") -> DepthHead:
    head: DepthHead = _load_as("depth_head", DepthHead, path, device)
    return head
