"""LongCat-Next's n-gram input embedding (``model.ngram_embeddings.{embedders,post_projs}.i``).

Each token's input vector is its word embedding plus, for every n-gram order 2..N and split
1..K, a hashed table row of the token and its N-1 predecessors (inside a segment that ends
at EOS or id 0, multimodal specials counted as 0), projected to the hidden size; the sum is
averaged over the 1 + K(N-1) terms, except at multimodal special tokens. Equations as vLLM's
``longcat_next.py`` / ``longcat_flash_ngram.py`` implement them.

``rows`` works on any flat batch of rows given each row's predecessors (what the engine has
at a decode step); ``forward`` takes one whole sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NGRAM_PREFIX = "model.ngram_embeddings."
NO_NGRAM = -2  # a row's context marker: the sequence is this one token (the tables are skipped)


class NgramEmbedding(nn.Module):
    """Word embedding + hashed 2..n-gram tables, averaged (multimodal specials excluded)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.n = int(config["emb_neighbor_num"])
        self.k = int(config["emb_split_num"])
        self.vocab = int(config["text_vocab_size"])
        self.m = int(config["ngram_vocab_size_ratio"]) * self.vocab
        self.eos = int(config.get("eos_token_id", 2))
        special_end = int(config["text_vocab_plus_multimodal_special_token_size"])
        self.ignored = (self.vocab, special_end)
        count = self.k * (self.n - 1)
        dim = int(config["hidden_size"]) // count
        self.embedders = nn.ModuleList(nn.Embedding(self.m + 2 * i + 1, dim) for i in range(count))
        self.post_projs = nn.ModuleList(
            nn.Linear(dim, int(config["hidden_size"]), bias=False) for _ in range(count)
        )

    @property
    def context(self) -> int:
        """How many predecessors a row needs."""
        return self.n - 1

    def _ctx(self, ids: torch.Tensor) -> torch.Tensor:
        ignored = (ids >= self.ignored[0]) & (ids < self.ignored[1])
        return torch.where(ignored | (ids < 0), torch.zeros_like(ids), ids)

    def rows(self, ids: torch.Tensor, prev: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
        """Input vectors [T, hidden] of rows ``ids`` [T] with word embeddings ``word``, given
        each row's predecessors ``prev`` [T, n-1] (prev[:, s-1] = the id s before it; -1
        before the sequence's start; NO_NGRAM in column 0: a sequence of one token)."""
        ignored = (ids >= self.ignored[0]) & (ids < self.ignored[1])
        ctx, before = self._ctx(ids), self._ctx(prev)
        boundary = (ctx == self.eos) | (ctx == 0)
        # A predecessor counts while no boundary lies between it and the row (itself included).
        open_ = ((before != self.eos) & (before != 0)).long().cumprod(1).bool()
        shifted = torch.where(open_ & ~boundary[:, None], before, torch.zeros_like(before))
        apply = (prev[:, 0] != NO_NGRAM).unsqueeze(-1).to(word.dtype)
        x = word.clone()
        for i in range(2, self.n + 1):
            for j in range(self.k):
                index = (i - 2) * self.k + j
                size = self.m + 2 * index + 1
                h = ctx.clone()
                power = 1
                for s in range(1, i):
                    power = power * self.vocab % size
                    h = h + shifted[:, s - 1] * power
                h = h % size
                table = self.embedders[index](h) * ((h > 0).unsqueeze(-1).to(word.dtype) * apply)
                x = x + self.post_projs[index](table)
        scale = 1 + self.k * (self.n - 1)
        return torch.where(ignored.unsqueeze(-1), x, x / scale)

    def forward(self, ids: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
        """Input vectors [T, hidden] of one sequence's token ids [T] and word embeddings."""
        return self.rows(ids, sequence_context(ids.tolist(), self.context), word)


def sequence_context(ids: list[int], count: int, start: int = 0) -> torch.Tensor:
    """Each row's ``count`` predecessors [len(ids) - start, count] in sequence ``ids``, from
    row ``start`` on (-1 before the start; NO_NGRAM for a one-token sequence)."""
    if len(ids) == 1:
        return torch.full((1, count), NO_NGRAM, dtype=torch.long)
    out = [
        [ids[p - s] if p - s >= 0 else -1 for s in range(1, count + 1)]
        for p in range(start, len(ids))
    ]
    return torch.tensor(out, dtype=torch.long).view(-1, count)
