"""One request's state inside the engine: its tokens, its pages, how far it has computed."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from omniflow.engine.flows import BlockStep, Ending, GuidedPair, MediaOutput
from omniflow.engine.heads import BlockRows, CodesHead, codes_key
from omniflow.engine.sampling_params import SamplingParams


class EmbeddingSpan(NamedTuple):
    """Precomputed input embeddings [n, hidden] that replace the token embeddings at prompt
    positions start..start+n-1 (multimodal placeholders). content_hash keys the span in the
    prefix cache so equal placeholder ids of different media never share pages; a list keys
    each row on its own (media tokens a codes head generated: one key per token).
    positions: the rows' 2D rotary positions [n, 2] (y, x), for a model with 2D positions
    (HunyuanImage-3's condition image); None: their token indices."""

    start: int
    embeddings: torch.Tensor
    content_hash: Hashable | list[Hashable] | None = None
    positions: torch.Tensor | None = None


def key_spans(extra_keys: list[Hashable | None], spans: list[EmbeddingSpan]) -> None:
    """Write each span's prefix keys at its positions (one per row for a list of keys)."""
    for span in spans:
        key = span.content_hash
        for index in range(len(span.embeddings)):
            extra_keys[span.start + index] = key[index] if isinstance(key, list) else key


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    KEPT = "kept"  # done, its pages held for a continuation or block steps (engine.kept)
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        embedding_spans: list[EmbeddingSpan] | None = None,
    ):
        self._request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt followed by output
        self.params = params
        self.embedding_spans = embedding_spans or []
        self.status = SequenceStatus.WAITING
        self.page_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V sit in page_ids
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[dict[int, float]] = []
        self.extra_keys: list[Hashable | None] | None = None
        # Input rows of generated media tokens, by position (they replace the placeholder's).
        self.input_rows: dict[int, torch.Tensor] = {}
        # A lent context: its prefix K/V are another process's pages (KVLeaseView), read by
        # block steps; the sequence itself holds no tokens, only its block rows' slots.
        self.lent: Any = None
        self.text_stream: Any = None  # the output's text so far, for stop strings (TextStream)
        # The flows it takes part in (flows.py); None: not in that flow.
        self.pair: GuidedPair | None = None
        self.media: MediaOutput | None = None
        self.block_step: BlockStep | None = None
        self.ending = Ending()
        self._key_spans(self.embedding_spans)

    def _key_spans(self, spans: list[EmbeddingSpan]) -> None:
        if not any(span.content_hash is not None for span in spans):
            return
        if self.extra_keys is None:
            self.extra_keys = [None] * len(self.token_ids)
        key_spans(self.extra_keys, spans)

    @property
    def partner(self) -> Sequence | None:
        """The other half of its guided pair."""
        return None if self.pair is None else self.pair.other(self)

    @property
    def follows(self) -> bool:
        """Whether it is the unconditional half of a guided pair."""
        return self.pair is not None and self.pair.follower is self

    @property
    def head(self) -> CodesHead | None:
        """The codes head generating its tokens; None: text (lm_head + sampler)."""
        return None if self.media is None else self.media.head

    @property
    def block(self) -> BlockRows | None:
        """A pending block step's rows over this prefix."""
        return None if self.block_step is None else self.block_step.rows

    @property
    def request_id(self) -> str:
        """Set once, at construction: a request id never changes. A kept context that goes
        on under another request does so as its `successor`."""
        return self._request_id

    def successor(self, request_id: str) -> Sequence:
        """This sequence's context (tokens, pages, computed state, its pair) as a new
        Sequence of request request_id. This one is spent: it gives up its pages, lent view
        and partner, which now point at the successor."""
        successor = Sequence.__new__(Sequence)
        successor.__dict__.update(self.__dict__, _request_id=request_id)
        if self.pair is not None:
            self.pair.replace(self, successor)
        self.pair, self.page_ids, self.lent = None, [], None
        return successor

    def continued(
        self,
        request_id: str,
        extra_token_ids: list[int],
        params: SamplingParams,
        spans: list[EmbeddingSpan],
    ) -> Sequence:
        """A kept sequence continued as a new request that goes on from all of it: its
        tokens so far (the last one not computed yet) followed by extra_token_ids become the
        prompt. Returns the successor that runs it (this one is spent)."""
        sequence = self.successor(request_id)
        sequence._continue_with(extra_token_ids, params, spans)
        return sequence

    def _continue_with(
        self, extra_token_ids: list[int], params: SamplingParams, spans: list[EmbeddingSpan]
    ) -> None:
        self.token_ids = self.token_ids + extra_token_ids
        self.prompt_token_ids = list(self.token_ids)
        self.output_token_ids, self.output_logprobs, self.output_top_logprobs = [], [], []
        self.media = None
        self.text_stream = None
        if self.extra_keys is not None:
            self.extra_keys = self.extra_keys + [None] * len(extra_token_ids)
        self.embedding_spans = self.embedding_spans + spans
        self._key_spans(spans)
        self.params = params
        self.finish_reason = self.stop_reason = None
        self.num_cached_tokens = None
        self.block_step = None
        self.ending = Ending()
        if self.num_pending_tokens == 0 and self.num_computed_tokens:
            # Kept after block steps, nothing new: the last token runs again for its state.
            self.num_computed_tokens -= 1

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model: the prompt (or the part not yet prefilled,
        or everything again after a preemption), or just the last sampled token."""
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(
        self,
        token_id: int,
        logprob: float,
        top_logprobs: dict[int, float] | None,
        key: Hashable | None = None,
    ):
        """key: the token's prefix-cache extra key (a generated media token's)."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        if key is not None and self.extra_keys is None:
            self.extra_keys = [None] * (len(self.token_ids) - 1)
        if self.extra_keys is not None:
            self.extra_keys.append(key)

    def append_codes(
        self, head: CodesHead, ids: torch.Tensor, row: torch.Tensor, text: int | None = None
    ) -> None:
        """One generated media token: ids [K], its input row [hidden]; ``text``: the text
        token spoken with it, whose embedding the row holds (spoken.py)."""
        assert self.media is not None, "codes of a sequence without a codes head"
        self.input_rows[len(self.token_ids)] = row
        self.media.codes.append(ids)
        self.media.at.append(len(self.output_token_ids))
        key = codes_key(head, ids)
        self.append_token(head.placeholder_id, 0.0, None, key if text is None else (key, text))

    def append_row(self, token_id: int, row: torch.Tensor, key: Hashable) -> None:
        """A generated token whose input row [hidden] is given, not its embedding."""
        self.input_rows[len(self.token_ids)] = row
        self.append_token(token_id, 0.0, None, key)
