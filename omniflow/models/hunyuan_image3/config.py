"""The subset of a HunyuanImage-3.0 config.json that the backbone and the image parts need.

The backbone is a decoder with GQA attention and QK-norm, MoE MLPs (routed experts, top-k,
one shared MLP) and 2D rotary positions for image tokens. The MoE field names are those
models/deepseek/moe.py reads, so `MoE` serves this backbone too. The image parts (timestep
embedders, patch_embed, final_layer, VAE, ViT and its projector) keep their own sub-configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.models.config_keys import ConfigKeys
from omniflow.models.llama.config import DecoderConfig

HUNYUAN_IMAGE3_ARCHITECTURES = ("HunyuanImage3ForCausalMM",)
HUNYUAN_IMAGE3_MODEL_TYPES = ("hunyuan_image_3_moe", "hunyuan_image3")


def _per_layer(raw: dict[str, Any], key: str, default: Any) -> Any:
    """A field the reference allows per layer (a list): one value for all layers."""
    value = raw.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise NotImplementedError(f"config.json {key}: per-layer values {value}")
        value = value[0]
    return value


@dataclass(frozen=True)
class HunyuanImage3Config(DecoderConfig):
    # MoE (models/deepseek/moe.py's names): routed experts, their top-k, one shared MLP of
    # n_shared_experts x moe_intermediate_size; the first moe_layer_num_skipped layers dense.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_layer_num_skipped: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    zero_expert_num: int = 0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    use_qk_norm: bool = True
    # Image generation: latent patches (patch_size) of a VAE latent (downsample), aspect
    # ratios around image_base_size pixels.
    patch_size: int = 1
    patch_embed_hidden_dim: int = 64
    image_base_size: int = 1024
    vae: dict[str, Any] = field(default_factory=dict)
    vit: dict[str, Any] = field(default_factory=dict)
    vit_aligner: dict[str, Any] = field(default_factory=dict)
    vit_processor: dict[str, Any] = field(default_factory=dict)  # Siglip2ImageProcessor's

    @property
    def is_longcat(self) -> bool:
        return False

    @property
    def latent_channels(self) -> int:
        return int(self.vae["latent_channels"])

    @property
    def vae_downsample(self) -> int:
        return int(self.vae.get("ffactor_spatial", 16))

    @property
    def pixels_per_token(self) -> int:
        """Image pixels along one side of one image token."""
        return self.vae_downsample * self.patch_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], file: str = "config.json") -> HunyuanImage3Config:
        keys = ConfigKeys(raw, file)
        architecture = (keys.get("architectures") or ["HunyuanImage3ForCausalMM"])[0]
        if architecture not in HUNYUAN_IMAGE3_ARCHITECTURES:
            raise NotImplementedError(
                f"config.json architecture {architecture!r} is not HunyuanImage-3"
            )
        keys.silu()
        if keys.get("use_cla") or keys.get("use_mla"):
            raise NotImplementedError("HunyuanImage-3 with use_cla or use_mla")
        if keys.get("norm_type", "rms") not in ("rms", "hf_rms"):
            raise NotImplementedError(f"norm_type {raw['norm_type']!r}: only RMSNorm")
        heads = keys.integer("num_attention_heads")
        hidden = keys.integer("hidden_size")
        experts = int(_per_layer(raw, "num_experts", 1))
        shared = int(_per_layer(raw, "num_shared_expert", 1)) if raw.get("use_mixed_mlp_moe") else 0
        bias = keys.flag("attention_bias")
        moe_size = _per_layer(raw, "moe_intermediate_size", None)
        return cls(
            architecture=architecture,
            vocab_size=keys.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.integer("intermediate_size"),
            num_hidden_layers=keys.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=keys.integer("num_key_value_heads", heads, falsy=True),
            head_dim=keys.integer("attention_head_dim", hidden // heads, falsy=True),
            rms_norm_eps=keys.number("rms_norm_eps", 1e-5),
            max_position_embeddings=keys.integer("max_position_embeddings", 2048),
            tie_word_embeddings=keys.flag("tie_word_embeddings"),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=keys.flag("mlp_bias"),
            # The reference's "custom" rope: the default frequencies, over 2D positions.
            rope={"rope_type": "default", "rope_theta": keys.number("rope_theta", 10000.0)},
            bos_token_id=keys.get("bos_token_id"),
            eos_token_ids=keys.eos_token_ids(),
            torch_dtype=keys.torch_dtype(),
            n_routed_experts=experts if experts > 1 else 0,
            n_shared_experts=shared,
            num_experts_per_tok=int(_per_layer(raw, "moe_topk", 1)),
            moe_intermediate_size=int(moe_size or keys.integer("intermediate_size")),
            moe_layer_num_skipped=keys.integer("moe_layer_num_skipped", 0),
            norm_topk_prob=keys.flag("norm_topk_prob", True),
            routed_scaling_factor=keys.number("routed_scaling_factor", 1.0),
            use_qk_norm=keys.flag("use_qk_norm"),
            patch_size=keys.integer("patch_size", 1),
            patch_embed_hidden_dim=keys.integer("patch_embed_hidden_dim", 64),
            image_base_size=keys.integer("image_base_size", 1024),
            vae=dict(keys.get("vae") or {}),
            vit=dict(keys.get("vit") or {}),
            vit_aligner=dict(keys.get("vit_aligner") or {}),
            vit_processor=dict(keys.get("vit_processor") or {}),
        )


# The release's sampler defaults (hunyuan_image_3's pipeline falls back to these where its
# generation_config.json lacks a key).
RELEASE_GENERATION = {"diff_infer_steps": 50, "diff_guidance_scale": 5.0, "flow_shift": 3.0}


@dataclass(frozen=True)
class GenerationDefaults:
    steps: int
    guidance_scale: float
    flow_shift: float


def generation_defaults(path: str | Path) -> GenerationDefaults:
    """The sampler defaults of a HunyuanImage-3 folder: its generation_config.json's
    diff_infer_steps, diff_guidance_scale and flow_shift (the release's values where the
    file or a key is absent)."""
    file = Path(path) / "generation_config.json"
    raw: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    values = RELEASE_GENERATION | {k: raw[k] for k in RELEASE_GENERATION if k in raw}
    try:
        steps = int(values["diff_infer_steps"])
        scale = float(values["diff_guidance_scale"])
        shift = float(values["flow_shift"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: diff_infer_steps/diff_guidance_scale/flow_shift: {exc}") from exc
    if steps < 1 or scale < 0 or shift <= 0:
        raise ValueError(
            f"{file}: diff_infer_steps {steps} (>= 1), diff_guidance_scale {scale} (>= 0), "
            f"flow_shift {shift} (> 0)"
        )
    return GenerationDefaults(steps, scale, shift)


def generation_template(
    path: str | Path, template: str | None = None, system_prompt: str | None = None
) -> tuple[str, str | None]:
    """The prompt layout of a HunyuanImage-3 folder: (sequence_template, system prompt).
    template and system_prompt (a role's options) win over generation_config.json's
    sequence_template (default 'pretrain') and use_system_prompt ('None': no system
    prompt; the release's named prompts are not shipped here, so they need system_prompt)."""
    file = Path(path) / "generation_config.json"
    raw: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    name = template or str(raw.get("sequence_template") or "pretrain")
    if name not in ("pretrain", "instruct"):
        raise ValueError(f"{file}: sequence_template {name!r}: expected 'pretrain' or 'instruct'")
    wanted = str(raw.get("use_system_prompt") or "None")
    if system_prompt is None and wanted not in ("None", "custom"):
        raise ValueError(
            f"{file}: use_system_prompt {wanted!r} names one of the release's own system "
            "prompts, which are not shipped here: give its text as the role's system_prompt"
        )
    return name, system_prompt
