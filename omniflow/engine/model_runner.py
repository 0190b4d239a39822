"""Runs one scheduled step through the decoder: builds the flat token batch, the paged
attention metadata and the input-row overrides (multimodal spans, generated media tokens,
block-step rows); returns logits to sample, or final hidden states where a codes head,
guidance or a block step needs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from omniflow.engine.attention_backend import create_attention_backend
from omniflow.engine.cpu_decode import FusedDecode, fused_decode_supported
from omniflow.engine.decode_mirror import DecodeMirror
from omniflow.engine.paged_attention import (
    DecodeSpec,
    KVCache,
    PrefillSpec,
    build_attention_batch,
)
from omniflow.engine.scheduler import ScheduledChunk
from omniflow.engine.sequence import Sequence
from omniflow.kernels import CpuKernels, cpu_kernels
from omniflow.models import DecoderLM, MLAConfig
from omniflow.models.layers.cpu_layouts import packed_weights_supported
from omniflow.models.omni.ngram import NO_NGRAM

# Rows per pass of a long bf16 prefill on CPU (DecoderLM.set_row_block): over the MLPs on
# PyTorch ops, over every projection on the CPU kernels. Measured on llama-bench-30m, 32
# prompts of 128 tokens: 512 is best for the former; with the kernels (no silu * up
# intermediates to keep in cache), 2,048 beat 512, 1,024 and one pass.
CPU_BF16_ROW_BLOCK = 512
CPU_KERNELS_ROW_BLOCK = 2048


class StepOutput(NamedTuple):
    sequences: list[Sequence]  # the sequences that sample after this step, in row order
    logits: torch.Tensor | None  # [len(sequences), vocab] float32, for a text-only step
    # [len(sequences), hidden]: final normed hidden states, when a codes head or guidance
    # needs them (then logits is None and text rows take lm_head from these).
    hidden: torch.Tensor | None = None
    blocks: list[tuple[Sequence, torch.Tensor]] = []  # block steps' hidden states [N, hidden]


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        cache: KVCache,
        mirror_bytes: int | None = None,
        kernels: CpuKernels | None | bool = True,
        relayout: bool = True,
    ):
        """kernels: omniflow's CPU kernels for a bf16 model on CPU (True: build or load them
        here, falling back to PyTorch ops where they are unavailable; False: PyTorch ops).
        relayout: on CPU, re-lay the projection weights (packed or input-major copies);
        False leaves every parameter's storage as it is (weights shared with others)."""
        self.model = model
        self.cache = cache
        parameter = next(model.parameters())
        self.device = parameter.device
        bf16_cpu = self.device.type == "cpu" and parameter.dtype == torch.bfloat16
        # MLA reads latent pages (LatentPagedAttention): no decode mirror; of the CPU kernels,
        # its decode attention over latent pages and its layers' norms and silu * up.
        self.latent = isinstance(model.config, MLAConfig)
        if self.latent:
            mirror_bytes = 0
        if kernels is True:
            kernels = cpu_kernels() if bf16_cpu else None
        self.kernels = kernels or None
        self.latent_kernels = self.latent and self.kernels is not None
        if self.kernels is not None:
            model.use_cpu_kernels(self.kernels)
        # How attention runs (engine/attention_backend.py): the PyTorch reference or the CPU
        # kernels. Decodes that read the pages in place need no mirror's contiguous copies.
        self.attention = create_attention_backend(cache, model.config, self.kernels)
        self.kernel_decode = self.attention.decodes_in_place
        self.mirror = DecodeMirror(cache, 0 if self.kernel_decode else mirror_bytes)
        if relayout and packed_weights_supported(self.device, parameter.dtype):
            # MLA keeps oneDNN's packing: its float32 routers and bare kv_b weights are not
            # the AMX kernel's layers.
            model.use_packed_weights(kernels=None if self.latent else self.kernels)
            model.set_row_block(
                CPU_KERNELS_ROW_BLOCK if self.kernels is not None else CPU_BF16_ROW_BLOCK
            )
        elif relayout and self.device.type == "cpu":
            model.use_input_major_weights()
        self.scale = self.attention.scale
        # A step of decodes alone runs every layer in one call on the kernels (AMX or
        # AVX-512 BF16): the CPU runner's specialization (engine/cpu_decode.py); None: off.
        self.fused_decode: FusedDecode | None = None
        if self.kernel_decode and self.kernels is not None and fused_decode_supported(model):
            self.fused_decode = FusedDecode(model, self.kernels, self.scale)
        self.unnormed_blocks = bool(getattr(model, "block_rows_unnormed", False))

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepOutput:
        decodes = [c for c in chunks if c.num_tokens == 1 and not c.block]
        prefills = [c for c in chunks if c.num_tokens > 1 or c.block]
        mirrored = None
        if decodes and not self.kernel_decode:
            mirrored = self.mirror.prepare([(c.sequence, c.start) for c in decodes])
            if mirrored is not None:
                decodes = [decodes[i] for i in mirrored.order]
        else:
            self.mirror.clear()
        ordered = decodes + prefills
        step = gather_rows(ordered, self.model.input_context)
        input_ids, positions, logits_rows = step.input_ids, step.positions, step.logits_rows
        sampling, blocks, block_rows = step.sampling, step.blocks, step.block_rows
        embed_rows, embed_values = step.embed_rows, step.embed_values
        batch = build_attention_batch(
            self.cache,
            [DecodeSpec(page_ids=c.sequence.page_ids, context_len=c.start + 1) for c in decodes],
            prefill_specs(prefills),
            self.device,
            self.cache.keys.dtype,
            mirrored=None if mirrored is None else mirrored.rows,
            decode_masks=self.attention.decode_masks,
        )
        device = self.device
        wants_hidden = bool(blocks) or any(
            s.head is not None or s.partner is not None for s in sampling
        )
        if any(isinstance(p, list) for p in positions):  # 2D rotary: text at (p, p)
            positions = [p if isinstance(p, list) else [p, p] for p in positions]
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        at = torch.tensor(positions, dtype=torch.long, device=device)
        rows = torch.tensor(logits_rows + block_rows, dtype=torch.long, device=device)
        context = step.context_tensor(len(ids), device) if self.model.input_context else None
        fused = self.fused_decode
        if fused is not None and not prefills and not embed_rows and not wants_hidden:
            assert batch.decode_pages is not None and batch.decode_lengths is not None
            logits = fused.run(
                ids,
                at,
                self.cache.keys,
                self.cache.values,
                batch.slot_mapping,
                batch.decode_pages.view(len(decodes), -1),
                batch.decode_lengths,
                rows,
            )
            return StepOutput(sampling, logits.float())
        # A model whose block rows skip the final norm (HunyuanImage-3's final_layer).
        unnormed = {"unnormed_from": len(sampling)} if blocks and self.unnormed_blocks else {}
        out = self.model(
            ids,
            at,
            self.attention.bind(batch),
            logits_rows=rows,
            embed_rows=torch.tensor(embed_rows, dtype=torch.long, device=device)
            if embed_rows
            else None,
            embed_values=torch.cat([v.to(device) for v in embed_values]) if embed_values else None,
            hidden=wants_hidden,
            context=context,
            **unnormed,
        )
        if mirrored is not None:
            self.mirror.commit()
        if not wants_hidden:
            return StepOutput(sampling, out.float())
        outputs, at_row = [], len(sampling)
        for sequence in blocks:
            assert sequence.block is not None
            count = len(sequence.block.rows)
            outputs.append((sequence, out[at_row : at_row + count]))
            at_row += count
        return StepOutput(sampling, None, out[: len(sampling)], outputs)


