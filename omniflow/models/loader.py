"""Load a Hugging Face layout folder: config.json, *.safetensors (sharded or not), tokenizer.

Reads only the local folder; never touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from omniflow.models.deepseek.config import MLA_ARCHITECTURES, MLAConfig
from omniflow.models.deepseek.decoder import MLADecoderLM
from omniflow.models.hunyuan_image3.config import (
    HUNYUAN_IMAGE3_ARCHITECTURES,
    HUNYUAN_IMAGE3_MODEL_TYPES,
    HunyuanImage3Config,
)
from omniflow.models.hunyuan_image3.model import HunyuanImage3LM
from omniflow.models.layers.cpu_layouts import packed_weights_supported
from omniflow.models.layers.rope import compute_inv_freq
from omniflow.models.llama.config import DecoderConfig
from omniflow.models.llama.decoder import DecoderLM
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


def iter_checkpoint_tensors(
    path: str | Path, select: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint's tensors; with ``select``, only those it keeps (the
    others are never read from disk)."""
    files = checkpoint_files(path)
    index_file = Path(path) / SAFETENSORS_INDEX
    if select is not None and index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        wanted = {shard for name, shard in weight_map.items() if select(name)}
        files = [f for f in files if f.name in wanted]
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                if select is None or select(name):
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


def load_config(path: str | Path) -> DecoderConfig:
    """The folder's config.json: an `MLAConfig` for DeepSeek-V2 / LongCat-Flash, a
    `HunyuanImage3Config` for HunyuanImage-3, else a Llama/Qwen2 `DecoderConfig` (which
    refuses other architectures)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model folder {path}")
    raw = json.loads(config_file.read_text())
    architecture = (raw.get("architectures") or [""])[0]
    if architecture in MLA_ARCHITECTURES or raw.get("model_type") in _MLA_MODEL_TYPES:
        return MLAConfig.from_dict(raw, str(config_file))
    if (
        architecture in HUNYUAN_IMAGE3_ARCHITECTURES
        or raw.get("model_type") in HUNYUAN_IMAGE3_MODEL_TYPES
    ):
        return HunyuanImage3Config.from_dict(raw, str(config_file))
    return DecoderConfig.from_dict(raw, str(config_file))


_MLA_MODEL_TYPES = ("deepseek_v2", "longcat_flash", "longcat_next")
# The LLM's part of a published LongCat-Next folder (the encoders and heads are the other
# roles' and the codes heads'): only these tensors are read.
NEXT_LLM_PREFIXES = (
    "model.embed_tokens.",
    "model.layers.",
    "model.norm.",
    "model.ngram_embeddings.",
    "lm_head.",
)


def _part(config: DecoderConfig) -> Callable[[str], bool] | None:
    if isinstance(config, MLAConfig) and config.ngram is not None:
        return lambda name: name.startswith(NEXT_LLM_PREFIXES)
    return None


class WeightPlacer(Protocol):
    def __call__(
        self, model: torch.nn.Module, fill: Callable[[Callable[[str], bool] | None], None]
    ) -> None:
        """Put ``model``'s tensors where they should live (keeping dtype, shape and strides),
        calling ``fill(select)`` to load the checkpoint tensors passing ``select`` (None: all)
        that are not there already. omniflow.memory.weights.SharedWeights.place is one."""
        ...


def load_decoder(
    path: str | Path,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    place: WeightPlacer | None = None,
) -> DecoderLM:
    """The model in folder ``path``. ``place``: a placer that puts the weights in memory shared
    with other processes (a CPU model only); they are then laid out as the engine would run
    them, except that nothing repacks them later (``DecoderLM.shared_weights``)."""
    config = load_config(path)
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, config, target_device)
    if isinstance(config, MLAConfig) and target_dtype == torch.float16:
        raise ValueError(
            f"dtype float16 for {config.architecture} in {path}: its MoE activations overflow "
            "float16; use bfloat16 or float32"
        )
    if place is not None and target_device.type != "cpu":
        raise ValueError(
            f"device {target_device} for {path}: shared weights (place=) live in host memory; "
            "load a CPU model"
        )
    with torch.device("meta"):
        model = _decoder_for(config)
    model = model.to(dtype=target_dtype)
    if place is not None and not packed_weights_supported(target_device, target_dtype):
        # The engine's layout on this CPU, chosen now (on meta: no memory touched), so that
        # the shared copy is the one that runs.
        model.use_input_major_weights()
    model = model.to_empty(device=target_device)
    model.rotary.inv_freq = compute_inv_freq(config)[0].to(target_device)
    if isinstance(model, MLADecoderLM | HunyuanImage3LM):
        model.materialized()

    part = _part(config)

    def fill(select: Callable[[str], bool] | None = None) -> None:
        keep = select
        if part is not None:
            keep = part if select is None else lambda n: part(n) and select(n)
        try:
            loaded = model.load_weights(iter_checkpoint_tensors(path, keep))
        except ValueError as e:
            raise ValueError(f"model folder {path}: {e}") from None
        expected = model.expected_checkpoint_names()
        missing = {n for n in expected if select is None or select(n)} - loaded
        if missing:
            raise ValueError(f"checkpoint in {path} lacks tensors: {sorted(missing)[:8]}")

    if place is None:
        fill()
    else:
        place(model, fill)
        model.shared_weights = True
    return model.eval()


def _decoder_for(config: DecoderConfig) -> DecoderLM:
    if isinstance(config, MLAConfig):
        return MLADecoderLM(config)
    if isinstance(config, HunyuanImage3Config):
        return HunyuanImage3LM(config)
    return DecoderLM(config)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    return TextTokenizer.from_folder(path)
