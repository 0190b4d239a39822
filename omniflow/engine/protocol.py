"""The protocol every omniflow LLM backend implements, and what a step reports.

A backend takes requests (prompt token ids, plus precomputed embeddings for multimodal
placeholder positions), advances all of them by one `step()` at a time, and reports new
tokens per request as `TokenDelta`s; `abort` drops a request at the next step boundary.
Each request ends with exactly one delta whose finish_reason is set.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any, NamedTuple, Protocol

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


class EngineBackend(Protocol):
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams | None = None,
        embeddings: list[EmbeddingSpan] | None = None,
    ) -> None:
        """Queue a request; raises ValueError naming the field and request if invalid."""
        ...

    def step(self) -> list[TokenDelta]:
        """Run one scheduled model step; returns what each touched request produced."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a request; its final delta (finish_reason "abort") comes with the next step."""
        ...

    def has_unfinished_requests(self) -> bool: ...
