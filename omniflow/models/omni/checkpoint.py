"""The published LongCat-Next checkpoint layout: one folder, sharded safetensors + index.

``model.safetensors.index.json`` maps every tensor name to its shard. A role reads only the
tensors under its own name prefix (``model.visual_tokenizer.`` for the vision encoder, ...),
opening only the shards that hold them. Loading is strict: a tensor the role's module expects
but the folder lacks, a tensor under the role's prefix the module does not have, or one of the
wrong shape is an error naming the tensor, the role and the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint folder does not hold what a role needs; the message names it."""


def read_config(folder: str | Path, role: str) -> dict[str, Any]:
    """``config.json`` of a published-layout folder, checked to be a LongCat-Next one."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"role {role}: {folder} has no {CONFIG_FILE}")
    config: dict[str, Any] = json.loads(path.read_text())
    if config.get("model_type") != "longcat_next":
        raise CheckpointError(
            f"role {role}: {path} has model_type {config.get('model_type')!r}, "
            "expected 'longcat_next'"
        )
    return config


def read_index(folder: str | Path, role: str) -> dict[str, str]:
    """Tensor name → shard file name, from the folder's index."""
    path = Path(folder) / INDEX_FILE
    if not path.is_file():
        raise CheckpointError(f"role {role}: {folder} has no {INDEX_FILE}")
    weight_map = json.loads(path.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"role {role}: {path} has no weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}


def read_tensors(
    folder: str | Path, names: list[str], role: str, weight_map: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The named tensors, each read from the shard the index says holds it."""
    folder = Path(folder)
    weight_map = read_index(folder, role) if weight_map is None else weight_map
    by_shard: dict[str, list[str]] = {}
    for name in names:
        if name not in weight_map:
            raise CheckpointError(f"role {role}: tensor {name} missing from {folder}")
        by_shard.setdefault(weight_map[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for shard, shard_names in sorted(by_shard.items()):
        path = folder / shard
        if not path.is_file():
            raise CheckpointError(
                f"role {role}: shard {shard} (holding {shard_names[0]}) missing from {folder}"
            )
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for name in shard_names:
                if name not in present:
                    raise CheckpointError(
                        f"role {role}: tensor {name} not in shard {shard} of {folder} "
                        "although the index says so"
                    )
                out[name] = f.get_tensor(name)
    return out


def load_part(
    module: nn.Module,
    folder: str | Path,
    prefix: str,
    role: str,
) -> None:
    """Fill ``module``'s parameters and persistent buffers from the tensors under ``prefix``.

    Every tensor of the module must be in the folder with its shape; every tensor under
    ``prefix`` must be one of the module's.
    """
    folder = Path(folder)
    weight_map = read_index(folder, role)
    fill_strictly(
        module,
        set(weight_map),
        lambda names: read_tensors(folder, names, role, weight_map),
        prefix,
        role,
        folder,
    )


def fill_strictly(
    module: nn.Module,
    stored: set[str],
    read: Callable[[list[str]], dict[str, torch.Tensor]],
    prefix: str,
    role: str,
    where: str | Path,
) -> None:
    """Load ``module`` from the tensors named ``prefix`` + its state-dict names: ``stored``
    is every name the checkpoint holds, ``read(names)`` gives those tensors by name. A
    missing, unexpected or mis-shaped tensor is a ``CheckpointError`` naming it, ``role``
    and ``where`` (the folder or file)."""
    expected = module.state_dict()
    held = {name[len(prefix) :] for name in stored if name.startswith(prefix)}
    missing = sorted(set(expected) - held)
    if missing:
        raise CheckpointError(f"role {role}: tensor {prefix}{missing[0]} missing from {where}")
    unexpected = sorted(held - set(expected))
    if unexpected:
        raise CheckpointError(f"role {role}: unexpected tensor {prefix}{unexpected[0]} in {where}")
    tensors = read([prefix + n for n in sorted(expected)])
    state = {}
    for name, want in expected.items():
        got = tensors[prefix + name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"role {role}: tensor {prefix}{name} in {where} has shape {list(got.shape)}, "
                f"expected {list(want.shape)}"
            )
        state[name] = got.to(want.dtype)
    module.load_state_dict(state, strict=True)


def write_checkpoint(
    folder: str | Path,
    tensors: dict[str, torch.Tensor],
    files: dict[str, str],
    shards: int = 2,
    extra_tensor_files: dict[str, dict[str, torch.Tensor]] | None = None,
    torch_files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``tensors`` as ``shards`` safetensors files + index, and text ``files``, atomically.

    ``extra_tensor_files`` maps a relative path (``image_decoder/image_decoder.safetensors``)
    to tensors stored outside the index, as the published checkpoint does for some parts;
    ``torch_files`` likewise, as ``torch.save`` state dicts (the published ``hift.pt``).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        names = sorted(tensors)
        per = -(-len(names) // shards)
        weight_map: dict[str, str] = {}
        total = 0
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {
                n: tensors[n].detach().contiguous().cpu() for n in names[i * per : (i + 1) * per]
            }
            save_file(part, str(staging / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard))
            total += sum(t.numel() * t.element_size() for t in part.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for rel, part in (extra_tensor_files or {}).items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(
                {n: t.detach().contiguous().cpu() for n, t in part.items()}, str(staging / rel)
            )
        for rel, part in (torch_files or {}).items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            torch.save({n: t.detach().contiguous().cpu() for n, t in part.items()}, staging / rel)
        for rel, text in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_text(text)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / INDEX_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def has_checkpoint(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / CONFIG_FILE).is_file() and (folder / INDEX_FILE).is_file()


def is_next_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a published-layout LongCat-Next checkpoint."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("model_type") == "longcat_next"
    except ValueError:
        return False
