"""The SGLang backend's forward: SGLang's model over omniflow's KV pages.

LLMEngine with ``EngineConfig(backend="sglang")`` keeps its scheduler, page allocator,
prefix cache and sampler, and runs each scheduled step through `SGLangRunner` instead of
`ModelRunner`: SGLang loads the checkpoint and runs ``model.forward(input_ids, positions,
forward_batch)``; the logits of the sampling rows go back to omniflow's Sampler.

Pages: there is one KV allocation, omniflow's `KVCache` (``keys[layers, kv_heads, pages,
page_size, head_dim]``). SGLang's attention reads and writes per-layer token-major buffers
``[slots, kv_heads, head_dim]``; `_PagesAsTokens` hands it views of omniflow's tensors in
that shape (a slot is ``page * page_size + offset``, the engine's slot mapping), so K/V
land in exactly the pages the allocator gave the sequence. The request-to-token table
(`SlotRows`) lasts across steps: a step writes only its new tokens' slots. Prefill chunks
(with a cached prefix: ``extend_prefix_lens`` > 0) and decodes run as one EXTEND batch; a
step of decodes alone runs as DECODE. The attention backend is SGLang's torch_native
(PyTorch SDPA, any device); its GPU backends (FlashInfer, Triton) want a full SGLang
ModelRunner and are not wired.

SGLang's internals change between releases: this adapter is written against exactly
`SGLANG_VERSION` and refuses another. On CPU, SGLang needs ``SGLANG_USE_CPU_ENGINE=1``
(set here before it is imported) and still imports two CUDA-only modules at module level,
``sgl_kernel`` and ``torchvision``: without them `sglang_missing` says so, and the engine
config is refused. Text outputs only: prompts may carry embedding spans (multimodal
inputs, as SGLang's ``input_embeds``), but codes heads, guided pairs and block steps need
hidden states this adapter does not return (`UNSERVED`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import threading
from pathlib import Path
from typing import Any

import torch

from omniflow.engine.model_runner import StepOutput
from omniflow.engine.paged_attention import KVCache
from omniflow.engine.scheduler import ScheduledChunk

SGLANG_VERSION = "0.5.23"
# Compute Flow operations the SGLang backend cannot serve (EngineConfig.flow names them).
UNSERVED = ("codes_heads", "guidance", "block_steps")
# Modules SGLang 0.5.23 imports at module level even for a text model on CPU.
_REQUIRED_MODULES = ("sglang", "sgl_kernel", "torchvision")

_bootstrap_lock = threading.Lock()


def sglang_missing() -> str | None:
    """What this Python environment lacks to run the SGLang backend, or None (without
    importing SGLang: this runs when a config is loaded)."""
    absent = [name for name in _REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if "sglang" in absent:
        return (
            f"the sglang package (pip install omniflow[sglang], sglang=={SGLANG_VERSION}; "
            "on CPU scripts/setup.sh with OMNIFLOW_SGLANG=cpu)"
        )
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != SGLANG_VERSION:
        return f"sglang=={SGLANG_VERSION} (this adapter uses its internals); found {version}"
    if absent:
        return (
            f"SGLang's kernels: module(s) {', '.join(absent)} that sglang imports "
            "(sgl_kernel comes with SGLang's GPU install; torchvision with its multimodal deps)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """SGLang's one-process bootstrap (as its weight-cache daemon does it): server args
    published for this process, model parallel of world size 1 (gloo on CPU), then its
    model loader. The distributed groups are made once per process."""
    if device.type == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    dtype_name = str(dtype).removeprefix("torch.")
    args = ServerArgs(
        model_path=str(path),
        device=device.type,
        attention_backend="torch_native",
        dtype=dtype_name,
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
    )
    gpu = device.index or 0
    with _bootstrap_lock:
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=gpu))
        initialize_moe_config()
        model_config = ModelConfig(model_path=str(path), dtype=dtype_name)
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=gpu,
                backend="gloo" if device.type == "cpu" else "nccl",
            )
            initialize_model_parallel()
        initialize_dp_attention(args)
        init_dp_gathered_buffer(model_config)
        loader = get_model_loader(
            load_config=LoadConfig(load_format="auto"), model_config=model_config
        )
        return loader.load_model(
            model_config=model_config, device_config=DeviceConfig(device.type, gpu)
        )


class _PagesAsTokens:
    """SGLang's token-to-KV pool over omniflow's pages: per layer, views [slots, kv_heads,
    head_dim] of KVCache.keys/values (no copy: slot = page * page_size + offset)."""

    def __init__(self, cache: KVCache):
        layers, heads, pages, size, dim = cache.keys.shape
        self.dtype = cache.keys.dtype
        self.device = cache.keys.device
        self.page_size = size
        self.size = pages * size

        def views(tensor: torch.Tensor) -> list[torch.Tensor]:
            # [heads, pages, size, dim] -> [pages, size, heads, dim]; pages and offsets
            # merge into one slot axis without a copy.
            return [t.permute(1, 2, 0, 3).view(pages * size, heads, dim) for t in tensor]

        self.k_buffer, self.v_buffer = views(cache.keys), views(cache.values)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer: Any,
        loc: Any,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        slots = getattr(loc, "loc", loc)  # a KVWriteLoc, or the slots themselves
        keys, values = self.k_buffer[layer.layer_id], self.v_buffer[layer.layer_id]
        keys[slots] = cache_k.view(-1, *keys.shape[1:]).to(self.dtype)
        values[slots] = cache_v.view(-1, *values.shape[1:]).to(self.dtype)


class _Row:
    __slots__ = ("index", "page_ids", "pages", "last_page", "filled")

    def __init__(self, index: int) -> None:
        self.index = index
        self.page_ids: list[int] = []  # the sequence's own list, as it was last seen
        self.pages = 0  # how many of its pages the row's slots came from
        self.last_page = -1  # the last of those
        self.filled = 0  # slots [0, filled) of the row are written


class SlotRows:
    """SGLang's request-to-token pool, kept across steps: one row per running sequence,
    listing the KV slot of each of its tokens (``page * page_size + offset``).

    A step writes only the slots it adds (a decode: one), not each sequence's whole table
    again. A row is rewritten from its start when the sequence's pages changed under it:
    the scheduler only appends to ``page_ids`` in place and replaces the list when it frees
    them (preemption, finish), so a new list (or a different last page) means new pages.
    """

    def __init__(self, page_size: int, device: torch.device | str = "cpu") -> None:
        self.page_size = page_size
        self.req_to_token = torch.zeros((0, 0), dtype=torch.int64, device=device)
        self._rows: dict[Any, _Row] = {}  # sequence -> its row
        self._free: list[int] = []
        self.slots_written = 0  # a count, for tests: grows by the new tokens of each step

    def rows_for(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The rows of the step's sequences, with every slot up to each chunk's end written."""
        self._forget_ended({c.sequence for c in chunks})
        rows, cols, values, indices = [], [], [], []
        for chunk in chunks:
            sequence = chunk.sequence
            end = chunk.start + chunk.num_tokens
            row = self._row(sequence)
            lo = min(row.filled, chunk.start)  # a prefix hit's first step fills its prefix too
            if end > lo:
                rows.append(torch.full((end - lo,), row.index, dtype=torch.int64))
                cols.append(torch.arange(lo, end))
                values.append(self._slots(sequence.page_ids, lo, end))
                row.filled = max(row.filled, end)
                row.pages = -(-row.filled // self.page_size)
                row.last_page = sequence.page_ids[row.pages - 1]
            indices.append(row.index)
        self._grow(len(self._rows) + len(self._free), max(c.start + c.num_tokens for c in chunks))
        if values:
            slots = torch.cat(values)
            self.slots_written += len(slots)
            device = self.req_to_token.device
            at = (torch.cat(rows).to(device), torch.cat(cols).to(device))
            self.req_to_token.index_put_(at, slots.to(device))
        return indices

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[row, start:end]

    def _row(self, sequence: Any) -> _Row:
        row = self._rows.get(sequence)
        if row is None:
            row = _Row(self._free.pop() if self._free else len(self._rows) + len(self._free))
            self._rows[sequence] = row
        page_ids = sequence.page_ids
        if page_ids is not row.page_ids or (
            row.pages and (len(page_ids) < row.pages or page_ids[row.pages - 1] != row.last_page)
        ):  # other pages than the row's slots came from: write it again from the start
            row.page_ids, row.filled, row.pages, row.last_page = page_ids, 0, 0, -1
        return row

    def _forget_ended(self, stepping: set[Any]) -> None:
        """Free the rows of sequences that hold no pages now (finished or preempted)."""
        for sequence, row in list(self._rows.items()):
            if sequence not in stepping and not sequence.page_ids:
                del self._rows[sequence]
                self._free.append(row.index)

    def _slots(self, page_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Slots of tokens [start, end), from the pages that hold them only."""
        size = self.page_size
        first = start // size
        pages = torch.tensor(page_ids[first : -(-end // size)], dtype=torch.int64)
        slots = (pages[:, None] * size + torch.arange(size)).view(-1)
        return slots[start - first * size : end - first * size]

    def _grow(self, rows: int, width: int) -> None:
        have_rows, have_width = self.req_to_token.shape
        if rows <= have_rows and width <= have_width:
            return
        grown = torch.zeros(
            (max(rows, 2 * have_rows), max(width, 2 * have_width)),
            dtype=torch.int64,
            device=self.req_to_token.device,
        )
        grown[:have_rows, :have_width] = self.req_to_token
        self.req_to_token = grown


class SGLangRunner:
    """ModelRunner's SGLang twin: `execute` runs a scheduled step through SGLang's model."""

    def __init__(self, path: str | Path, cache: KVCache):
        missing = sglang_missing()
        if missing:
            raise RuntimeError(f"engine backend 'sglang' needs {missing}")
        self.cache = cache
        self.device = cache.keys.device
        self.model = _load_model(Path(path), cache.keys.dtype, self.device)
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self._sglang = (
            ForwardBatch,
            ForwardMode,
            CaptureHiddenMode,
            ForwardContext,
            forward_context,
        )
        self.pool = _PagesAsTokens(cache)
        self.table = SlotRows(cache.page_size, self.device)
        runner = _RunnerView(self.device, self.table, self.pool)
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        self.attention = TorchNativeAttnBackend(runner)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepOutput:
        ForwardBatch, ForwardMode, CaptureHiddenMode, ForwardContext, forward_context = self._sglang
        for chunk in chunks:
            if chunk.block or chunk.sequence.input_rows:
                raise ValueError(
                    f"request {chunk.sequence.request_id}: backend 'sglang' runs prompt and "
                    "text rows only (no block steps or media-token rows)"
                )
        decode_only = all(c.num_tokens == 1 and c.start > 0 for c in chunks)
        table_rows = self.table.rows_for(chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        out_slots: list[torch.Tensor] = []
        starts, lengths, ends, sampling, rows = [], [], [], [], []
        embed_rows: list[int] = []
        embed_values: list[torch.Tensor] = []
        for index, chunk in enumerate(chunks):
            sequence, start = chunk.sequence, chunk.start
            end = start + chunk.num_tokens
            row = len(input_ids)
            for span in sequence.embedding_spans:  # multimodal rows replace their embeddings
                lo, hi = max(start, span.start), min(end, span.start + len(span.embeddings))
                if lo < hi:
                    embed_rows += range(row + lo - start, row + hi - start)
                    embed_values.append(span.embeddings[lo - span.start : hi - span.start])
            input_ids += sequence.token_ids[start:end]
            positions += range(start, end)
            out_slots.append(self.table.slots(table_rows[index], start, end))
            starts.append(start)
            lengths.append(chunk.num_tokens)
            ends.append(end)
            if chunk.samples:
                sampling.append(sequence)
                rows.append(index)
        device = self.device
        seq_lens = torch.tensor(ends, dtype=torch.int64)
        extend: dict[str, Any] = {}
        if not decode_only:
            lengths_t = torch.tensor(lengths, dtype=torch.int64)
            extend = dict(
                extend_num_tokens=len(input_ids),
                extend_seq_lens=lengths_t.to(device),
                extend_prefix_lens=torch.tensor(starts, dtype=torch.int64, device=device),
                extend_start_loc=(torch.cumsum(lengths_t, 0) - lengths_t).to(device),
                extend_seq_lens_cpu=lengths,
                extend_prefix_lens_cpu=starts,
                extend_logprob_start_lens_cpu=lengths,
            )
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode_only else ForwardMode.EXTEND,
            batch_size=len(chunks),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(table_rows, dtype=torch.int64, device=device),
            seq_lens=seq_lens.to(device),
            seq_lens_cpu=seq_lens,
            out_cache_loc=torch.cat(out_slots).to(device),
            seq_lens_sum=int(seq_lens.sum()),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            capture_hidden_mode=CaptureHiddenMode.NULL,
            **extend,
        )
        self.attention.init_forward_metadata(batch)
        input_embeds = None
        if embed_rows:
            input_embeds = self.model.get_input_embeddings()(batch.input_ids)
            values = torch.cat([v.to(device) for v in embed_values]).to(input_embeds.dtype)
            input_embeds[torch.tensor(embed_rows, dtype=torch.long, device=device)] = values
        with forward_context(ForwardContext(attn_backend=self.attention), forward_batch=batch):
            out = self.model.forward(
                batch.input_ids, batch.positions, batch, input_embeds=input_embeds
            )
        # One logits row per sequence (its last row); keep those that sample.
        logits = out.next_token_logits[torch.tensor(rows, dtype=torch.long, device=device)]
        return StepOutput(sampling, logits.float())


class _RunnerView:
    """What SGLang's attention backends read off its ModelRunner."""

    def __init__(self, device: torch.device, table: SlotRows, pool: _PagesAsTokens):
        self.device = str(device)
        self.req_to_token_pool = table
        self.token_to_kv_pool = pool
