"""The protocol every omniflow LLM backend implements, and what a step reports.

A backend takes requests (prompt token ids, plus precomputed embeddings for multimodal
placeholder positions, and an output head), advances all of them by one `step()` at a
time, and reports new tokens per request as `TokenDelta`s; `abort` drops a request at the
next step boundary. Each request ends with exactly one delta whose finish_reason is set.
It owns KV and sampling for every kind of generation: text, multi-codebook media tokens
(codes heads), guided pairs and block steps (see heads.py).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any, NamedTuple, Protocol

import torch

from omniflow.engine.heads import CodesHead, Guidance
from omniflow.engine.sampling_params import SamplingParams
from omniflow.engine.sequence import EmbeddingSpan


class TokenDelta(NamedTuple):
    request_id: str
    token_ids: list[int]  # tokens produced by this step (empty on abort)
    logprobs: list[float]  # log-probability of each of those tokens
    top_logprobs: list[dict[int, float]] | None  # when SamplingParams.logprobs is set
    finish_reason: str | None  # None while running; "stop", "length" or "abort" at the end
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    kv_lease: Any = None  # on the last delta of a request added with lend_kv_to: a KVLease
    codes: Any = None  # a codes head's request: the new media tokens' ids [n, K] (a tensor)
    hidden: Any = None  # a block step's one delta: its rows' final hidden states [N, hidden]
    # a spoken request's (engine/spoken.py): per new token, the text token made with it
    # (NO_TEXT -1 once the text has ended)
    text_ids: list[int] | None = None


class EngineBackend(Protocol):
    # Counters: prompt_tokens_computed, rows_forwarded, steps (written by the engine thread).
    stats: dict[str, int]
    leases: Any  # the KV leases it lent (kv.share.LeaseBook), None when it cannot lend

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams | None = None,
        embeddings: list[EmbeddingSpan] | None = None,
        *,
        head: CodesHead | None = None,
        guidance: Guidance | None = None,
        keep: bool = False,
        continue_from: str | None = None,
    ) -> None:
        """Queue a request; raises ValueError naming the field and request if invalid.

        head: None for text (lm_head + sampler), else a codes head: each step one media
        token over the paged KV, batched with text requests, its K/V kept in the prefix
        cache under its ids. guidance: a paired unconditional sequence, always in the same
        step; hidden states combined before the head, both append the same token.
        keep: hold the finished sequence's pages; continue_from: go on from a kept one
        (another head, more prompt) without recomputing it."""
        ...

    def keep_context(
        self,
        context_id: str,
        prompt_token_ids: SequenceOf[int],
        embeddings: list[EmbeddingSpan] | None = None,
        guidance: Guidance | None = None,
        lease: Any = None,
    ) -> None:
        """Hold a prompt as a kept context for block steps (computed by the first one, or
        lent by another process: a KVLease, read in place)."""
        ...

    def block_step(
        self,
        request_id: str,
        context_id: str,
        rows: torch.Tensor,
        positions: torch.Tensor,
        causal_rows: int = 0,
    ) -> None:
        """Queue N rows that attend bidirectionally among themselves and causally to the kept
        context's tokens (computed once for all block steps); their K/V are scratch, never
        in the prefix cache. The one delta's ``hidden`` holds their final hidden states."""
        ...

    def release(self, request_id: str) -> None:
        """Free a kept request's pages."""
        ...

    def step(self) -> list[TokenDelta]:
        """Run one scheduled model step; returns what each touched request produced."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a request; its final delta (finish_reason "abort") comes with the next step."""
        ...

    def has_unfinished_requests(self) -> bool: ...
