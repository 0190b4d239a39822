"""LongCat-Next's vision tokenizer in the published layout.

``model.visual_tokenizer.``:
  ``visual_model.*``              Qwen2.5-VL's vision transformer (transformers'
                                  ``Qwen2_5_VisionTransformerPretrainedModel``), merger removed;
  ``visual_bridge_model.bridge``  the merger's place: RMSNorm ``ln_q`` + ``mlp.0``/GELU/``mlp.2``
                                  over 2x2 merged patches;
  ``visual_bridge_model.quantizer.quantize.codebooks.i``  8-level residual VQ, ``embed``
                                  [n + 1, dim] (the last row is padding, never chosen),
                                  ``embed_ema``/``cluster_size_ema`` (training state, unused);
  ``visual_embedding_layer.pre_buffer``  LayerNorm + SwiGLU, residual, over the summed code rows.
Code ids enter the LLM through its word embedding: level l's id + cumulative offset
(``visual_offset`` + sizes of the levels before) selects a row of ``model.embed_tokens``;
the vision role reads only that region of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLPatchMerger,
)

from omniflow.models.omni.checkpoint import CheckpointError, load_part, read_config, read_index
from omniflow.models.omni.next_codes import (
    VISION_PREFIX,
    EmbeddingLayer,
    code_offsets,
    load_code_rows,
)

PREFIX = VISION_PREFIX
# OpenAI CLIP normalization, Qwen2-VL's image processor defaults.
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)
# Keys of visual_config that are LongCat's own, not Qwen2.5-VL vision config fields.
_OWN_KEYS = ("vq_config", "visual_decoder_config")


class VisionCodes(NamedTuple):
    codes: torch.Tensor  # int64 [h*w, L], row-major over the token grid
    grid: tuple[int, int]


@dataclass
class NextVisionInfo:
    """What the role needs of the config (``pixels_per_token`` as the stand-in had)."""

    patch_size: int
    merge: int
    temporal_patch_size: int
    codebook_sizes: list[int]
    hidden_size: int

    @property
    def pixels_per_token(self) -> int:
        return self.patch_size * self.merge


class VQEmbedding(nn.Module):
    """One level: nearest of ``embed[:-1]`` by L2 in float32."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(n + 1, dim) * 0.5)
        self.embed_ema = nn.Parameter(torch.zeros(n, dim))
        self.cluster_size_ema = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        book = self.embed[:-1].float()
        dist = x.pow(2).sum(-1, keepdim=True) + book.pow(2).sum(-1)[None] - 2.0 * x @ book.t()
        ids = dist.argmin(-1)
        return book[ids], ids


class _Quantize(nn.Module):
    def __init__(self, sizes: list[int], dim: int) -> None:
        super().__init__()
        self.codebooks = nn.ModuleList(VQEmbedding(n, dim) for n in sizes)


class VisualQuantizer(nn.Module):
    def __init__(self, sizes: list[int], dim: int, quant_conv_in: int | None = None) -> None:
        super().__init__()
        self.quantize = _Quantize(sizes, dim)
        # vq_config.quant_conv: LayerNorm + Linear/GELU/Linear before the codebooks.
        self.quant_conv = (
            None
            if quant_conv_in is None
            else nn.Sequential(
                nn.LayerNorm(quant_conv_in),
                nn.Linear(quant_conv_in, quant_conv_in),
                nn.GELU(),
                nn.Linear(quant_conv_in, dim),
            )
        )

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Residual VQ ids [N, L] of bridge outputs [N, in]."""
        if self.quant_conv is not None:
            x = self.quant_conv(x)
        residual = x.float().clone()
        ids = []
        for book in self.quantize.codebooks:
            quant, level_ids = book(residual)
            residual = residual - quant
            ids.append(level_ids)
        return torch.stack(ids, -1).to(torch.int64)


class _Borrowed(nn.Module):
    """Calls a module registered elsewhere (so its tensors keep their published names)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self._target = [target]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._target[0](x)


class _Bridge(nn.Module):
    def __init__(self, vconf: Qwen2_5_VLVisionConfig, vq: dict[str, Any]) -> None:
        super().__init__()
        self.bridge = Qwen2_5_VLPatchMerger(
            dim=vconf.out_hidden_size,
            context_dim=vconf.hidden_size,
            spatial_merge_size=vconf.spatial_merge_size,
        )
        dim = int(vq["codebook_dim"])
        quant_in = int(vq.get("in_channels", dim)) if vq.get("quant_conv") else None
        sizes = [int(n) for n in vq["codebook_sizes"]]
        self.quantizer = VisualQuantizer(sizes, dim, quant_in)


