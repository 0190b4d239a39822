"""Tiny random-weight DeepSeek-V2 and LongCat-Flash configs and tensors in the Hugging Face
layout (DeepSeek-V2-Lite's names: one tensor per expert). `tiny.build_tiny_model` writes
them for presets whose architecture is one of MLA_ARCHITECTURES; the MLA and MoE sizes
come from the spec's `extra` over MLA_DEFAULTS."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from omniflow.models.tiny.builder import TinySpec

MLA_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 3,
    "first_k_dense_replace": 1,
    "topk_method": "group_limited_greedy",
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": False,
    "routed_scaling_factor": 2.5,
    # LongCat-Flash only
    "zero_expert_num": 0,
}


def mla_fields(spec: TinySpec) -> dict[str, Any]:
    return MLA_DEFAULTS | spec.extra


def mla_hf_config(spec: TinySpec, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (tiny.base_hf_config) plus the MLA and MoE fields."""
    f = mla_fields(spec)
    longcat = spec.architecture == "LongcatFlashForCausalLM"
    config = dict(base)
    config.update(
        model_type="longcat_flash" if longcat else "deepseek_v2",
        num_key_value_heads=spec.num_attention_heads,
        attention_bias=spec.attention_bias,
    )
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    config.update({key: f[key] for key in keys})
    config["n_routed_experts"] = f["n_routed_experts"]
    config["routed_scaling_factor"] = f["routed_scaling_factor"]
    if longcat:
        config.update(
            num_layers=spec.num_hidden_layers,
            ffn_hidden_size=spec.intermediate_size,
            expert_ffn_hidden_size=f["moe_intermediate_size"],
            moe_topk=f["num_experts_per_tok"],
            zero_expert_num=f["zero_expert_num"],
            head_dim=f["qk_rope_head_dim"],
        )
    else:
        moe_keys = (
            "moe_intermediate_size",
            "n_shared_experts",
            "num_experts_per_tok",
            "first_k_dense_replace",
            "topk_method",
            "n_group",
            "topk_group",
            "norm_topk_prob",
        )
        config.update({key: f[key] for key in moe_keys})
        config.update(
            num_hidden_layers=spec.num_hidden_layers, intermediate_size=spec.intermediate_size
        )
    return config


def mla_random_state_dict(spec: TinySpec, seed: int) -> dict[str, torch.Tensor]:
    f = mla_fields(spec)
    generator = torch.Generator().manual_seed(seed)
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    longcat = spec.architecture == "LongcatFlashForCausalLM"

    def normal(*shape: int, std: float = spec.init_std) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    def swiglu(prefix: str, size: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.gate_proj.weight": normal(size, hidden),
            f"{prefix}.up_proj.weight": normal(size, hidden),
            f"{prefix}.down_proj.weight": normal(hidden, size),
        }

    def attention(prefix: str) -> dict[str, torch.Tensor]:
        qk = f["qk_nope_head_dim"] + f["qk_rope_head_dim"]
        rank, q_rank = f["kv_lora_rank"], f["q_lora_rank"]
        out: dict[str, torch.Tensor] = {}
        if q_rank is None:
            out[f"{prefix}.q_proj.weight"] = normal(heads * qk, hidden)
        else:
            out[f"{prefix}.q_a_proj.weight"] = normal(q_rank, hidden)
            out[f"{prefix}.q_a_layernorm.weight"] = norm(q_rank)
            out[f"{prefix}.q_b_proj.weight"] = normal(heads * qk, q_rank)
        out[f"{prefix}.kv_a_proj_with_mqa.weight"] = normal(rank + f["qk_rope_head_dim"], hidden)
        out[f"{prefix}.kv_a_layernorm.weight"] = norm(rank)
        out[f"{prefix}.kv_b_proj.weight"] = normal(
            heads * (f["qk_nope_head_dim"] + f["v_head_dim"]), rank
        )
        out[f"{prefix}.o_proj.weight"] = normal(hidden, heads * f["v_head_dim"])
        return out

    def moe(prefix: str) -> dict[str, torch.Tensor]:
        experts, size = f["n_routed_experts"], f["moe_intermediate_size"]
        out: dict[str, torch.Tensor] = {}
        choices = experts + (f["zero_expert_num"] if longcat else 0)
        if longcat:
            out[f"{prefix}.router.classifier.weight"] = normal(choices, hidden, std=0.5)
            out[f"{prefix}.router.e_score_correction_bias"] = normal(choices, std=0.05)
        else:
            out[f"{prefix}.gate.weight"] = normal(choices, hidden, std=0.5)
            if f["n_shared_experts"]:
                out |= swiglu(f"{prefix}.shared_experts", size * f["n_shared_experts"])
        for e in range(experts):
            out |= swiglu(f"{prefix}.experts.{e}", size)
        return out

    tensors = {"model.embed_tokens.weight": normal(spec.vocab_size, hidden)}
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        if longcat:
            for j in (0, 1):
                tensors |= attention(f"{prefix}.self_attn.{j}")
                tensors |= swiglu(f"{prefix}.mlps.{j}", spec.intermediate_size)
                tensors[f"{prefix}.input_layernorm.{j}.weight"] = norm(hidden)
                tensors[f"{prefix}.post_attention_layernorm.{j}.weight"] = norm(hidden)
            tensors |= moe(f"{prefix}.mlp")
            continue
        tensors |= attention(f"{prefix}.self_attn")
        if i < f["first_k_dense_replace"] or not f["n_routed_experts"]:
            tensors |= swiglu(f"{prefix}.mlp", spec.intermediate_size)
        else:
            tensors |= moe(f"{prefix}.mlp")
        tensors[f"{prefix}.input_layernorm.weight"] = norm(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = norm(hidden)
    tensors["model.norm.weight"] = norm(hidden)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(spec.vocab_size, hidden)
    return tensors
