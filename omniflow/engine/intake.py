"""Checks on what a request brings, against the engine's limits, made before anything is
queued or changed: each error names the request and the field."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import NamedTuple

import torch

from omniflow.engine.sequence import EmbeddingSpan


class Limits(NamedTuple):
    vocab_size: int
    hidden_size: int
    max_model_len: int
    capacity_tokens: int  # tokens the KV cache holds
    max_num_batched_tokens: int
    positions_2d: bool = False  # the model takes 2D (y, x) rotary positions


def checked_tokens(
    request_id: str, token_ids: SequenceOf[int], limits: Limits, *, allow_empty: bool = False
) -> list[int]:
    """The ids as ints, each inside the vocabulary."""
    tokens = [int(t) for t in token_ids]
    if not tokens and not allow_empty:
        raise ValueError(f"request {request_id}: prompt_token_ids is empty")
    for index, token in enumerate(tokens):
        if not 0 <= token < limits.vocab_size:
            raise ValueError(
                f"request {request_id}: prompt_token_ids[{index}]={token} is outside the "
                f"vocabulary [0, {limits.vocab_size})"
            )
    return tokens


def check_length(request_id: str, prompt_len: int, max_tokens: int, limits: Limits) -> None:
    """A prompt of prompt_len tokens plus max_tokens more fit the model and the KV cache."""
    total = prompt_len + max_tokens
    for limit, name in (
        (limits.max_model_len, f"max_model_len {limits.max_model_len}"),
        (limits.capacity_tokens, f"the KV cache's {limits.capacity_tokens} tokens"),
    ):
        if total > limit:
            raise ValueError(
                f"request {request_id}: prompt ({prompt_len}) + max_tokens ({max_tokens}) "
                f"exceeds {name}"
            )


def checked_spans(
    request_id: str, spans: list[EmbeddingSpan], prompt_len: int, limits: Limits
) -> list[EmbeddingSpan]:
    """Embedding spans of [n, hidden] rows, each inside the prompt's prompt_len positions."""
    hidden = limits.hidden_size
    for index, span in enumerate(spans):
        shape = tuple(span.embeddings.shape)
        if len(shape) != 2 or shape[1] != hidden:
            raise ValueError(
                f"request {request_id}: embeddings[{index}] has shape {shape}, "
                f"expected [n, {hidden}]"
            )
        if span.start < 0 or span.start + shape[0] > prompt_len:
            raise ValueError(
                f"request {request_id}: embeddings[{index}] covers positions "
                f"{span.start}..{span.start + shape[0] - 1}, outside the prompt"
            )
        if span.positions is not None and (
            not limits.positions_2d or tuple(span.positions.shape) != (shape[0], 2)
        ):
            expected = f"[{shape[0]}, 2]" if limits.positions_2d else "None (1D rotary model)"
            raise ValueError(
                f"request {request_id}: embeddings[{index}].positions has shape "
                f"{list(span.positions.shape)}, expected {expected}"
            )
    return list(spans)


def check_block(
    request_id: str,
    rows: torch.Tensor,
    positions: torch.Tensor,
    halves: int,
    context_len: int,
    limits: Limits,
) -> None:
    """Block rows [n, hidden] with positions [n] (or [n, 2] for a model with 2D rotary
    positions, limits.positions_2d), for a context of context_len tokens in this engine's pages, run
    by one or two (guided) sequences in a step."""
    hidden = limits.hidden_size
    count = rows.shape[0] if rows.dim() == 2 else -1
    shapes = [(count,), (count, 2)] if limits.positions_2d else [(count,)]
    if rows.dim() != 2 or rows.shape[1] != hidden or tuple(positions.shape) not in shapes:
        expected = "[n] or [n, 2]" if limits.positions_2d else "[n]"
        raise ValueError(
            f"request {request_id}: block rows {list(rows.shape)} / positions "
            f"{list(positions.shape)}, expected [n, {hidden}] / {expected}"
        )
    if halves * rows.shape[0] > limits.max_num_batched_tokens:
        raise ValueError(
            f"request {request_id}: {halves} x {rows.shape[0]} block rows exceed "
            f"max_num_batched_tokens {limits.max_num_batched_tokens}"
        )
    if context_len + rows.shape[0] > limits.capacity_tokens:
        raise ValueError(f"request {request_id}: context + block exceed the KV cache")
