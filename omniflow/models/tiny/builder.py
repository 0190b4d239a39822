"""Tiny random-weight Llama/Qwen2 (and, through tiny_mla.py, DeepSeek-V2/LongCat-Flash) models saved in the Hugging Face layout.

Tests and default configs build these instead of downloading anything: config.json,
safetensors (optionally sharded with an index file) and a tokenizer built in code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omniflow.models.deepseek.config import MLA_ARCHITECTURES
from omniflow.models.tiny.mla import mla_hf_config, mla_random_state_dict
from omniflow.models.tiny.tokenizer import (
    BOS,
    EOS,
    PAD,
    build_tiny_tokenizer,
    save_tiny_tokenizer,
)


@dataclass(frozen=True)
class TinySpec:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    # Larger than the usual 0.02 so random logits are peaked: near-ties would make greedy
    # comparisons against transformers flaky on float rounding alone.
    init_std: float = 0.08
    extra: dict[str, Any] = field(default_factory=dict)


_TINY_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}

PRESETS: dict[str, TinySpec] = {
    "llama-mha": TinySpec(),
    "llama-gqa": TinySpec(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-tied-odd-heads": TinySpec(
        architecture="Qwen2ForCausalLM",
        hidden_size=60,
        num_attention_heads=5,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        intermediate_size=112,
        rope_theta=1000000.0,
    ),
    # About 29M parameters: the CPU benchmark model.
    "llama-bench-30m": TinySpec(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        init_std=0.02,
    ),
    # MLA + MoE: YaRN on, group-limited top-3 of 8 experts in 4 groups, q_lora_rank, one
    # dense layer first, routed_scaling_factor 2.5 (tiny_mla.MLA_DEFAULTS).
    "deepseek-v2-tiny": TinySpec(
        architecture="DeepseekV2ForCausalLM",
        num_hidden_layers=3,
        rope_scaling=_TINY_YARN,
    ),
    # DeepSeek-V2-Lite's shape: no q_lora_rank, greedy routing.
    "deepseek-v2-lite-tiny": TinySpec(
        architecture="DeepseekV2ForCausalLM",
        num_hidden_layers=3,
        rope_scaling=_TINY_YARN,
        extra={"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
    ),
    "longcat-flash-tiny": TinySpec(
        architecture="LongcatFlashForCausalLM",
        extra={"n_routed_experts": 6, "zero_expert_num": 2, "num_experts_per_tok": 2},
    ),
    # The DeepSeek-V2 CPU benchmark model (benchmarks/engine.py --model deepseek_v2).
    "deepseek-v2-bench": TinySpec(
        architecture="DeepseekV2ForCausalLM",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        init_std=0.02,
        extra={
            "q_lora_rank": None,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "n_routed_experts": 16,
            "n_shared_experts": 2,
            "moe_intermediate_size": 256,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.0,
        },
    ),
}


def base_hf_config(spec: TinySpec, eos_id: int, bos_id: int, pad_id: int) -> dict[str, Any]:
    """The config.json fields every architecture's tiny model shares."""
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_theta": spec.rope_theta,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "initializer_range": spec.init_std,
    }
    if spec.rope_scaling:
        config["rope_scaling"] = dict(spec.rope_scaling)
    return config


def hf_config(spec: TinySpec, eos_id: int, bos_id: int, pad_id: int) -> dict[str, Any]:
    is_qwen2 = spec.architecture == "Qwen2ForCausalLM"
    config = base_hf_config(spec, eos_id, bos_id, pad_id)
    config.update(
        model_type="qwen2" if is_qwen2 else "llama",
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
    )
    if is_qwen2:
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = spec.attention_bias
        config["mlp_bias"] = False
    config.update(spec.extra)
    return config


def random_state_dict(spec: TinySpec, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named random tensors for `spec`."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    q_size = spec.num_attention_heads * head_dim
    kv_size = spec.num_key_value_heads * head_dim
    has_qkv_bias = spec.architecture == "Qwen2ForCausalLM" or spec.attention_bias
    has_o_bias = spec.architecture != "Qwen2ForCausalLM" and spec.attention_bias

    def normal(*shape: int, std: float = spec.init_std) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(spec.hidden_size, std=0.1)

    tensors = {"model.embed_tokens.weight": normal(spec.vocab_size, spec.hidden_size)}
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (q_size, spec.hidden_size),
            "self_attn.k_proj": (kv_size, spec.hidden_size),
            "self_attn.v_proj": (kv_size, spec.hidden_size),
            "self_attn.o_proj": (spec.hidden_size, q_size),
            "mlp.gate_proj": (spec.intermediate_size, spec.hidden_size),
            "mlp.up_proj": (spec.intermediate_size, spec.hidden_size),
            "mlp.down_proj": (spec.hidden_size, spec.intermediate_size),
        }
        for name, shape in shapes.items():
            tensors[f"{prefix}.{name}.weight"] = normal(*shape)
        if has_qkv_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{prefix}.self_attn.{name}.bias"] = normal(shapes[f"self_attn.{name}"][0])
        if has_o_bias:
            tensors[f"{prefix}.self_attn.o_proj.bias"] = normal(spec.hidden_size)
        tensors[f"{prefix}.input_layernorm.weight"] = norm_weight()
        tensors[f"{prefix}.post_attention_layernorm.weight"] = norm_weight()
    tensors["model.norm.weight"] = norm_weight()
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(spec.vocab_size, spec.hidden_size)
    return tensors


def save_safetensors(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None):
    """One model.safetensors, or shards plus model.safetensors.index.json past max_shard_bytes."""
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def build_tiny_model(
    folder: str | Path,
    spec: TinySpec | str = "llama-mha",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight model in the Hugging Face layout to `folder`; returns the folder."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown tiny preset {spec!r}; known: {', '.join(PRESETS)}")
        spec = PRESETS[spec]
    spec = replace(spec, **overrides)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(spec.vocab_size)
    save_tiny_tokenizer(tokenizer, folder)
    ids: dict[str, int] = {}
    for token in (BOS, EOS, PAD):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise RuntimeError(f"tiny tokenizer has no id for special token {token!r}")
        ids[token] = token_id
    if spec.architecture in MLA_ARCHITECTURES:
        config = mla_hf_config(spec, base_hf_config(spec, ids[EOS], ids[BOS], ids[PAD]))
        tensors = mla_random_state_dict(spec, seed)
    else:
        config = hf_config(spec, eos_id=ids[EOS], bos_id=ids[BOS], pad_id=ids[PAD])
        tensors = random_state_dict(spec, seed)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_safetensors(tensors, folder, max_shard_bytes)
    (folder / "omniflow_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return folder
