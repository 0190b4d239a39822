"""A tiny random-weight HunyuanImage-3-like model in the Hugging Face layout: config.json,
sharded safetensors with an index (the reference's tensor names for the backbone, the
timestep embedders, patch_embed and final_layer), and a tokenizer with the image special
tokens. `load_decoder` loads its backbone, `load_image_parts` the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omniflow.models.hunyuan_image3.config import HunyuanImage3Config
from omniflow.models.hunyuan_image3.model import qkv_to_groups
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts
from omniflow.models.hunyuan_image3.tokens import SPECIAL_TOKENS
from omniflow.models.tiny.builder import save_safetensors
from omniflow.models.tiny.tokenizer import (
    BOS,
    EOS,
    PAD,
    build_tiny_tokenizer,
    save_tiny_tokenizer,
)

TINY_HUNYUAN_IMAGE3: dict[str, Any] = {
    "architectures": ["HunyuanImage3ForCausalMM"],
    "model_type": "hunyuan_image_3_moe",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_head_dim": 16,
    "use_qk_norm": True,
    "num_experts": 4,
    "moe_topk": 2,
    "use_mixed_mlp_moe": True,
    "num_shared_expert": 1,
    "moe_layer_num_skipped": 0,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "custom", "factor": 1.0},
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "img_proj_type": "unet",
    "patch_size": 1,
    "patch_embed_hidden_dim": 32,
    "image_base_size": 256,  # 16-pixel tokens: a 16 x 16 grid at ratio 1:1
    "vae": {  # AutoencoderKLConv3D's keys; the release's latent, factors and scaling
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 32,
        "block_out_channels": [32, 32, 32, 64, 64],
        "layers_per_block": 1,
        "ffactor_spatial": 16,
        "ffactor_temporal": 4,
        "sample_size": 256,
        "sample_tsize": 16,
        "scaling_factor": 0.562679178327931,
        "shift_factor": None,
        "downsample_match_channel": True,
        "upsample_match_channel": True,
    },
    "vit": {  # Siglip2VisionConfig's keys
        "num_patches": 16,
        "patch_size": 8,
        "num_channels": 3,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    },
    "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2},
    "vit_processor": {"patch_size": 8, "max_num_patches": 16},  # Siglip2ImageProcessor's keys
}
# generation_config.json: the release's keys; 8 steps (the release's 50 is slow for a
# random tiny model whose images are noise anyway), guidance 2.5, the release's shift.
TINY_GENERATION: dict[str, Any] = {
    "diff_infer_steps": 8,
    "diff_guidance_scale": 2.5,
    "flow_shift": 3.0,
    "sequence_template": "pretrain",  # the base release's: no role words, no system prompt
    "use_system_prompt": "None",
}
TEXT_VOCAB = 320  # the byte-level BPE's entries; the special tokens come after
INIT_STD = 0.08
SHARD_BYTES = 256 << 10


def backbone_tensors(config: HunyuanImage3Config, seed: int) -> dict[str, torch.Tensor]:
    """The backbone's random tensors under the reference's checkpoint names."""
    generator = torch.Generator().manual_seed(seed)
    hidden, dim = config.hidden_size, config.head_dim

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm_weight(size: int = hidden) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    tensors = {"model.wte.weight": normal(config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        q = normal(config.num_attention_heads * dim, hidden)
        k = normal(config.num_key_value_heads * dim, hidden)
        v = normal(config.num_key_value_heads * dim, hidden)
        tensors[f"{prefix}.self_attn.qkv_proj.weight"] = qkv_to_groups(config, q, k, v)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(
            hidden, config.num_attention_heads * dim
        )
        tensors[f"{prefix}.self_attn.query_layernorm.weight"] = norm_weight(dim)
        tensors[f"{prefix}.self_attn.key_layernorm.weight"] = norm_weight(dim)
        tensors[f"{prefix}.input_layernorm.weight"] = norm_weight()
        tensors[f"{prefix}.post_attention_layernorm.weight"] = norm_weight()
        size = config.moe_intermediate_size
        tensors[f"{prefix}.mlp.gate.wg.weight"] = normal(config.n_routed_experts, hidden, std=0.5)
        for e in range(config.n_routed_experts):
            tensors[f"{prefix}.mlp.experts.{e}.gate_and_up_proj.weight"] = normal(2 * size, hidden)
            tensors[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = normal(hidden, size)
        shared = size * config.n_shared_experts
        tensors[f"{prefix}.mlp.shared_mlp.gate_and_up_proj.weight"] = normal(2 * shared, hidden)
        tensors[f"{prefix}.mlp.shared_mlp.down_proj.weight"] = normal(hidden, shared)
    tensors["model.ln_f.weight"] = norm_weight()
    tensors["lm_head.weight"] = normal(config.vocab_size, hidden)
    return tensors


def image_part_tensors(config: HunyuanImage3Config, seed: int) -> dict[str, torch.Tensor]:
    """The image parts' tensors: PyTorch's default initialisation under a fixed seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = HunyuanImage3Parts(config)
    return {name: tensor.detach().clone() for name, tensor in parts.state_dict().items()}


def build_tiny_hunyuan_image3(
    folder: str | Path, seed: int = 0, max_shard_bytes: int = SHARD_BYTES, **overrides: Any
) -> Path:
    """Write the tiny model (config fields overridden by ``overrides``) to `folder`; the same
    seed writes the same bytes. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TEXT_VOCAB)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    save_tiny_tokenizer(tokenizer, folder)
    raw = json.loads(json.dumps(TINY_HUNYUAN_IMAGE3)) | overrides
    if "vit_aligner" not in overrides:  # the aligner projects to the backbone's width
        raw["vit_aligner"]["n_embed"] = raw["hidden_size"]
    if tokenizer.get_vocab_size(with_added_tokens=True) > raw["vocab_size"]:
        raise ValueError(f"vocab_size {raw['vocab_size']} is below the tokenizer's entries")
    for key, token in (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD)):
        raw[key] = tokenizer.token_to_id(token)
    config = HunyuanImage3Config.from_dict(raw)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    generation = TINY_GENERATION | {
        key: raw[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tensors = backbone_tensors(config, seed) | image_part_tensors(config, seed + 1)
    save_safetensors(tensors, folder, max_shard_bytes)
    return folder
