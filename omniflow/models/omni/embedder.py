"""Code embedder: the input side of a discrete modality.

Each of the L levels has its own embedding table; a token's L level embeddings are summed and
passed through a small MLP into the LLM's hidden size, one vector per token.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from omniflow.models.omni.rvq import check_ids


class CodeEmbedder(nn.Module):
    def __init__(self, codebook_sizes: list[int], code_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.codebook_sizes = list(codebook_sizes)
        self.tables = nn.ModuleList(nn.Embedding(n, code_dim) for n in self.codebook_sizes)
        self.mlp = nn.Sequential(
            nn.Linear(code_dim, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size)
        )

    def table(self, level: int) -> nn.Embedding:
        """Level ``level``'s embedding table."""
        return cast(nn.Embedding, self.tables[level])

    def summed(self, ids: torch.Tensor) -> torch.Tensor:
        """Sum of the L level embeddings [N, code_dim] of ids [N, L]."""
        check_ids(ids, self.codebook_sizes)
        out = self.tables[0](ids[:, 0])
        for level in range(1, len(self.tables)):
            out = out + self.tables[level](ids[:, level])
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Hidden-size vectors [N, hidden_size] of ids [N, L]."""
        return self.mlp(self.summed(ids))