@dataclass
class StepRows:
    """The rows of one step, in order (decodes, then prefill chunks and block rows): their
    token ids and rotary positions, which rows are sampled (and for which sequence), which
    take given embeddings instead of their token's, and which are block rows."""

    input_ids: list[int] = field(default_factory=list)
    positions: list = field(default_factory=list)  # ints, and [y, x] pairs of 2D block rows
    logits_rows: list[int] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)
    embed_rows: list[int] = field(default_factory=list)
    embed_values: list[torch.Tensor] = field(default_factory=list)
    block_rows: list[int] = field(default_factory=list)
    blocks: list[Sequence] = field(default_factory=list)
    # Each row's predecessors in its sequence (a model with input_context > 0).
    context: list[list[int]] = field(default_factory=list)

    def context_tensor(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.context, dtype=torch.long, device=device).view(rows, -1)


def gather_rows(ordered: list[ScheduledChunk], context: int = 0) -> StepRows:
    """The step's rows; with ``context``, each row's ``context`` predecessors too (-1 before
    the sequence's start, NO_NGRAM for a sequence of one token)."""
    step = StepRows()
    input_ids, positions, logits_rows = step.input_ids, step.positions, step.logits_rows
    sampling, blocks, block_rows = step.sampling, step.blocks, step.block_rows
    embed_rows, embed_values = step.embed_rows, step.embed_values
    for chunk in ordered:
        sequence, start, end = chunk.sequence, chunk.start, chunk.start + chunk.num_tokens
        row = len(input_ids)
        input_ids += sequence.token_ids[start:end]
        positions += range(start, end)
        if context:
            step.context += _predecessors(sequence.token_ids, start, end, context)
        for span in sequence.embedding_spans:
            lo, hi = max(start, span.start), min(end, span.start + len(span.embeddings))
            if lo < hi:
                embed_rows += range(row + lo - start, row + hi - start)
                embed_values.append(span.embeddings[lo - span.start : hi - span.start])
                if span.positions is not None:  # 2D rows
                    pairs = span.positions[lo - span.start : hi - span.start].tolist()
                    positions[row + lo - start : row + hi - start] = pairs
        if sequence.input_rows:
            for position in range(start, end):
                generated = sequence.input_rows.get(position)
                if generated is not None:
                    embed_rows.append(row + position - start)
                    embed_values.append(generated[None])
        if chunk.samples:
            logits_rows.append(len(input_ids) - 1)
            sampling.append(sequence)
        if chunk.block:
            block = sequence.block
            assert block is not None, "a chunk with block rows has a block step"
            row = len(input_ids)
            input_ids += [0] * chunk.block  # ids unused: every row is replaced
            step.context += [[-1] * context for _ in range(chunk.block)] if context else []
            positions += block.positions.tolist()
            embed_rows += range(row, row + chunk.block)
            embed_values.append(block.rows)
            block_rows += range(row, row + chunk.block)
            blocks.append(sequence)
    return step


def _predecessors(ids: list[int], start: int, end: int, count: int) -> list[list[int]]:
    if len(ids) == 1:
        return [[NO_NGRAM] * count]
    return [[ids[p - s] if p >= s else -1 for s in range(1, count + 1)] for p in range(start, end)]


def prefill_specs(prefills: list[ScheduledChunk]) -> list[PrefillSpec]:
    """The attention of a step's prefill chunks: each chunk's tokens, then its block rows."""
    prefill_attention: list[PrefillSpec] = []
    for c in prefills:
        if c.num_tokens:
            prefill_attention.append(
                PrefillSpec(
                    page_ids=c.sequence.page_ids, context_start=c.start, num_tokens=c.num_tokens
                )
            )
        if c.block:
            end, block = c.start + c.num_tokens, c.sequence.block
            assert block is not None, "a chunk with block rows has a block step"
            prefill_attention.append(
                PrefillSpec(
                    page_ids=c.sequence.page_ids,
                    context_start=end,
                    num_tokens=c.block,
                    bidirectional=True,
                    lent=c.sequence.lent,
                    causal_rows=block.causal_rows,
                )
            )
    return prefill_attention
