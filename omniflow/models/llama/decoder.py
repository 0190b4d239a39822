"""Decoder-only transformer of the Llama/Qwen2 family over a flat batch of tokens.

The model knows nothing of pages or batching: every layer hands its q/k/v to an
`AttentionFn` supplied by the caller (the engine's paged attention), so the same module
serves prefill, chunked prefill and batched decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from omniflow.models.layers import cpu_layouts
from omniflow.models.layers.attention import causal_attention
from omniflow.models.layers.cpu_layouts import KernelLinear, PackedLinear
from omniflow.models.layers.rope import RotaryEmbedding, apply_rotary
from omniflow.models.llama.config import DecoderConfig

if TYPE_CHECKING:
    from omniflow.kernels import CpuKernels

# In place over the first `heads` heads of each row of a fused q/k/v output.
RotaryInPlace = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], None]


class AttentionFn(Protocol):
    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> like q."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers (variance in float32) so greedy outputs match.
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k are adjacent in the fused output: one rotary pass over both heads' sets.
        qk = apply_rotary(qk.view(tokens, self.num_heads + self.num_kv_heads, -1), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(tokens, self.q_size))

    def attend_qkv(
        self, qkv: torch.Tensor, cos, sin, attention: AttentionFn, rotary_: RotaryInPlace
    ) -> torch.Tensor:
        """From the q/k/v projection's output [tokens, q + 2 kv] (rotated in place) to the
        attention output [tokens, q_size], before o_proj."""
        tokens = qkv.shape[0]
        rotary_(qkv, self.num_heads + self.num_kv_heads, cos, sin)
        q, k, v = qkv.view(tokens, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1
        )
        return attention(self.layer_index, q, k, v).reshape(tokens, self.q_size)


class SwiGLU(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        # Rows per pass over the MLP, or None for all at once (see DecoderLM.set_row_block).
        self.row_block: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.row_block
        if block is None or x.shape[0] <= block:
            return self._rows(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], block):
            out[start : start + block] = self._rows(x[start : start + block])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, kernels: CpuKernels) -> torch.Tensor:
        """The same rows, silu * up in one pass on the CPU kernels (in the gate/up projection's
        own pass where that runs on them); the projections' forward called directly (no
        nn.Module call machinery on a decode step's hot path)."""
        gate_up = self.gate_up_proj
        if isinstance(gate_up, KernelLinear):
            return self.down_proj.forward(gate_up.silu_mul(x))
        return self.down_proj.forward(kernels.silu_mul(gate_up.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self, x, delta, cos, sin, attention: AttentionFn, kernels: CpuKernels
    ) -> torch.Tensor:
        """The same layer on the CPU kernels, residual stream kept in place: adds the last
        layer's output `delta` (None for the first layer) into x, adds this layer's
        attention too, and returns this layer's MLP output for the next to add.

        With a row block set (DecoderLM.set_row_block) and more rows than that, everything
        but attention runs block by block (the engine's blocks: CPU_KERNELS_ROW_BLOCK rows).
        Otherwise (a decode step) the modules' forward is called directly: no nn.Module call
        machinery, ~40 calls a step."""
        block, tokens = self.mlp.row_block, x.shape[0]
        attn, norm, post_norm = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        if block is None or tokens <= block:
            h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
            qkv = attn.qkv_proj.forward(h)
            attended = attn.o_proj.forward(
                attn.attend_qkv(qkv, cos, sin, attention, kernels.rotary_)
            )
            h = kernels.add_rms_norm(x, attended, post_norm.weight, post_norm.eps)
            return self.mlp.forward_fused(h, kernels)
        blocks = [slice(start, start + block) for start in range(0, tokens, block)]
        qkv = x.new_empty((tokens, attn.qkv_proj.out_features))
        for rows in blocks:
            part = None if delta is None else delta[rows]
            qkv[rows] = attn.qkv_proj(kernels.add_rms_norm(x[rows], part, norm.weight, norm.eps))
        attended = attn.attend_qkv(qkv, cos, sin, attention, kernels.rotary_)
        out = torch.empty_like(x)
        for rows in blocks:
            h = kernels.add_rms_norm(
                x[rows], attn.o_proj(attended[rows]), post_norm.weight, post_norm.eps
            )
            out[rows] = self.mlp.forward_fused(h, kernels)
        return out


class DecoderBody(nn.Module):
    def __init__(self, config: DecoderConfig, layer: Callable[..., nn.Module] | None = None):
        super().__init__()
        layer = layer or DecoderLayer
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Hugging Face checkpoint names that land in a slice of one of our fused parameters.
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLM(nn.Module):
    # Weights in memory other processes map (load_decoder(place=...)): the CPU re-layouts
    # (use_input_major_weights, use_packed_weights) leave them be, as they would make a
    # private copy; the loader already laid them out as they run, packing aside.
    shared_weights = False
    # What a family changes (MLADecoderLM): its body (layers) and its rotary embedding.
    body_class: type[DecoderBody] = DecoderBody
    rotary_class: type[RotaryEmbedding] = RotaryEmbedding

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = self.body_class(config)
        self.rotary = self.rotary_class(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The tied output projection in oneDNN's layout, or the AMX kernel's with
        # _output_kernels set, once use_packed_weights ran (the lookup keeps the plain table).
        self._packed_output: torch.Tensor | None = None
        self._output_kernels: CpuKernels | None = None
        self._kernels: CpuKernels | None = None  # set by use_cpu_kernels

    @property
    def cpu_kernels(self) -> CpuKernels | None:
        """The CPU kernels `forward` runs on (use_cpu_kernels), or None: PyTorch ops."""
        return self._kernels

    @property
    def packed(self) -> bool:
        return any(isinstance(module, PackedLinear | KernelLinear) for module in self.modules())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection: hidden states [rows, hidden] -> logits [rows, vocab]."""
        if self.lm_head is not None:
            return self.lm_head(x)
        if self._packed_output is not None:
            if self._output_kernels is not None:
                return self._output_kernels.linear(x, self._packed_output, self.config.vocab_size)
            return cpu_layouts.packed_linear(x, self._packed_output)
        return nn.functional.linear(x, self.model.embed_tokens.weight)

    # How many predecessors each row's input embedding reads (LongCat-Next's n-gram
    # embedding); 0: the token's own row. The engine passes them as forward's ``context``.
    input_context = 0

    def embed(self, input_ids: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """Input rows of ``input_ids``; ``context`` [T, input_context]: each row's
        predecessors, for a model whose input embedding reads them."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        logits_rows: torch.Tensor | None = None,
        embed_rows: torch.Tensor | None = None,
        embed_values: torch.Tensor | None = None,
        hidden: bool = False,
        unnormed_from: int | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flat batch: input_ids, positions [tokens]. Returns logits [len(logits_rows), vocab],
        or with ``hidden`` the final normed hidden states of those rows [rows, hidden_size]
        (for heads other than lm_head; `logits` takes them on).

        embed_rows/embed_values replace the token embeddings of those rows (multimodal
        placeholder positions) with precomputed embeddings. With ``hidden`` and
        ``unnormed_from``, the rows from that index on come back before the final norm (a
        model whose block steps' own head reads the last layer's output,
        ``block_rows_unnormed``). ``context``: see `embed`.
        """
        x = self.embed(input_ids, context)
        if embed_rows is not None and embed_rows.numel():
            if embed_values is None:
                raise ValueError("embed_rows needs embed_values")
            x = x.index_copy(0, embed_rows, embed_values.to(x.dtype))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        kernels = self._kernels
        if kernels is not None:
            # x is this call's own tensor (the lookup's output): updated in place.
            delta = None
            for fused in cast("list[DecoderLayer]", self.model.layers):
                delta = fused.forward_fused(x, delta, cos, sin, attention, kernels)
            if delta is not None:
                x += delta
            if logits_rows is not None:
                x = x.index_select(0, logits_rows)
            norm = self.model.norm
            return self._head(
                x,
                hidden,
                unnormed_from,
                lambda r: kernels.add_rms_norm(r, None, norm.weight, norm.eps),
            )
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        return self._head(x, hidden, unnormed_from, self.model.norm)

    def _head(
        self,
        x: torch.Tensor,
        hidden: bool,
        unnormed_from: int | None,
        norm: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The final norm (all rows, or those before ``unnormed_from``), then the logits
        unless ``hidden``."""
        if unnormed_from is None or not hidden:
            x = norm(x)
            return x if hidden else self.logits(x)
        return torch.cat((norm(x[:unnormed_from]), x[unnormed_from:]))

    def hidden_states(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final normed hidden states [T, hidden] of one causal sequence of input embeddings
        (at ``positions``: [T], or [T, 2] on a model with 2D positions; default 0..T-1).

        A plain (non-paged, no KV) forward on PyTorch ops: the reference that tests and
        benchmarks compare the engine's heads against. Serving runs codes heads and block
        steps through the engine (engine/heads.py), never this.
        """
        if positions is None:
            positions = torch.arange(inputs_embeds.shape[0], device=inputs_embeds.device)
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        attention = self.reference_attention()
        x = inputs_embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def reference_attention(self) -> AttentionFn:
        """`hidden_states`' attention: plain causal attention over the sequence's own K/V."""
        return causal_attention

    def use_input_major_weights(self) -> None:
        """float32 on CPU: projection weights kept input-major (cpu_layouts)."""
        if not self.shared_weights:
            cpu_layouts.use_input_major_weights(self)

    def use_packed_weights(self, rows_hint: int = 32, kernels: CpuKernels | None = None) -> None:
        """Store every projection weight in a blocked layout for bf16 on CPU
        (`packed_weights_supported`): the AMX kernel's (KernelLinear) when `kernels` has AMX,
        else oneDNN's (PackedLinear). Not for float32: MKL's GEMM on input-major weights is as
        fast there, and rounds like transformers'. A tied output projection gets a packed copy
        of the embedding table (the lookup keeps the plain one). Weights cannot be loaded
        after this."""
        if self.packed or self.shared_weights:
            return
        packed = cpu_layouts.use_packed_weights(self, rows_hint, kernels)
        self._packed_output, self._output_kernels = packed

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """Run `forward` on omniflow's CPU kernels (omniflow.kernels, bf16 on CPU only):
        each layer's norms with their residual adds, rotary and silu * up in one pass each,
        instead of chains of PyTorch ops. The kernels round where those ops round; only the
        norm's float32 sum of squares runs in another order, which now and then moves a value
        by one bf16 step. None: PyTorch ops again. `hidden_states` keeps PyTorch ops."""
        if kernels is not None:
            parameter = next(self.parameters())
            if parameter.device.type != "cpu" or parameter.dtype != torch.bfloat16:
                raise ValueError(
                    f"use_cpu_kernels: a bf16 CPU model, not {parameter.dtype} on {parameter.device}"
                )
        self._kernels = kernels

    def set_row_block(self, rows: int | None) -> None:
        """Run the MLPs over at most ``rows`` rows at a time (None: all at once); on the CPU
        kernels (use_cpu_kernels), every projection. For bf16 on CPU: a long prefill's MLP
        intermediates ([tokens, 2 x intermediate]) are tens of MB, fresh memory the allocator
        maps and faults in on every call, and then streamed through the cache by each
        elementwise op; blocks of a few hundred rows reuse a few MB. Not for float32, where
        the GEMMs dominate."""
        for module in self.modules():
            if isinstance(module, SwiGLU):
                module.row_block = rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into this module; returns the names loaded."""
        if self.packed:
            raise RuntimeError("load_weights after use_packed_weights: load into a new model")
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the duplicate anyway
            target, shard = self._resolve(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.config.architecture}"
                )
            param = params[target]
            with torch.no_grad():
                self._shard_view(param, target, shard).copy_(tensor.to(param.dtype))
            loaded.add(name)
        return loaded

    def _resolve(self, name: str) -> tuple[str, int | None]:
        for hf_name, (fused, shard) in _FUSED_SHARDS.items():
            if f".{hf_name}." in name:
                return name.replace(hf_name, fused), shard
        return name, None

    def _shard_view(self, param: torch.Tensor, target: str, shard: int | None) -> torch.Tensor:
        if shard is None:
            return param
        config = self.config
        if "qkv_proj" in target:
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        else:
            size = config.intermediate_size
            bounds = (shard * size, (shard + 1) * size)
        return param[bounds[0] : bounds[1]]

    def expected_checkpoint_names(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if "qkv_proj" in name:
                names |= {name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")}
            elif "gate_up_proj" in name:
                names |= {name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")}
            else:
                names.add(name)
        return names
