"""The torch backend: paged KV, continuous batching, sampling, prefix caching; output heads
(text, codes), guided pairs and block steps (engine/heads.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from omniflow.engine.flows import Ending, MediaOutput
from omniflow.engine.heads import CodesHead, Guidance
from omniflow.engine.intake import Limits
from omniflow.engine.kept import KeptContexts, close_lent
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
from omniflow.engine.spoken import Spoken, SpokenText
from omniflow.kv.allocator import PageAllocator
from omniflow.kv.pull_cost import RateMeter
from omniflow.kv.radix import RadixPrefixCache
from omniflow.kv.share import LeaseBook
from omniflow.kv.sizing import pages_for_bytes
from omniflow.kv.tiers import KVTiers
from omniflow.memory.lease import Lease
from omniflow.memory.pool import PagePool
from omniflow.memory.ssd_share import SsdShare
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
    seed: int | None = None  # for requests without their own seed
    # KV tiers below the device (radix prefix cache only): evicted pages are copied to the
    # host page pool (the deployment's, or a private one), then to SSD, before being dropped.
    host_kv_bytes: int = 0  # 0: no host tier, evicted pages are dropped
    ssd_kv_dir: str | None = None
    ssd_kv_bytes: int = 0
    # The SSD tier as one process's share of a per-host capacity (memory/ssd_share.py);
    # None: ssd_kv_bytes of its own. A spent share leaves the engine without an SSD tier.
    ssd_kv_share: SsdShare | None = None
    # K/V tensors in the given kv_pool (CPU), so requests can lend their KV to other
    # processes on the host (add_request's lend_kv_to).
    share_kv: bool = False
    # A lease lent and not claimed by its borrower within this many seconds is revoked
    # (kv/share.py): one lost on its way holds no page for longer.
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


PREFILL_SAMPLE_TOKENS = 16  # steps with fewer prompt tokens say little about prefill speed
BACKENDS = ("torch", "sglang")
FLOW_OPERATIONS = ("codes_heads", "guidance", "block_steps", "embeddings")


def _kv_tiers(config: EngineConfig, cache: KVCache, pool: PagePool | None) -> KVTiers | None:
    if config.host_kv_bytes <= 0:
        return None
    return KVTiers.create(
        KVCachePages(cache),
        config.host_kv_bytes,
        config.ssd_kv_dir,
        config.ssd_kv_bytes,
        pool,
        config.ssd_kv_share,
    )


def _share_kv(
    config: EngineConfig,
    cache: KVCache,
    kv_pool: PagePool | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[LeaseBook | None, list[Lease]]:
    """With share_kv: the cache's K/V moved into the deployment's pool, where other roles on
    this host can read leased pages; the lease book and the pool blocks."""
    if config.share_kv and kv_pool is None:
        raise ValueError("engine config field share_kv needs a kv_pool to put the K/V in")
    if not (config.share_kv and kv_pool is not None and device.type == "cpu"):
        return None, []
    blocks = []
    for name in ("keys", "values"):
        block = kv_pool.empty(getattr(cache, name).shape, dtype)
        block.tensor.zero_()
        setattr(cache, name, block.tensor)
        blocks.append(block.lease)
    return LeaseBook(kv_pool, config.lease_claim_s), blocks


def _load(
    model: str | Path | DecoderLM, config: EngineConfig, tokenizer: TextTokenizer | None
) -> tuple[DecoderLM | None, TextTokenizer | None, Any, torch.dtype, torch.device, Path | None]:
    """The model (None with backend "sglang": SGLang holds the weights, self.runner.model),
    its tokenizer, config, dtype, device and folder."""
    path: Path | None = None
    sglang = config.backend == "sglang"
    if isinstance(model, (str, Path)):
        path = Path(model)
        if tokenizer is None and (path / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(model)
        if not sglang:
            model = load_decoder(model, config.device, config.dtype)
    elif sglang:
        raise ValueError("engine backend 'sglang' loads its model itself: pass a model folder")
    loaded: DecoderLM | None = None if sglang else cast(DecoderLM, model)
    if loaded is not None:
        model_config = loaded.config
        parameter = next(loaded.parameters())
        dtype, device = parameter.dtype, parameter.device
    else:
        assert path is not None
        model_config = load_config(path)
        if isinstance(model_config, MLAConfig):
            raise ValueError(
                f"engine config field backend 'sglang' serves Llama/Qwen2 checkpoints; "
                f"{model_config.architecture} in {path} keeps latent (MLA) pages, which "
                "SGLang lays out differently: use backend 'torch'"
            )
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, model_config, device)
    return loaded, tokenizer, model_config, dtype, device, path


class LLMEngine(KeptContexts):
    def __init__(
        self,
        model: str | Path | DecoderLM,
        config: EngineConfig | None = None,
        tokenizer: TextTokenizer | None = None,
        kv_pool: PagePool | None = None,
    ):
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer, model_config, dtype, device, path = _load(
            model, config, tokenizer
        )
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.eos_token_ids = set(model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        kv_layers, kv_heads, kv_head_dim = model_config.kv_layout
        num_pages = config.num_pages or pages_for_bytes(
            config.kv_cache_bytes,
            KVCache.bytes_per_page(kv_layers, config.page_size, kv_heads, kv_head_dim, dtype),
            config.max_num_seqs * -(-self.max_model_len // config.page_size),
        )
        self.cache = KVCache(
            kv_layers, num_pages, config.page_size, kv_heads, kv_head_dim, dtype, device
        )
        self.kv_pool = kv_pool  # also where lent contexts' pages are read (keep_context)
        self.leases, self._kv_blocks = _share_kv(config, self.cache, kv_pool, dtype, device)
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
        self.runner: ModelRunner | SGLangRunner
        if self.model is None:
            assert path is not None  # _load: backend sglang loads from a folder
            self.runner = SGLangRunner(path, self.cache)
        else:
            kernels, relayout = config.cpu_kernels, config.relayout_weights
            self.runner = ModelRunner(self.model, self.cache, kernels=kernels, relayout=relayout)
        self.limits = Limits(
            self.vocab_size,
            model_config.hidden_size,
            self.max_model_len,
            self.capacity_tokens,
            config.max_num_batched_tokens,
            bool(getattr(self.model, "positions_2d", False)),
        )
        self.sampler = Sampler(config.seed)
        self.sequences: dict[str, Sequence] = {}
        # Finished requests added with keep=True, their pages held: for continue_from and
        # block steps, until `release`.
        self.kept: dict[str, Sequence] = {}
        self.pending_aborts: list[TokenDelta] = []
        # rows_forwarded: every row the model ran, prompt, generated and block rows alike.
        self.stats = {"prompt_tokens_computed": 0, "rows_forwarded": 0, "steps": 0}
        self.step_seconds = 0.0  # the model's time in steps that ran, for /metrics
        # Prompt tokens per second of the steps that mostly prefill: what recomputing a
        # prefix costs here, against pulling its KV from another replica (kv/pull_cost.py).
        self.prefill_rate = RateMeter(prior=1e3)

    def close(self) -> None:
        """Stop the KV tiers' thread and free their host and SSD space."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        for sequence in [*self.kept.values(), *self.sequences.values()]:
            close_lent(sequence)  # borrowed prefixes: the lenders may free their pages
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
        spoken: Spoken | None = None,
        row_end: tuple[int, int] | None = None,
    ) -> None:
        """Queue a request. With ``lend_kv_to`` (a pid on this host), its last delta carries a
        read-only ``KVLease`` on the KV of all its computed tokens (see kv/share.py).

        head: a codes head (None: text); each delta then carries the media tokens' ids.
        guidance: classifier-free guidance against an unconditional sequence, scheduled with
        this one. keep: at the end, hold the sequence's pages (``kept``) for a continuation
        or block steps until `release`. continue_from: a kept request to go on from: its
        tokens, KV and unconditional partner; prompt_token_ids then extend it (may be empty),
        and embedding spans' starts count from the kept sequence's start. spoken: with a
        codes head, a text token beside each media token (engine/spoken.py); each delta's
        ``text_ids`` then carries them. row_end: (token, width), with a codes head: that
        token after every ``width`` media tokens (an image's rows)."""
        self._check_flows(request_id, lend_kv_to, head, guidance, spoken, row_end)
        params = params or SamplingParams()
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params, request_id)
        self._check_unused(request_id)
        self._check_served(request_id, head=head is not None, guidance=guidance is not None)
        params.validate(request_id, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id}: sampling field stop needs a tokenizer")
        kept = None if continue_from is None else self._continued(request_id, continue_from)
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
            sequence = kept.continued(request_id, tokens, params, spans)
        sequence.ending = Ending(keep, lend_kv_to)
        if head is not None:
            said = None if spoken is None else SpokenText(spoken)
            sequence.media = MediaOutput(head, spoken=said, row_end=row_end)
        else:
            sequence.media = None
        self._guide(sequence, unconditional, None if guidance is None else guidance.scale)
        if sequence.pair is not None and guidance is not None:
            sequence.pair.combine = guidance.combine
        self.sequences[request_id] = sequence
        if sequence.status is SequenceStatus.KEPT:
            self.scheduler.requeue(sequence)
        else:
            self.scheduler.add(sequence)

    def _check_flows(
        self,
        request_id: str,
        lend_kv_to: int | None,
        head: CodesHead | None,
        guidance: Guidance | None,
        spoken: Spoken | None,
        row_end: tuple[int, int] | None,
    ) -> None:
        """add_request's flow options that cannot go together, or cannot be served here."""
        if lend_kv_to is not None and self.leases is None:
            raise NotImplementedError(
                f"request {request_id}: lend_kv_to needs the engine's KV in a host page pool "
                "(share_kv=True with a kv_pool, on CPU); leasing device KV by CUDA IPC is not built"
            )
        if guidance is not None and guidance.lease is not None:
            raise ValueError(
                f"request {request_id}: guidance.lease applies to keep_context, not add_request"
            )
        if spoken is not None and (head is None or guidance is not None):
            raise ValueError(f"request {request_id}: spoken needs a codes head and no guidance")
        if row_end is not None and (head is None or spoken is not None or row_end[1] < 1):
            raise ValueError(f"request {request_id}: row_end needs a codes head, width >= 1")

    def _continued(self, request_id: str, continue_from: str) -> Sequence:
        """The kept sequence a request goes on from (checked, not taken yet)."""
        kept = self.kept.get(continue_from)
        if kept is None:
            raise ValueError(f"request {request_id}: continue_from {continue_from!r} is not kept")
        if kept.lent is not None or (kept.partner and kept.partner.lent is not None):
            raise ValueError(
                f"request {request_id}: continue_from {continue_from!r} is a lent "
                "context, which takes block steps only"
            )
        return kept

    def release(self, request_id: str) -> None:
        """Free a kept request's pages (and its unconditional half's)."""
        sequence = self.kept.pop(request_id, None)
        if sequence is not None:
            self.scheduler.finish(sequence, "stop")
            close_lent(sequence)

    def abort(self, request_id: str) -> None:
        """Drop a request (with its unconditional half). An aborted block step leaves its
        context kept; a kept request is not running: `release` frees it."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is None:
            return
        if sequence.block_step is not None:
            delta = delta_of(sequence, 0)._replace(finish_reason="abort")
            self._park(sequence)
            self.pending_aborts.append(delta)
            return
        self.scheduler.finish(sequence, "abort")
        self.pending_aborts.append(delta_of(sequence, 0))

    def _park(self, sequence: Sequence) -> None:
        """A block step is done: its context is kept again, under its own id."""
        step = sequence.block_step
        assert step is not None and step.context_id is not None
        for member in (sequence, sequence.partner):
            if member is not None:
                member.block_step = None
        self.scheduler.keep(sequence)
        kept = sequence.successor(step.context_id)
        self.kept[kept.request_id] = kept

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
        took = time.perf_counter() - started
        self.stats["steps"] += 1
        self.step_seconds += took
        if prompt_tokens >= max(PREFILL_SAMPLE_TOKENS, rows // 2):  # a prefill step, mostly
            self.prefill_rate.add(prompt_tokens, took)
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
                if sequence.ending.lend_kv_to is not None:
                    lease = self._lend(sequence, sequence.ending.lend_kv_to)
                if sequence.ending.keep:
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

    @torch.inference_mode()
    def run_to_completion(self) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        while self.has_unfinished_requests():
            deltas += self.step()
        return deltas
