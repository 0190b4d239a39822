"""Kept contexts and KV lending, the LLMEngine's part of them (LLMEngine inherits it): a prompt
held as a kept context for block steps (keep_context, block_step), its K/V lent by another
process on this host (a KVLease opened as a view), or this engine's finished context lent to
another (_lend)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence as SequenceOf

import torch

from omniflow.engine.flows import BlockStep, GuidedPair, MediaOutput
from omniflow.engine.heads import BlockRows, Guidance
from omniflow.engine.intake import Limits, check_block, check_length, checked_spans, checked_tokens
from omniflow.engine.paged_attention import KVCache
from omniflow.engine.sampling_params import SamplingParams
from omniflow.engine.scheduler import Scheduler
from omniflow.engine.sequence import EmbeddingSpan, Sequence, SequenceStatus
from omniflow.kv.allocator import PageAllocator
from omniflow.kv.share import KVLease, KVLeaseView, LeaseBook
from omniflow.memory.pool import PagePool
from omniflow.models import DecoderLM


class KeptContexts:
    """The request checks, guided pairs, kept contexts and KV lending of an LLMEngine, which
    sets the attributes below."""

    cache: KVCache
    allocator: PageAllocator
    scheduler: Scheduler
    limits: Limits
    leases: LeaseBook | None
    kv_pool: PagePool | None
    kept: dict[str, Sequence]
    sequences: dict[str, Sequence]
    model: DecoderLM | None

    def _check_served(self, request_id: str, **used: object) -> None:
        """Requests that need what backend "sglang" does not run are refused, named."""
        if self.model is None:
            fields = [name for name, value in used.items() if value]
            if fields:
                raise ValueError(
                    f"request {request_id}: field {fields[0]} is not served by engine backend "
                    "'sglang' (text outputs only)"
                )

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.sequences or request_id in self.kept:
            raise ValueError(f"request {request_id}: request_id is already in use")

    def _checked(
        self,
        request_id: str,
        kept: Sequence | None,
        token_ids: SequenceOf[int],
        embeddings: list[EmbeddingSpan] | None,
        params: SamplingParams,
    ) -> tuple[list[int], list[EmbeddingSpan]]:
        """A new prompt, or the tokens that extend a kept sequence, and their spans."""
        base = 0 if kept is None else len(kept)
        tokens = checked_tokens(request_id, token_ids, self.limits, allow_empty=kept is not None)
        check_length(request_id, base + len(tokens), params.max_tokens, self.limits)
        spans = checked_spans(request_id, embeddings or [], base + len(tokens), self.limits)
        return tokens, spans

    def _guide(
        self,
        sequence: Sequence,
        unconditional: tuple[list[int], list[EmbeddingSpan]] | None,
        scale: float | None,
    ) -> None:
        """Pair a sequence with its unconditional follower (checked prompt or extension): a
        kept one extended, or a new one. None: no guidance (a kept follower is freed)."""
        follower = sequence.partner
        if unconditional is None or scale is None:
            if follower is not None:  # a kept pair continued without guidance: drop that half
                sequence.pair = follower.pair = None
                self.scheduler.finish(follower, "abort")
            return
        rid = f"{sequence.request_id}/uncond"
        tokens, spans = unconditional
        if follower is not None:
            follower = follower.continued(rid, tokens, sequence.params, spans)
        else:
            follower = Sequence(rid, tokens, sequence.params, spans)
            sequence.pair = follower.pair = GuidedPair(sequence, follower)
        assert sequence.pair is not None
        sequence.pair.scale = float(scale)
        follower.media = None if sequence.media is None else MediaOutput(sequence.media.head)

    def keep_context(
        self,
        context_id: str,
        prompt_token_ids: SequenceOf[int],
        embeddings: list[EmbeddingSpan] | None = None,
        guidance: Guidance | None = None,
        lease: KVLease | dict | None = None,
    ) -> None:
        """Hold a prompt (and its unconditional half) as a kept context for block steps,
        without running it: the first block step computes it, the next ones reuse it.

        lease (and guidance.lease for the unconditional half): the prompt's K/V, lent by
        another process on this host (a `KVLease` for this pid, from the deployment's
        kv_pool given to this engine). That half is never computed nor copied here: block
        steps read the lent pages in place (rows_forwarded counts their rows alone), and
        `release` or `close` hands the lease back. prompt_token_ids must be the lent
        tokens (as many as the lease holds); embeddings do not apply to a lent half."""
        uncond_lease = None if guidance is None else guidance.lease
        halves = [(context_id, prompt_token_ids, embeddings, lease)]
        if guidance is not None:
            halves.append(
                (
                    f"{context_id}/uncond",
                    guidance.prompt_token_ids,
                    guidance.embeddings,
                    uncond_lease,
                )
            )
        params = SamplingParams(max_tokens=1)
        views: list[KVLeaseView | None] = []
        try:  # refused, every lease given goes back (none is left for `release` to free)
            self._check_unused(context_id)
            self._check_served(context_id, block_steps=True)
            checked = []
            for rid, tokens, spans, half_lease in halves:
                if half_lease is None:
                    checked.append(self._checked(rid, None, tokens, spans, params))
                else:  # lent: the tokens take none of this engine's pages
                    checked.append((checked_tokens(rid, tokens, self.limits), []))
            for (rid, _, spans, half_lease), (tokens, _) in zip(halves, checked, strict=True):
                # _open_lease closes what it opened if it refuses it
                views.append(None if half_lease is None else self._open_lease(rid, half_lease))
                if half_lease is not None and spans:
                    raise ValueError(f"request {rid}: embeddings do not apply to a lent prompt")
                view = views[-1]
                if view is not None and view.lease.num_tokens != len(tokens):
                    raise ValueError(
                        f"request {rid}: lease holds {view.lease.num_tokens} tokens, "
                        f"prompt_token_ids {len(tokens)}"
                    )
        except BaseException:
            for view in views:
                if view is not None:
                    view.close()
            self._give_back([half[3] for half in halves[len(views) :]])
            raise
        tokens, spans = checked[0]
        sequence = Sequence(context_id, [] if views[0] else tokens, params, spans)
        sequence.lent = views[0]
        unconditional = None
        if guidance is not None:
            uncond_tokens, uncond_spans = checked[1]
            unconditional = ([] if views[1] else uncond_tokens, uncond_spans)
        self._guide(sequence, unconditional, None if guidance is None else guidance.scale)
        if sequence.pair is not None and guidance is not None:
            sequence.pair.combine = guidance.combine
        if sequence.partner is not None:
            sequence.partner.lent = views[1]
        for member in (sequence, sequence.partner):
            if member is not None:
                member.status = SequenceStatus.KEPT
        self.kept[context_id] = sequence

    def _give_back(self, leases: list[KVLease | dict | None]) -> None:
        """Leases never opened here, handed back unread (the lender unlocks the pages)."""
        if self.kv_pool is None:
            return
        for lease in leases:
            if lease is not None:
                with contextlib.suppress(Exception):  # not a lease of this pool: nothing held
                    KVLeaseView(self.kv_pool, lease).close()

    def _open_lease(self, request_id: str, lease: KVLease | dict) -> KVLeaseView:
        """A view of lent K/V, checked against this engine's cache layout."""
        if self.kv_pool is None:
            raise ValueError(
                f"request {request_id}: lease needs the engine built with the deployment's kv_pool"
            )
        view = KVLeaseView(self.kv_pool, lease)
        layers, heads, _, _, dim = self.cache.keys.shape
        got = (view.keys.shape[0], view.keys.shape[1], view.keys.shape[-1], view.keys.dtype)
        if got != (layers, heads, dim, self.cache.keys.dtype):
            view.close()
            raise ValueError(
                f"request {request_id}: lease K/V (layers, kv heads, head dim, dtype) {got} "
                f"differ from this engine's {(layers, heads, dim, self.cache.keys.dtype)}"
            )
        return view

    def block_step(
        self,
        request_id: str,
        context_id: str,
        rows: torch.Tensor,
        positions: torch.Tensor,
        causal_rows: int = 0,
    ) -> None:
        """Queue a block step over the kept request context_id: rows [N, hidden] at rotary
        positions [N] ([N, 2] (y, x) for a model with 2D positions, `positions_2d`) attend
        bidirectionally among themselves and causally to the context's tokens (computed
        once, or lent, and reused by every block step). Its one delta carries the rows'
        final hidden states (before the final norm on a model with `block_rows_unnormed`;
        guided: combined with the context's unconditional half, which
        runs the same rows, or stacked [cond; uncond] with Guidance.combine False); the
        context is kept again under context_id. The first causal_rows rows attend causally
        (the context, themselves and the rows before them), not to the later rows."""
        sequence = self.kept.get(context_id)
        if sequence is None:
            raise ValueError(f"request {request_id}: context {context_id!r} is not kept")
        self._check_unused(request_id)
        halves = 2 if sequence.partner is not None else 1
        check_block(request_id, rows, positions, halves, len(sequence), self.limits)
        if not 0 <= causal_rows <= rows.shape[0]:
            raise ValueError(
                f"request {request_id}: causal_rows={causal_rows} outside [0, {rows.shape[0]}]"
            )
        del self.kept[context_id]
        block = BlockRows(rows.to(self.cache.keys.dtype), positions.to(torch.long), causal_rows)
        sequence = sequence.successor(request_id)
        sequence.block_step = BlockStep(block, context_id)
        if sequence.partner is not None:
            sequence.partner.block_step = BlockStep(block, None)
        self.sequences[request_id] = sequence
        self.scheduler.requeue(sequence)

    def _lend(self, sequence: Sequence, borrower_pid: int) -> KVLease:
        """Lease the KV of a finishing sequence's computed tokens: full pages by reference
        (held in the prefix cache until the borrower lets go), the rest copied."""
        assert self.leases is not None
        size, computed = self.cache.page_size, sequence.num_computed_tokens
        full = computed // size * size
        extra = None if sequence.extra_keys is None else sequence.extra_keys[:full]
        self.allocator.insert(sequence.token_ids[:full], sequence.page_ids, extra)
        match = self.allocator.match_prefix(sequence.token_ids[:full], extra)
        if match.lower:
            self.allocator.cancel_promotion(match.lower)
        slots = torch.tensor(
            self.cache.slots(sequence.page_ids, match.num_tokens, computed),
            dtype=torch.long,
            device=self.cache.keys.device,
        )
        layers, heads, pages, _, dim = self.cache.keys.shape
        flat = (layers, heads, pages * size, dim)
        tail = torch.stack(
            [
                self.cache.keys.view(flat).index_select(2, slots),
                self.cache.values.view(flat).index_select(2, slots),
            ]
        )
        return self.leases.lend(
            self.cache.keys, self.cache.values, match.page_ids, size, tail, borrower_pid
        )


def close_lent(sequence: Sequence) -> None:
    """Hand back the leases a context (and its unconditional half) borrowed."""
    for member in (sequence, sequence.partner):
        if member is not None and member.lent is not None:
            member.lent.close()
            member.lent = None
