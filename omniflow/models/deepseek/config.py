"""The subset of a DeepSeek-V2 or LongCat-Flash config.json that the MLA + MoE decoder needs.

`head_dim` is the rotary key's width (qk_rope_head_dim), as in transformers: the rotary
tables are built for it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omniflow.models.config_keys import ConfigKeys
from omniflow.models.llama.config import DecoderConfig, _rope_parameters

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "LongcatFlashForCausalLM")
TOPK_METHODS = ("greedy", "group_limited_greedy")
NGRAM_KEYS = (
    "emb_neighbor_num",
    "emb_split_num",
    "text_vocab_size",
    "ngram_vocab_size_ratio",
    "eos_token_id",
    "text_vocab_plus_multimodal_special_token_size",
    "hidden_size",
)


@dataclass(frozen=True)
class MLAConfig(DecoderConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MoE: routed experts (plus LongCat's zero-computation ones) and shared experts.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    zero_expert_num: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    # LongCat-Next (model_type longcat_next): lm_head's rows (the text vocabulary and the
    # multimodal specials; the word embedding also has the codebook rows), 0: vocab_size;
    # and the n-gram input embedding's config.json keys (None: none).
    output_vocab_size: int = 0
    ngram: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def is_longcat(self) -> bool:
        return self.architecture == "LongcatFlashForCausalLM"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per attention layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attention_layers(self) -> int:
        """LongCat-Flash runs two attention sublayers per layer."""
        return 2 * self.num_hidden_layers if self.is_longcat else self.num_hidden_layers

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """Latent pages: one kv head of half the latent width, in keys and in values
        (engine/latent_attention.py)."""
        return self.attention_layers, 1, -(-self.latent_dim // 2)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN
        (as transformers 5.24's `yarn_apply_mscale`)."""
        scale = self.qk_head_dim**-0.5
        mscale_all_dim = self.rope.get("mscale_all_dim") or 0
        factor = float(self.rope.get("factor") or 1.0)
        if self.rope_type != "default" and mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any], file: str = "config.json") -> MLAConfig:
        keys = ConfigKeys(raw, file)
        architecture = (keys.get("architectures") or [""])[0] or {
            "deepseek_v2": "DeepseekV2ForCausalLM",
            "longcat_flash": "LongcatFlashForCausalLM",
        }.get(keys.get("model_type", ""), "")
        next_ = keys.get("model_type") == "longcat_next"
        if next_:  # its decoder layers are LongCat-Flash's
            architecture = "LongcatFlashForCausalLM"
        if architecture not in MLA_ARCHITECTURES:
            raise NotImplementedError(f"config.json architecture {architecture!r} is not MLA")
        keys.silu()
        longcat = architecture == "LongcatFlashForCausalLM"
        topk_method = keys.get("topk_method", "greedy")
        if topk_method not in TOPK_METHODS:
            raise NotImplementedError(f"topk_method {topk_method!r}; supported: {TOPK_METHODS}")
        if keys.integer("moe_layer_freq", 1) != 1:
            raise NotImplementedError("moe_layer_freq != 1")
        heads = keys.integer("num_attention_heads")
        bias = keys.flag("attention_bias")
        rope_dim = keys.integer("qk_rope_head_dim", 64)
        return cls(
            architecture=architecture,
            vocab_size=keys.integer("vocab_size"),
            hidden_size=keys.integer("hidden_size"),
            intermediate_size=keys.integer("ffn_hidden_size" if longcat else "intermediate_size"),
            num_hidden_layers=keys.integer("num_layers" if longcat else "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=rope_dim,
            rms_norm_eps=keys.number("rms_norm_eps", 1e-6),
            max_position_embeddings=keys.integer("max_position_embeddings", 2048),
            tie_word_embeddings=keys.flag("tie_word_embeddings"),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=keys.flag("mlp_bias"),
            rope=_rope_parameters(raw),
            bos_token_id=keys.get("bos_token_id"),
            eos_token_ids=keys.eos_token_ids(),
            torch_dtype=keys.torch_dtype(),
            q_lora_rank=keys.optional_int("q_lora_rank"),
            kv_lora_rank=keys.integer("kv_lora_rank", 512),
            qk_nope_head_dim=keys.integer("qk_nope_head_dim", 128),
            qk_rope_head_dim=rope_dim,
            v_head_dim=keys.integer("v_head_dim", 128),
            n_routed_experts=keys.integer("n_routed_experts", 0, falsy=True),
            n_shared_experts=keys.integer("n_shared_experts", 0, falsy=True),
            zero_expert_num=keys.integer("zero_expert_num", 0, falsy=True),
            num_experts_per_tok=keys.integer(
                "moe_topk" if longcat else "num_experts_per_tok", 1, falsy=True
            ),
            moe_intermediate_size=keys.integer(
                "expert_ffn_hidden_size" if longcat else "moe_intermediate_size", 0, falsy=True
            ),
            first_k_dense_replace=keys.integer("first_k_dense_replace", 0, falsy=True),
            topk_method=topk_method,
            n_group=keys.integer("n_group", 1, falsy=True),
            topk_group=keys.integer("topk_group", 1, falsy=True),
            norm_topk_prob=keys.flag("norm_topk_prob"),
            routed_scaling_factor=keys.number("routed_scaling_factor", 1.0),
            router_bias=keys.flag("router_bias"),
            output_vocab_size=keys.integer("text_vocab_plus_multimodal_special_token_size")
            if next_
            else 0,
            ngram={k: raw[k] for k in NGRAM_KEYS if k in raw} if next_ else None,
        )
