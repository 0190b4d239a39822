"""One request's state inside the engine: its tokens, its pages, how far it has computed."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import NamedTuple

import torch

from omniflow.engine.sampling_params import SamplingParams


class EmbeddingSpan(NamedTuple):
    """Precomputed input embeddings [n, hidden] that replace the token embeddings at prompt
    positions start..start+n-1 (multimodal placeholders). content_hash keys the span in the
    prefix cache so equal placeholder ids of different media never share pages."""

    start: int
    embeddings: torch.Tensor
    content_hash: Hashable | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        embedding_spans: list[EmbeddingSpan] | None = None,
    ):
        self.request_id = request_id
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
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.extra_keys: list[Hashable | None] | None = None
        self.lend_kv_to: int | None = None  # a pid: lease this request's KV to it at the end
        if any(span.content_hash is not None for span in self.embedding_spans):
            self.extra_keys = [None] * len(self.token_ids)
            for span in self.embedding_spans:
                for position in range(span.start, span.start + len(span.embeddings)):
                    self.extra_keys[position] = span.content_hash

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

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None):
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        if self.extra_keys is not None:
            self.extra_keys.append(None)
