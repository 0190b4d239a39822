"""The one-call decode step: the CPU runner's specialization for a step of decodes alone.

Every layer of a Llama-family model runs in one call on the CPU kernels
(CpuKernels.decode_layers, AMX or AVX-512 BF16) instead of ~9 calls a layer, with the
attention the engine's pages would give: each row's K/V written at its slot of the cache,
its context the first lengths[r] tokens of its page table. Same kernels in the same order
as the model's `forward` on them: the same logits. The model keeps one forward; this module
reads its weights (cpu_layouts.decode_layer_table) and calls its embedding, rotary and
output projection."""

from __future__ import annotations

from typing import cast

import torch

from omniflow.kernels import CpuKernels
from omniflow.models import DecoderLM
from omniflow.models.layers import cpu_layouts
from omniflow.models.layers.cpu_layouts import KernelLinear
from omniflow.models.llama.decoder import DecoderLayer


def fused_decode_supported(model: DecoderLM) -> bool:
    """Whether the one-call step runs on this model: its forward on the CPU kernels' projections
    (AMX or AVX-512 BF16), every projection on them (use_packed_weights after
    use_cpu_kernels), decode attention for these heads."""
    kernels, config = model.cpu_kernels, model.config
    return (
        kernels is not None
        and kernels.packed_linear
        and kernels.decode_attention_supported(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        and all(
            isinstance(projection, KernelLinear)
            for layer in cast("list[DecoderLayer]", model.model.layers)
            for projection in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )
    )


class FusedDecode:
    """A decode-only step of ``model`` in one kernel call (needs fused_decode_supported)."""

    def __init__(self, model: DecoderLM, kernels: CpuKernels, scale: float):
        self.model, self.kernels, self.scale = model, kernels, scale
        # The per-layer addresses, for the cache at (keys, values) addresses.
        self._table: tuple[tuple[int, int], torch.Tensor] | None = None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of logits_rows for one new token a row: keys/values [layers, kv_heads,
        pages, page_size, head_dim], the rows' K/V written at slots, row r's context the
        first lengths[r] tokens of its pages tables[r]."""
        model, kernels, config = self.model, self.kernels, self.model.config
        x = model.embed(input_ids)
        cos, sin = model.rotary.cos_sin(positions, x.dtype)
        kernels.decode_layers(
            x,
            self._layers(keys, values),
            cos,
            sin,
            keys[0],
            slots,
            tables,
            lengths,
            config.num_attention_heads,
            config.intermediate_size,
            config.rms_norm_eps,
            self.scale,
        )
        x = x.index_select(0, logits_rows)
        norm = model.model.norm
        return model.logits(kernels.add_rms_norm(x, None, norm.weight, norm.eps))

    def _layers(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The pointer table (cpu_layouts.decode_layer_table), kept while the cache stays."""
        key = (keys.data_ptr(), values.data_ptr())
        if self._table is None or self._table[0] != key:
            self._table = (key, cpu_layouts.decode_layer_table(self.model, keys, values))
        return self._table[1]
