"""Residual vector quantization: L levels, each with its own codebook.

Level l quantizes what the levels before it left over, so ``decode(encode(x))`` is a sum of
one vector per level. Encoded ids are int64 ``[N, L]``; level l's ids lie in
``[0, codebook_sizes[l])``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


class ResidualVQ(nn.Module):
    def __init__(self, dim: int, codebook_sizes: list[int]) -> None:
        super().__init__()
        self.dim = dim
        self.codebook_sizes = list(codebook_sizes)
        self.codebooks = nn.ModuleList(nn.Embedding(n, dim) for n in self.codebook_sizes)
        # Shrink later levels so residuals have something left to match: a random init with
        # equal scales would let level 0 overshoot and every later level pick at random.
        with torch.no_grad():
            for level in range(self.levels):
                self.codebook(level).weight.mul_(0.5**level)

    @property
    def levels(self) -> int:
        return len(self.codebooks)

    def codebook(self, level: int) -> nn.Embedding:
        """Level ``level``'s codebook."""
        return cast(nn.Embedding, self.codebooks[level])

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Nearest-code ids [N, L] of vectors x [N, dim]."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected vectors [N, {self.dim}], got {list(x.shape)}")
        residual = x.float()
        ids = []
        for level in range(self.levels):
            weight = self.codebook(level).weight.float()
            # ||r - c||^2 = ||r||^2 - 2 r.c + ||c||^2; the first term does not change the argmin.
            distance = weight.pow(2).sum(-1)[None, :] - 2.0 * residual @ weight.t()
            level_ids = distance.argmin(dim=-1)
            ids.append(level_ids)
            residual = residual - weight[level_ids]
        return torch.stack(ids, dim=-1).to(torch.int64)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Sum of the level vectors [N, dim] of ids [N, L]."""
        check_ids(ids, self.codebook_sizes)
        out = self.codebooks[0](ids[:, 0])
        for level in range(1, self.levels):
            out = out + self.codebooks[level](ids[:, level])
        return out


def check_ids(ids: torch.Tensor, codebook_sizes: list[int]) -> None:
    """Raise ValueError naming the level when ids [N, L] do not fit the codebooks."""
    if ids.dim() != 2 or ids.shape[1] != len(codebook_sizes):
        raise ValueError(f"expected ids [N, {len(codebook_sizes)}], got {list(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expected integer ids, got {ids.dtype}")
    if ids.numel() == 0:
        return
    low = ids.min(dim=0).values
    high = ids.max(dim=0).values
    for level, size in enumerate(codebook_sizes):
        if low[level] < 0 or high[level] >= size:
            raise ValueError(
                f"level {level} ids must lie in [0, {size}), got [{int(low[level])}, "
                f"{int(high[level])}]"
            )
