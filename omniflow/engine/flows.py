"""The request flows a Sequence can take part in, each one small object of its own state.

A `Sequence` (sequence.py) holds what every request has: tokens, pages, progress, sampling.
What one flow adds lives here, in one slot of the sequence per flow (None: not in it):

- `GuidedPair` (`Sequence.pair`, classifier-free guidance): the conditional leader and its
  unconditional follower, admitted, preempted and freed together; their hidden states are
  combined (`heads.guided`) before the leader's head. Both members point at the one pair.
- `MediaOutput` (`Sequence.media`): a codes head generates the request's tokens (image or
  audio codes) instead of lm_head + sampler; the ids of each generated token; with
  `spoken`, a text token beside each one too (spoken.py); with `row_end`, a plain token
  after each row of media tokens (an image's newline: no codes, its own embedding).
- `BlockStep` (`Sequence.block_step`): a pending block step over a kept context, and the
  context id the sequence is kept under again once the step is done (kept.py).
- `Ending` (`Sequence.ending`): what a finished sequence's KV does: kept for a
  continuation or block steps (status KEPT), and/or lent to another process's pid.

A lent context (`Sequence.lent`, another process's pages read in place) is page state, not
a flow: it stays on the sequence next to `page_ids`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from omniflow.engine.heads import BlockRows, CodesHead

if TYPE_CHECKING:
    from omniflow.engine.sequence import Sequence
    from omniflow.engine.spoken import SpokenText


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
    codes: list[torch.Tensor] = field(default_factory=list)  # ids [K] per media token
    at: list[int] = field(default_factory=list)  # each media token's output index
    spoken: SpokenText | None = None  # text beside the codes: its first token has none
    # (token, width): that token after every width media tokens (an image's row end)
    row_end: tuple[int, int] | None = None
    ended: bool = False  # the head's end code came (engine/heads.py end_code): no more tokens
    _stacked: torch.Tensor | None = None  # codes as one tensor [N, K], grown by made()

    def codes_since(self, step: int) -> list[torch.Tensor]:
        """The codes of output tokens step.. (a spoken request's first token and row ends
        have none)."""
        return self.codes[bisect.bisect_left(self.at, step) :]

    def made(self) -> torch.Tensor | None:
        """Every code made so far as one tensor [N, K] (None before the first), stacked
        once: the rows since the last call are added to it."""
        if not self.codes:
            return None
        done = 0 if self._stacked is None else self._stacked.shape[0]
        if done < len(self.codes):
            new = torch.stack(self.codes[done:])
            self._stacked = new if self._stacked is None else torch.cat((self._stacked, new))
        return self._stacked

    def ends_row(self, made: int) -> bool:
        """Whether the output token after ``made`` ones is a row end."""
        return self.row_end is not None and (made + 1) % (self.row_end[1] + 1) == 0


@dataclass(eq=False, slots=True)
class BlockStep:
    rows: BlockRows
    context_id: str | None  # the leader's: kept again under it (None on a follower)


@dataclass(eq=False, slots=True)
class Ending:
    keep: bool = False  # hold the pages for a continuation (KEPT) until released
    lend_kv_to: int | None = None  # a pid: lease the request's KV to it
