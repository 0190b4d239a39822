"""The torch backend: paged KV, continuous batching, sampling, prefix caching; output heads
(text, codes), guided pairs and block steps (engine/heads.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path

import torch

from omniflow.engine.heads import BlockRows, CodesHead, Guidance
from omniflow.engine.intake import Limits, check_block, check_length, checked_spans, checked_tokens
from omniflow.engine.kv_pages import KVCachePages
from omniflow.engine.model_runner import ModelRunner, StepOutput
from omniflow.engine.outputs import (
    append_from_hidden,
    append_text,
    block_outputs,
    check_stop,
    delta_of,
)
from omniflow.engine.paged_attention import KVCache
from omniflow.engine.protocol import TokenDelta
from omniflow.engine.sampler import Sampler
from omniflow.engine.sampling_params import SamplingParams
from omniflow.engine.scheduler import Scheduler
from omniflow.engine.sequence import EmbeddingSpan, Sequence, SequenceStatus
from omniflow.engine.sglang_backend import UNSERVED, SGLangRunner, sglang_missing
from omniflow.kv.allocator import PageAllocator
from omniflow.kv.pull_cost import RateMeter
from omniflow.kv.radix import RadixPrefixCache
from omniflow.kv.share import KVLease, KVLeaseView, LeaseBook
from omniflow.kv.tiers import KVTiers
from omniflow.memory.lease import Lease
from omniflow.memory.pool import PagePool
from omniflow.models import DecoderLM, MLAConfig, TextTokenizer, load_decoder, load_tokenizer
from omniflow.models.loader import load_config, resolve_device, resolve_dtype


@dataclass
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int | None = None  # None: as many as kv_cache_bytes allows, capped (below)
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the config's max_position_embeddings
    enable_prefix_caching: bool = True
    prefix_cache: str = "radix"  # the only kind (cache/prefix.py); the llm role still passes it
    seed: int | None = None  # for requests without their own seed
    # KV tiers below the device (radix prefix cache only): evicted pages are copied to the
    # host page pool (the deployment's, or a private one), then to SSD, before being dropped.
    host_kv_bytes: int = 0  # 0: no host tier, evicted pages are dropped
    ssd_kv_dir: str | None = None
    ssd_kv_bytes: int = 0
    # K/V tensors in the given kv_pool (CPU), so requests can lend their KV to other
    # processes on the host (add_request's lend_kv_to).
    share_kv: bool = False
    # A lease lent and not claimed by its borrower within this many seconds is revoked
    # (cache/kv_share.py): one lost on its way holds no page for longer.
    lease_claim_s: float = 60.0
    # bf16 on CPU: run norms, rotary, silu, K/V writes and decode attention on omniflow's
    # C kernels (omniflow.kernels, built on first use); PyTorch ops where they are unavailable.
    cpu_kernels: bool = True
    # On CPU the runner re-lays projection weights (input-major copies in float32, packed
    # in bf16). False: leave every weight where it is, e.g. in shared pages another process
    # maps too (one copy of the backbone for two roles).
    relayout_weights: bool = True
    # "torch": omniflow's model; "sglang": SGLang's model forward over the same pages, with
    # this engine's scheduler, prefix cache and sampler (engine/sglang_backend.py).
    backend: str = "torch"
    # Compute Flow operations the caller will use beyond text requests: "codes_heads",
    # "guidance", "block_steps", "embeddings". A backend that cannot serve one refuses
    # the config here, not the request later.
    flow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.lease_claim_s > 0:
            raise ValueError(
                f"engine config field lease_claim_s must be > 0 seconds, not {self.lease_claim_s!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"engine config field backend must be one of {BACKENDS}, not {self.backend!r}"
            )
        unknown = [op for op in self.flow if op not in FLOW_OPERATIONS]
        if unknown:
            raise ValueError(
                f"engine config field flow: unknown operation(s) {unknown}; "
                f"known: {FLOW_OPERATIONS}"
            )
        if self.backend == "sglang":
            unserved = [op for op in self.flow if op in UNSERVED]
            if unserved:
                raise ValueError(
                    f"engine config field flow: backend 'sglang' cannot serve "
                    f"{', '.join(unserved)} (text outputs only); use backend 'torch'"
                )
            missing = sglang_missing()
            if missing:
                raise ValueError(f"engine config field backend 'sglang' needs {missing}")


PREFIX_CACHES = ("radix",)
PREFILL_SAMPLE_TOKENS = 16  # steps with fewer prompt tokens say little about prefill speed
BACKENDS = ("torch", "sglang")
FLOW_OPERATIONS = ("codes_heads", "guidance", "block_steps", "embeddings")


def _kv_tiers(config: EngineConfig, cache: KVCache, pool: PagePool | None) -> KVTiers | None:
    if config.host_kv_bytes <= 0:
        return None
    return KVTiers.create(
        KVCachePages(cache), config.host_kv_bytes, config.ssd_kv_dir, config.ssd_kv_bytes, pool
    )


class LLMEngine:
    def __init__(
        self,
        model: str | Path | DecoderLM,
        config: EngineConfig | None = None,
        tokenizer: TextTokenizer | None = None,
        kv_pool: PagePool | None = None,
    ):
        self.config = config = config or EngineConfig()
        if config.prefix_cache not in PREFIX_CACHES:
            raise ValueError(
                f"engine config field prefix_cache must be one of {PREFIX_CACHES}, "
                f"not {config.prefix_cache!r}"
            )
        sglang = config.backend == "sglang"
        if isinstance(model, (str, Path)):
            path = Path(model)
            if tokenizer is None and (path / "tokenizer.json").is_file():
                tokenizer = load_tokenizer(model)
            if not sglang:
                model = load_decoder(model, config.device, config.dtype)
        elif sglang:
            raise ValueError("engine backend 'sglang' loads its model itself: pass a model folder")
        # None with backend "sglang": SGLang holds the weights (self.runner.model).
        self.model: DecoderLM | None = None if sglang else model  # type: ignore[assignment]
        self.tokenizer = tokenizer
        if self.model is not None:
            model_config = self.model.config
            parameter = next(self.model.parameters())
            dtype, device = parameter.dtype, parameter.device
        else:
            model_config = load_config(path)
            if isinstance(model_config, MLAConfig):
                raise ValueError(
                    f"engine config field backend 'sglang' serves Llama/Qwen2 checkpoints; "
                    f"{model_config.architecture} in {path} keeps latent (MLA) pages, which "
                    "SGLang lays out differently: use backend 'torch'"
                )
            device = resolve_device(config.device)
            dtype = resolve_dtype(config.dtype, model_config, device)
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.eos_token_ids = set(model_config.eos_token_ids)
        if tokenizer is not None:
            self.eos_token_ids |= set(tokenizer.eos_token_ids)
        kv_layers, kv_heads, kv_head_dim = model_config.kv_layout
        per_page = KVCache.bytes_per_page(kv_layers, config.page_size, kv_heads, kv_head_dim, dtype)
        pages_for_all = config.max_num_seqs * -(-self.max_model_len // config.page_size)
        num_pages = config.num_pages or max(
            1, min(config.kv_cache_bytes // per_page, pages_for_all)
        )
        self.cache = KVCache(
            kv_layers,
            num_pages,
            config.page_size,
            kv_heads,
            kv_head_dim,
            dtype,
            device,
        )
        self.leases: LeaseBook | None = None
        self.kv_pool = kv_pool  # also where lent contexts' pages are read (keep_context)
        self._kv_blocks: list[Lease] = []
        if config.share_kv and kv_pool is None:
            raise ValueError("engine config field share_kv needs a kv_pool to put the K/V in")
        if config.share_kv and kv_pool is not None and device.type == "cpu":
            # K/V in the deployment's pool: other roles on this host can read leased pages.
            for name in ("keys", "values"):
                block = kv_pool.empty(getattr(self.cache, name).shape, dtype)
                block.tensor.zero_()
                setattr(self.cache, name, block.tensor)
                self._kv_blocks.append(block.lease)
            self.leases = LeaseBook(kv_pool, config.lease_claim_s)
        self.tiers = _kv_tiers(config, self.cache, kv_pool)
        self.allocator: PageAllocator = RadixPrefixCache(
            num_pages, config.page_size, tiers=self.tiers
        )
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_prefix_caching,
        )
        self.runner: ModelRunner | SGLangRunner = (
            SGLangRunner(path, self.cache)
            if self.model is None
            else ModelRunner(
                self.model,
                self.cache,
                kernels=config.cpu_kernels,
                relayout=config.relayout_weights,
            )
        )
        self.limits = Limits(
            self.vocab_size,
            model_config.hidden_size,
            self.max_model_len,
            self.capacity_tokens,
            config.max_num_batched_tokens,
            bool(getattr(model, "positions_2d", False)),
        )
        self.sampler = Sampler(config.seed)
        self.sequences: dict[str, Sequence] = {}
        # Finished requests added with keep=True, their pages held: for continue_from and
        # block steps, until `release`.
        self.kept: dict[str, Sequence] = {}
        self.pending_aborts: list[TokenDelta] = []
        # rows_forwarded: every row the model ran, prompt, generated and block rows alike.
        self.stats = {"prompt_tokens_computed": 0, "rows_forwarded": 0}
        # Prompt tokens per second of the steps that mostly prefill: what recomputing a
        # prefix costs here, against pulling its KV from another replica (cache/pull_cost.py).
        self.prefill_rate = RateMeter(prior=1e3)

    def close(self) -> None:
        """Stop the KV tiers' thread and free their host and SSD space."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        for sequence in [*self.kept.values(), *self.sequences.values()]:
            _close_lent(sequence)  # borrowed prefixes: the lenders may free their pages
        if self.leases is not None:
            self.leases.close()  # lent prefixes: unclaimed ones taken back
        for block in self._kv_blocks:
            block.release()  # the engine is done: its K/V pool blocks go back
        self._kv_blocks = []

    @property
    def capacity_tokens(self) -> int:
        return self.cache.num_pages * self.cache.page_size

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams | None = None,
        embeddings: list[EmbeddingSpan] | None = None,
        lend_kv_to: int | None = None,
        head: CodesHead | None = None,
        guidance: Guidance | None = None,
        keep: bool = False,
        continue_from: str | None = None,
    ) -> None:
        """Queue a request. With ``lend_kv_to`` (a pid on this host), its last delta carries a
        read-only ``KVLease`` on the KV of all its computed tokens (see cache/kv_share.py).

        head: a codes head (None: text); each delta then carries the media tokens' ids.
        guidance: classifier-free guidance against an unconditional sequence, scheduled with
        this one. keep: at the end, hold the sequence's pages (``kept``) for a continuation
        or block steps until `release`. continue_from: a kept request to go on from: its
        tokens, KV and unconditional partner; prompt_token_ids then extend it (may be empty),
        and embedding spans' starts count from the kept sequence's start."""
        if lend_kv_to is not None and self.leases is None:
            raise NotImplementedError(
                f"request {request_id}: lend_kv_to needs the engine's KV in a host page pool "
                "(share_kv=True with a kv_pool, on CPU); leasing device KV by CUDA IPC is not built"
            )
        if guidance is not None and guidance.lease is not None:
            raise ValueError(
                f"request {request_id}: guidance.lease applies to keep_context, not add_request"
            )
        params = params or SamplingParams()
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params, request_id)
        self._check_unused(request_id)
        self._check_served(request_id, head=head is not None, guidance=guidance is not None)
        params.validate(request_id, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id}: sampling field stop needs a tokenizer")
        kept = None
        if continue_from is not None:
            kept = self.kept.get(continue_from)
            if kept is None:
                raise ValueError(
                    f"request {request_id}: continue_from {continue_from!r} is not kept"
                )
            if kept.lent is not None or (kept.partner and kept.partner.lent is not None):
                raise ValueError(
                    f"request {request_id}: continue_from {continue_from!r} is a lent "
                    "context, which takes block steps only"
                )
        # Everything is checked before anything changes: a bad request leaves no trace.
        tokens, spans = self._checked(request_id, kept, prompt_token_ids, embeddings, params)
        unconditional = None
        if guidance is not None:
            follower = None if kept is None else kept.partner
            unconditional = self._checked(
                f"{request_id}/uncond",
                follower,
                guidance.prompt_token_ids,
                guidance.embeddings,
                params,
            )
        if kept is None:
            sequence = Sequence(request_id, tokens, params, spans)
        else:
            del self.kept[str(continue_from)]
            sequence = kept
            sequence.continue_with(request_id, tokens, params, spans)
        sequence.lend_kv_to = lend_kv_to
        sequence.head, sequence.keep = head, keep
        self._guide(sequence, unconditional, None if guidance is None else guidance.scale)
        sequence.combine_halves = guidance is None or guidance.combine
        self.sequences[request_id] = sequence
        if sequence.status is SequenceStatus.KEPT:
            self.scheduler.requeue(sequence)
        else:
            self.scheduler.add(sequence)

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
                sequence.partner = None
                self.scheduler.finish(follower, "abort")
            return
        rid = f"{sequence.request_id}/uncond"
        tokens, spans = unconditional
        if follower is not None:
            follower.continue_with(rid, tokens, sequence.params, spans)
        else:
            follower = Sequence(rid, tokens, sequence.params, spans)
            follower.partner, follower.follows = sequence, True
            sequence.partner = follower
        follower.head = sequence.head
        sequence.guidance_scale = follower.guidance_scale = float(scale)

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
        sequence.combine_halves = guidance is None or guidance.combine
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
        for member in (sequence, sequence.partner):
            if member is not None:
                member.block = block
        sequence.request_id, sequence.keep_as = request_id, context_id
        self.sequences[request_id] = sequence
        self.scheduler.requeue(sequence)

    def release(self, request_id: str) -> None:
        """Free a kept request's pages (and its unconditional half's)."""
        sequence = self.kept.pop(request_id, None)
        if sequence is not None:
            self.scheduler.finish(sequence, "stop")
            _close_lent(sequence)

    def abort(self, request_id: str) -> None:
        """Drop a request (with its unconditional half). An aborted block step leaves its
        context kept; a kept request is not running: `release` frees it."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is None:
            return
        if sequence.keep_as is not None:
            delta = delta_of(sequence, 0)._replace(finish_reason="abort")
            self._park(sequence)
            self.pending_aborts.append(delta)
            return
        self.scheduler.finish(sequence, "abort")
        self.pending_aborts.append(delta_of(sequence, 0))

    def _park(self, sequence: Sequence) -> None:
        """A block step is done: its context is kept again, under its own id."""
        assert sequence.keep_as is not None
        for member in (sequence, sequence.partner):
            if member is not None:
                member.block = None
        sequence.request_id, sequence.keep_as = sequence.keep_as, None
        self.scheduler.keep(sequence)
        self.kept[sequence.request_id] = sequence

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending_aborts)

    def step(self) -> list[TokenDelta]:
        deltas, self.pending_aborts = self.pending_aborts, []
        if self.leases is not None:
            for pages in self.leases.reap():  # borrowers done: their pages may go
                self.allocator.free(pages)
        chunks = self.scheduler.schedule()
        if not chunks:
            if not deltas:
                self.scheduler.wait_for_promotions(0.05)
            return deltas
        prompt_tokens = 0
        for chunk in chunks:
            prompt_end = min(chunk.start + chunk.num_tokens, chunk.sequence.num_prompt_tokens)
            prompt_tokens += max(0, prompt_end - chunk.start)
        rows = sum(chunk.num_rows for chunk in chunks)
        self.stats["prompt_tokens_computed"] += prompt_tokens
        self.stats["rows_forwarded"] += rows
        started = time.perf_counter()
        output = self.runner.execute(chunks)
        if prompt_tokens >= max(PREFILL_SAMPLE_TOKENS, rows // 2):  # a prefill step, mostly
            self.prefill_rate.add(prompt_tokens, time.perf_counter() - started)
        self.scheduler.commit(chunks)
        deltas += self._block_outputs(output)
        leaders = [s for s in output.sequences if not s.follows]
        if not leaders:
            return deltas
        if output.logits is not None:  # text alone, no guidance
            append_text(self.sampler, leaders, output.logits)
        else:
            assert self.model is not None, "hidden states come from omniflow's model only"
            append_from_hidden(self.model, self.sampler, output, leaders)
        for sequence in leaders:
            check_stop(sequence, self.eos_token_ids, self.tokenizer, self.max_model_len)
            lease = None
            if sequence.finish_reason is not None:
                if sequence.lend_kv_to is not None:
                    lease = self._lend(sequence, sequence.lend_kv_to)
                if sequence.keep:
                    self.scheduler.keep(sequence)
                    self.kept[sequence.request_id] = sequence
                else:
                    self.scheduler.finish(sequence, sequence.finish_reason)
                del self.sequences[sequence.request_id]
            deltas.append(delta_of(sequence, 1)._replace(kv_lease=lease))
        return deltas

    def _block_outputs(self, output: StepOutput) -> list[TokenDelta]:
        """Deltas for the block steps this step finished (guided: combined halves)."""
        deltas = []
        for sequence, hidden in block_outputs(output):
            del self.sequences[sequence.request_id]
            deltas.append(delta_of(sequence, 0)._replace(finish_reason="stop", hidden=hidden))
            self._park(sequence)
        return deltas

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
            self.allocator.cancel_promotion(match.lower)  # type: ignore[attr-defined]
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

    @torch.inference_mode()
    def run_to_completion(self) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        while self.has_unfinished_requests():
            deltas += self.step()
        return deltas


def _close_lent(sequence: Sequence) -> None:
    """Hand back the leases a context (and its unconditional half) borrowed."""
    for member in (sequence, sequence.partner):
        if member is not None and member.lent is not None:
            member.lent.close()
            member.lent = None
