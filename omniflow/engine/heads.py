"""Output heads and guidance: what a request makes of its last hidden state.

A text request (no head) takes lm_head + the Sampler. A codes request carries a `CodesHead`
the role supplies (LongCat's depth head): the last hidden state -> K codebook ids, and an
embedder: ids -> the next input row. Each media token is one decode step over the paged KV;
it sits in the sequence as `placeholder_id`, its input row given by the embedder, and is
keyed in the prefix cache by (`key`, its ids), so a later turn that repeats it reuses its KV.

Classifier-free guidance pairs a request (the conditional sequence) with an unconditional
one (`Guidance`); the scheduler runs both in the same step, and the hidden states are
combined as uncond + scale * (cond - uncond) before the head, or, for a codes head with
``guided_codes(cond, uncond, scale, pick)``, the head gets both halves and guides each
level's logits itself (LongCat-Next's published image head).

A block step (`BlockRows`) is N input rows that attend bidirectionally among themselves and
causally to a kept sequence's computed prefix; their K/V never enter the prefix cache, and
their final hidden states come back (diffusion on the LLM backbone). A kept context may be
lent (`keep_context(..., lease=)`): its prefix K/V are another process's pages, read in
place by every block step, never computed here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from omniflow.engine.sequence import EmbeddingSpan
    from omniflow.kv.share import KVLease


CodesPick = Callable[[int, torch.Tensor], torch.Tensor]
"""(level, logits [B, n]) -> ids [B]: how a codes head chooses each level's ids, one row per
request, by the requests' sampling params (engine/sampler.py ``Sampler.codes_pick``)."""


class CodesHead(Protocol):
    """A role-supplied output head for discrete media tokens of K codebooks."""

    @property
    def key(self) -> Hashable:
        """Names the head in prefix-cache keys: ("image", ids) != ("audio", ids)."""
        ...

    @property
    def placeholder_id(self) -> int:
        """The token id a media token holds in the sequence."""
        ...

    def codes(self, hidden: torch.Tensor, pick: CodesPick | None = None) -> torch.Tensor:
        """Final hidden states [B, hidden] -> codebook ids [B, K] int64, each level's ids
        chosen by ``pick`` from its logits (None: greedy). A head whose levels have no logits
        of their own to pick from may ignore it."""
        ...

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """Codebook ids [B, K] -> input rows [B, hidden] for the next step."""
        ...


class Guidance(NamedTuple):
    """Classifier-free guidance: the unconditional prompt and the scale s of
    uncond + s * (cond - uncond). On a continued request whose kept sequence already has an
    unconditional partner, prompt_token_ids (and embeddings) extend that partner instead."""

    prompt_token_ids: SequenceOf[int]
    scale: float
    embeddings: list[EmbeddingSpan] | None = None
    # keep_context only: the unconditional prompt's K/V lent by another process.
    lease: KVLease | dict | None = None
    # Block steps: False returns both halves' hidden states, [cond; uncond] (2N rows), for
    # a caller that combines after its own head (HunyuanImage-3 combines velocities).
    combine: bool = True


class BlockRows(NamedTuple):
    """A block step's inputs: rows [N, hidden] at rotary positions [N], or [N, 2] (y, x)
    for a model with 2D rotary positions. The first causal_rows rows attend causally (the
    context, themselves and the rows before them: HunyuanImage-3's <timestep>), the rest
    to everything."""

    rows: torch.Tensor
    positions: torch.Tensor
    causal_rows: int = 0


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond), in cond's dtype."""
    return uncond + scale * (cond - uncond)


def end_code(head: CodesHead) -> int | None:
    """The level-0 id with which a head ends its media (``head.end_code``: LongCat-Next's
    end-of-audio flag, codebook size + 1's last class), or None: its count ends them."""
    return getattr(head, "end_code", None)


def codes_key(head: CodesHead, ids: torch.Tensor) -> Hashable:
    """The prefix-cache key of one media token with ids [K]."""
    return (head.key, tuple(int(i) for i in ids.tolist()))