def vision_config(config: dict[str, Any]) -> Qwen2_5_VLVisionConfig:
    raw = {k: v for k, v in config["visual_config"].items() if k not in _OWN_KEYS}
    vconf = Qwen2_5_VLVisionConfig(**raw)
    vconf._attn_implementation = "sdpa"
    return vconf


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise CheckpointError(f"visual_config: expected an integer, got {value!r}")
    return value


class NextVisionTokenizer(nn.Module):
    """``model.visual_tokenizer`` of a LongCat-Next checkpoint (random until loaded)."""

    mean: torch.Tensor
    std: torch.Tensor
    offsets: torch.Tensor

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        vconf = vision_config(config)
        vq = config["visual_config"]["vq_config"]
        sizes = [int(n) for n in vq["codebook_sizes"]]
        hidden = int(config["hidden_size"])
        self.config = NextVisionInfo(
            _int(vconf.patch_size),
            _int(vconf.spatial_merge_size),
            _int(vconf.temporal_patch_size),
            sizes,
            hidden,
        )
        self.visual_model = Qwen2_5_VisionTransformerPretrainedModel._from_config(vconf)
        self.visual_bridge_model = _Bridge(vconf, vq)
        self.visual_model.merger = _Borrowed(self.visual_bridge_model.bridge)
        self.visual_embedding_layer = EmbeddingLayer(
            hidden,
            int(config["visual_embedding_layer_intermediate_size"]),
            float(config.get("rms_norm_eps", 1e-5)),
        )
        self.code_rows = nn.Embedding(sum(sizes), hidden)  # loaded from model.embed_tokens
        self.first_row = int(config["visual_offset"])
        self.register_buffer("offsets", code_offsets(0, sizes), persistent=False)
        self.register_buffer("mean", torch.tensor(_MEAN).view(3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(_STD).view(3, 1, 1), persistent=False)

    def patches(self, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Qwen2-VL's flattened patches [gh*gw, 3*T*p*p] of a uint8 image [H, W, 3]."""
        c = self.config
        if image.dim() != 3 or image.shape[2] != 3 or image.dtype != torch.uint8:
            raise ValueError(
                f"expected a uint8 image [H, W, 3], got {image.dtype} {list(image.shape)}"
            )
        height, width = int(image.shape[0]), int(image.shape[1])
        step = c.pixels_per_token
        if height % step or width % step or height == 0 or width == 0:
            raise ValueError(f"image {height}x{width} is not a positive multiple of {step}")
        x = (image.permute(2, 0, 1).float() / 255.0 - self.mean) / self.std
        p, m, t = c.patch_size, c.merge, c.temporal_patch_size
        gh, gw = height // p, width // p
        x = x[None].expand(t, 3, height, width)
        x = x.reshape(t, 3, gh // m, m, p, gw // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
        return x.reshape(gh * gw, 3 * t * p * p), gh, gw

    @torch.no_grad()
    def features(self, image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Bridge outputs [h*w, codebook_dim] (row-major tokens) of a uint8 image."""
        patches, gh, gw = self.patches(image)
        grid = torch.tensor([[1, gh, gw]])
        dtype = self.visual_model.patch_embed.proj.weight.dtype
        out = self.visual_model(patches.to(dtype), grid_thw=grid)
        m = self.config.merge
        return out.pooler_output, (gh // m, gw // m)

    @torch.no_grad()
    def encode(self, image: torch.Tensor) -> VisionCodes:
        features, grid = self.features(image)
        return VisionCodes(self.visual_bridge_model.quantizer.encode(features), grid)

    @torch.no_grad()
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """LLM input vectors [N, hidden]: summed code rows, then ``visual_embedding_layer``."""
        rows = self.code_rows(codes.to(self.offsets.device) + self.offsets).sum(1)
        return self.visual_embedding_layer.pre_buffer(rows)


def load_next_vision(folder: str | Path, device: str = "cpu") -> NextVisionTokenizer:
    """The vision tokenizer of a published-layout folder, strictly loaded."""
    role = "vision_encoder"
    model = NextVisionTokenizer(read_config(folder, role))
    load_part(model.visual_model, folder, PREFIX + "visual_model.", role)
    load_part(model.visual_bridge_model, folder, PREFIX + "visual_bridge_model.", role)
    load_part(model.visual_embedding_layer, folder, PREFIX + "visual_embedding_layer.", role)
    _no_strays(folder, role)
    load_code_rows(model.code_rows, folder, model.first_row, role)
    return model.to(device).eval()


def _no_strays(folder: str | Path, role: str) -> None:
    parts = ("visual_model.", "visual_bridge_model.", "visual_embedding_layer.")
    for name in read_index(folder, role):
        if name.startswith(PREFIX) and not name[len(PREFIX) :].startswith(parts):
            raise CheckpointError(f"role {role}: unexpected tensor {name} in {folder}")
