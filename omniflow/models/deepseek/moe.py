"""Mixture-of-experts MLPs: DeepSeekMoE (shared + routed experts) and LongCat-Flash's MoE
with zero-computation (identity) experts.

A step routes all its rows at once and sorts the (row, choice) pairs by expert. On a GPU all
experts then run over their groups in two batched matmuls (groups padded to the widest: no
loop, no host sync); on CPU each expert runs over its own rows (a loop over the experts
with rows, no padding computed).
Routing runs in float32 on a float32 router weight, as transformers keeps it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from omniflow.models.deepseek.config import MLAConfig
from omniflow.models.deepseek.mla import Weight
from omniflow.models.llama.decoder import DecoderLM, SwiGLU

if TYPE_CHECKING:
    from omniflow.kernels import CpuKernels


class Experts(nn.Module):
    """Routed experts' weights stacked as transformers' fused ones: gate_up_proj
    [experts, 2 x size, hidden] and down_proj [experts, hidden, size]."""

    def __init__(self, experts: int, hidden: int, size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, size))


class MoE(nn.Module):
    e_score_correction_bias: torch.Tensor

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.config = config
        experts, size = config.n_routed_experts, config.moe_intermediate_size
        self.num_experts = experts
        self.top_k = config.num_experts_per_tok
        choices = experts + config.zero_expert_num
        # The router's weight, at DeepSeek's mlp.gate (LongCat's is renamed on loading).
        self.gate = Weight(choices, config.hidden_size)
        self.experts = Experts(experts, config.hidden_size, size)
        self.register_buffer("e_score_correction_bias", torch.zeros(choices), persistent=False)
        self.shared_experts: SwiGLU | None = None
        if config.n_shared_experts:
            shared = replace(config, intermediate_size=size * config.n_shared_experts)
            self.shared_experts = SwiGLU(shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [rows, top_k] float32, expert ids [rows, top_k]), weights already scaled
        by routed_scaling_factor (once, here)."""
        config = self.config
        scores = nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1)
        if config.is_longcat:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            if config.topk_method == "group_limited_greedy":
                groups = scores.view(scores.shape[0], config.n_group, -1)
                chosen = torch.topk(groups.max(dim=-1).values, config.topk_group, dim=-1).indices
                keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device)
                keep.scatter_(1, chosen, True)
                scores = groups.masked_fill(~keep[..., None], 0.0).view(scores.shape)
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
            if config.norm_topk_prob and self.top_k > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * config.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        """kernels: silu * up of the routed and shared experts on omniflow's CPU kernels."""
        weights, ids = self.route(x)
        flat = ids.view(-1)
        order = flat.argsort(stable=True)
        rows = order // self.top_k
        experts = flat[order]  # of each (row, choice) pair, expert-major
        counts = torch.bincount(flat, minlength=len(self.e_score_correction_bias))
        starts = counts.cumsum(0) - counts
        places = torch.arange(len(flat), device=x.device) - starts[experts]
        grouped = x.index_select(0, rows)
        if x.device.type == "cpu":
            out_rows = self._experts_by_group(grouped, counts, kernels)
        else:
            widest = int(counts[: self.num_experts].max())
            out_rows = self._experts(grouped, experts, places, widest, kernels)
        scaled = (out_rows * weights.view(-1)[order, None]).to(x.dtype)
        # Shared experts fused with the routed sum: routed rows add into their output.
        shared = self.shared_experts
        if shared is None:
            out = torch.zeros_like(x)
        else:
            out = shared(x) if kernels is None else shared.forward_fused(x, kernels)
        return out.index_add_(0, rows, scaled)

    def _experts_by_group(
        self, grouped: torch.Tensor, counts: torch.Tensor, kernels: CpuKernels | None = None
    ) -> torch.Tensor:
        """On CPU: each routed expert over its own rows (a contiguous run of ``grouped``,
        which is expert-major), two matmuls each, empty experts skipped. Padding every group
        to the widest (`_experts`) computes [experts, widest] rows: with many experts and
        uneven routing (a CFG pair routes its two halves alike) mostly zeros. Rows of
        zero-computation experts (after the routed ones) pass through unchanged."""
        out = torch.empty_like(grouped)
        gate_up_proj, down_proj = self.experts.gate_up_proj, self.experts.down_proj
        linear = nn.functional.linear
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if not count:
                continue
            end = start + count
            if expert >= self.num_experts:
                out[start:end] = grouped[start:end]
            else:
                gate_up = linear(grouped[start:end], gate_up_proj[expert])
                if kernels is None:
                    gate, up = gate_up.chunk(2, dim=-1)
                    activated = nn.functional.silu(gate) * up
                else:
                    activated = kernels.silu_mul(gate_up)
                out[start:end] = linear(activated, down_proj[expert])
            start = end
        return out

    def _experts(
        self, grouped, experts, places, widest: int, kernels: CpuKernels | None = None
    ) -> torch.Tensor:
        """Every routed expert over its group in two batched matmuls: the groups padded to
        the widest one, [experts, widest, hidden] (one call a matmul instead of one an expert,
        for some padding). Zero-computation experts' rows pass through unchanged."""
        routed = experts < self.num_experts
        everything = len(self.e_score_correction_bias) == self.num_experts
        if not everything:
            experts, places, inputs = experts[routed], places[routed], grouped[routed]
        else:
            inputs = grouped
        padded = grouped.new_zeros(self.num_experts, widest, grouped.shape[1])
        padded[experts, places] = inputs
        gate_up = torch.bmm(padded, self.experts.gate_up_proj.transpose(1, 2))
        if kernels is None:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = nn.functional.silu(gate) * up
        else:
            activated = kernels.silu_mul(gate_up.view(-1, gate_up.shape[-1]))
            activated = activated.view(*gate_up.shape[:-1], -1)
        done = torch.bmm(activated, self.experts.down_proj.transpose(1, 2))
        if everything:
            return done[experts, places]
        out = grouped.clone()  # a zero-computation expert returns its input
        out[routed] = done[experts, places]
        return out

    def use_input_major_weights(self) -> None:
        """Expert weights laid input-major in memory (same shapes and values), so the batched
        matmuls read contiguous [hidden, out] blocks instead of copying transposed ones."""
        with torch.no_grad():
            for weight in (self.experts.gate_up_proj, self.experts.down_proj):
                weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)


class MoEDecoderLM(DecoderLM):
    """A DecoderLM with MoE layers: beside the projections' CPU layout, the experts' weights
    laid input-major (MoE.use_input_major_weights) - never shared weights, which stay where
    every process maps them."""

    def use_input_major_weights(self) -> None:
        super().use_input_major_weights()
        self._experts_input_major()

    def use_packed_weights(self, rows_hint: int = 32, kernels: CpuKernels | None = None) -> None:
        super().use_packed_weights(rows_hint, kernels)
        self._experts_input_major()

    def _experts_input_major(self) -> None:
        if self.shared_weights:
            return
        for module in self.modules():
            if isinstance(module, MoE):
                module.use_input_major_weights()
