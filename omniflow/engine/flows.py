"""The request flows a Sequence can take part in, each one small object of its own state.

A `Sequence` (sequence.py) holds what every request has: tokens, pages, progress, sampling.
What one flow adds lives here, in one slot of the sequence per flow (None: not in it):

- `GuidedPair` (`Sequence.pair`, classifier-free guidance): the conditional leader and its
  unconditional follower, admitted, preempted and freed together; their hidden states are
  combined (`heads.guided`) before the leader's head. Both members point at the one pair.
- `MediaOutput` (`Sequence.media`): a codes head generates the request's tokens (image or
  audio codes) instead of lm_head + sampler; the ids of each generated token.
- `BlockStep` (`Sequence.block_step`): a pending block step over a kept context, and the
  context id the sequence is kept under again once the step is done (kept.py).
- `Ending` (`Sequence.ending`): what a finished sequence's KV does: kept for a
  continuation or block steps (status KEPT), and/or lent to another process's pid.

A lent context (`Sequence.lent`, another process's pages read in place) is page state, not
a flow: it stays on the sequence next to `page_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from omniflow.engine.heads import BlockRows, CodesHead

if TYPE_CHECKING:
    from omniflow.engine.sequence import Sequence


@dataclass(eq=False, slots=True)
class GuidedPair:
    leader: Sequence  # the conditional half: it samples, for both
    follower: Sequence  # the unconditional half (request id "<leader's>/uncond")
    scale: float = 1.0  # uncond + scale * (cond - uncond)
    combine: bool = True  # a block step: combine the halves (else stack [cond; uncond])

    def other(self, member: Sequence) -> Sequence:
        return self.follower if member is self.leader else self.leader

    def replace(self, old: Sequence, new: Sequence) -> None:
        """A member goes on as its successor."""
        if old is self.leader:
            self.leader = new
        elif old is self.follower:
            self.follower = new


@dataclass(eq=False, slots=True)
class MediaOutput:
    head: CodesHead
    codes: list[torch.Tensor] = field(default_factory=list)  # ids [K] per generated token


@dataclass(eq=False, slots=True)
class BlockStep:
    rows: BlockRows
    context_id: str | None  # the leader's: kept again under it (None on a follower)


@dataclass(eq=False, slots=True)
class Ending:
    keep: bool = False  # hold the pages for a continuation (KEPT) until released
    lend_kv_to: int | None = None  # a pid: lease the request's KV to it
