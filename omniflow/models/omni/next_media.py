"""The llm role's codes heads (engine/heads.py) in the published LongCat-Next layout.

An image or audio token is made by ``visual_head`` / ``audio_head`` (next_heads.py), level
by level: the LLM's last hidden state and the running sum of the chosen levels' word-
embedding rows -> level l's logits over codebook size + 1, greedy over the codebook (the
extra last output, for audio level 0 the published end-of-audio flag, is never chosen). It goes back in as the sum of each level's
row of ``model.embed_tokens`` (level l's id + ``visual_offset``/``audio_offset`` + the sizes
of the levels before), then, for images, ``model.visual_tokenizer.visual_embedding_layer``:
the same input the encoders give a seen image or sound (next_vision.py, next_audio.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from omniflow.models.omni.checkpoint import load_part, read_config
from omniflow.models.omni.next_codes import (
    VISION_PREFIX,
    EmbeddingLayer,
    code_offsets,
    load_code_rows,
)
from omniflow.models.omni.next_heads import NextDepthHead, head_for


class NextMediaHead:
    """One modality's codes head: ``codes`` (hidden -> ids [B, 8]) and ``embed`` (ids ->
    the next input row)."""

    def __init__(
        self,
        key: str,
        head: NextDepthHead,
        code_rows: nn.Embedding,
        sizes: list[int],
        placeholder_id: int,
        embedding_layer: EmbeddingLayer | None = None,
    ) -> None:
        self.key, self.placeholder_id = key, placeholder_id
        self.head, self.code_rows, self.sizes = head, code_rows, sizes
        self.offsets = code_offsets(0, sizes).to(code_rows.weight.device)
        self.embedding_layer = embedding_layer

    @torch.no_grad()
    def codes(self, hidden: torch.Tensor) -> torch.Tensor:
        """Level by level: greedy id of level l, then its word-embedding row joins the
        running sum the next level's position reads."""
        hidden = hidden.to(self.head.hidden_proj.weight.dtype)
        previous = hidden.new_zeros(hidden.shape[0], len(self.sizes) - 1, hidden.shape[-1])
        total = hidden.new_zeros(hidden.shape[0], hidden.shape[-1])
        ids = []
        for level, size in enumerate(self.sizes):
            code = self.head(hidden, previous)[level][:, :size].argmax(-1)
            ids.append(code)
            if level + 1 < len(self.sizes):
                total = total + self.code_rows(code + self.offsets[level]).to(hidden.dtype)
                previous[:, level] = total
        return torch.stack(ids, -1).to(torch.int64)

    @torch.no_grad()
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        rows = self.code_rows(codes.to(self.offsets.device) + self.offsets).sum(1)
        if self.embedding_layer is not None:
            rows = self.embedding_layer.pre_buffer(rows)
        return rows


def load_next_media_heads(
    folder: str | Path, placeholder_id: int, device: str = "cpu", role: str = "llm"
) -> tuple[NextMediaHead, NextMediaHead]:
    """(image head, audio head) of a published-layout folder, strictly loaded."""
    config = read_config(folder, role)
    hidden = int(config["hidden_size"])
    heads = []
    for key, which, offset in (
        ("image", "visual", "visual_offset"),
        ("audio", "audio", "audio_offset"),
    ):
        sizes = [int(n) for n in config[f"{which}_config"]["vq_config"]["codebook_sizes"]]
        head = head_for(config, which)
        load_part(head, folder, f"{which}_head.", role)
        rows = nn.Embedding(sum(sizes), hidden)
        load_code_rows(rows, folder, int(config[offset]), role)
        layer = None
        if key == "image":
            layer = _embedding_layer(config, folder, role)
        heads.append((key, head, rows, sizes, layer))
    out = []
    for key, head, rows, sizes, layer in heads:
        modules: list[Any] = [head, rows] + ([layer] if layer is not None else [])
        for module in modules:
            module.to(device).eval()
        out.append(NextMediaHead(key, head, rows, sizes, placeholder_id, layer))
    return out[0], out[1]


def _embedding_layer(config: dict[str, Any], folder: str | Path, role: str) -> EmbeddingLayer:
    layer = EmbeddingLayer(
        int(config["hidden_size"]),
        int(config["visual_embedding_layer_intermediate_size"]),
        float(config.get("rms_norm_eps", 1e-5)),
    )
    load_part(layer, folder, VISION_PREFIX + "visual_embedding_layer.", role)
    return layer
