"""Load a Hugging Face layout folder: config.json, *.safetensors (sharded or not), tokenizer.

Reads only the local folder; never touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from omniflow.models.decoder import DecoderLM
from omniflow.models.decoder_config import DecoderConfig
from omniflow.models.rope import compute_inv_freq
from omniflow.models.text_tokenizer import TextTokenizer

SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    index_file = folder / SAFETENSORS_INDEX
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model folder {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{SAFETENSORS_INDEX} names shards that are absent: {missing}")
    return files


def iter_checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def resolve_dtype(
    dtype: str | torch.dtype, config: DecoderConfig, device: torch.device
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # Half precision matmuls are slow (or unsupported) on most CPUs: use float32 there.
        if device.type == "cpu":
            return torch.float32
        dtype = config.torch_dtype
    try:
        resolved = getattr(torch, dtype.replace("torch.", ""))
    except AttributeError:
        resolved = None
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype")
    return resolved


def resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_decoder(
    path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"
) -> DecoderLM:
    config = DecoderConfig.from_folder(path)
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, config, target_device)
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to(dtype=target_dtype).to_empty(device=target_device)
    model.rotary.inv_freq = compute_inv_freq(config)[0].to(target_device)
    loaded = model.load_weights(iter_checkpoint_tensors(path))
    missing = model.expected_checkpoint_names() - loaded
    if missing:
        raise ValueError(f"checkpoint in {path} lacks tensors: {sorted(missing)[:8]}")
    return model.eval()


def load_tokenizer(path: str | Path) -> TextTokenizer:
    return TextTokenizer.from_folder(path)
