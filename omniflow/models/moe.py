"""Mixture-of-experts MLPs: DeepSeekMoE (shared + routed experts) and LongCat-Flash's MoE
with zero-computation (identity) experts.

A step routes all its rows at once, sorts the (row, choice) pairs by expert and runs each
hit expert once over its contiguous group: the Python loop is over experts, never rows.
Routing runs in float32 on a float32 router weight, as transformers keeps it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from omniflow.models.decoder import SwiGLU
from omniflow.models.mla import Weight
from omniflow.models.mla_config import MLAConfig


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.view(-1)
        order = flat.argsort(stable=True)
        rows = order // self.top_k
        counts = torch.bincount(flat, minlength=len(self.e_score_correction_bias)).tolist()
        grouped = x.index_select(0, rows)  # [rows * top_k, hidden], expert-major
        out_rows = torch.empty_like(grouped)
        start = 0
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        for expert, count in enumerate(counts):
            if not count:
                continue
            part = slice(start, start + count)
            start += count
            if expert >= self.num_experts:
                out_rows[part] = grouped[part]  # a zero-computation expert: the input itself
                continue
            gate, up = (grouped[part] @ gate_up[expert].t()).chunk(2, dim=-1)
            out_rows[part] = (nn.functional.silu(gate) * up) @ down[expert].t()
        scaled = (out_rows * weights.view(-1)[order, None]).to(x.dtype)
        # Shared experts fused with the routed sum: routed rows add into their output.
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        return out.index_add_(0, rows, scaled)
