"""The image decoder's published VAE: diffusers ``AutoencoderKL`` under ``image_refiner.vae.``.

The published checkpoint keeps the image decoder outside the sharded index, in the file
``visual_decoder_config.weight_path`` names (``image_decoder/image_decoder.safetensors``);
the refiner container (``image_refiner.py``'s ``ImageRefinerContainer``) holds
``base_transformer``, ``vae`` = ``AutoencoderKL(**vae_config)`` and ``cond_proj``, its state
dict stored with the prefix ``image_refiner.``. The pipeline's last step turns the denoised
latent into pixels: ``latents / scaling_factor + shift_factor`` → ``vae.decode`` →
``VaeImageProcessor.postprocess`` (``(x / 2 + 0.5).clamp(0, 1)``, × 255, rounded).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from safetensors import safe_open

from omniflow.models.omni.checkpoint import CheckpointError, fill_strictly, read_config

VAE_PREFIX = "image_refiner.vae."
WEIGHT_PATH = "image_decoder/image_decoder.safetensors"  # published visual_decoder_config value


def tiny_vae_config() -> dict[str, Any]:
    """A tiny ``vae_config``: 4 blocks (8 pixels per latent pixel, as published), 4 channels;
    the published one is a Flux-style 16-channel VAE (its widths are not reproduced)."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": [8, 8, 16, 16],
        "layers_per_block": 1,
        "act_fn": "silu",
        "latent_channels": 4,
        "norm_num_groups": 4,
        "sample_size": 32,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


def tiny_visual_decoder_config(codebook_dim: int) -> dict[str, Any]:
    """``visual_decoder_config``: the ViT decoder's, the refiner transformer's, the VAE's and
    the scheduler's configs under their published keys, every width tiny (ViT patch 14,
    merge 2 and transformer patch 2 as published, so a token is 28 pixels and the refiner
    works in multiples of 16 as it does there)."""
    vit = {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "layer_norm_eps": 1e-6,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "codebook_dim": codebook_dim,
        "swiglu": True,
        "subln": True,
        "hidden_act": "gelu",
        "k_bias": False,
    }
    transformer = {
        "patch_size": 2,
        "in_channels": tiny_vae_config()["latent_channels"],
        "hidden_size": 48,
        "num_layers": 2,
        "num_refiner_layers": 1,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "multiple_of": 16,
        "norm_eps": 1e-5,
        "axes_dim_rope": [8, 8, 8],
        "axes_lens": [300, 512, 512],
        "text_feat_dim": 40,
        "timestep_scale": 1000.0,
    }
    return {
        "weight_path": WEIGHT_PATH,
        "codebook_dim": codebook_dim,
        "image_decoder_config": vit,
        "transformer_config": transformer,
        "vae_config": tiny_vae_config(),
        "scheduler_config": {"num_train_timesteps": 1000, "dynamic_time_shift": True},
    }


def vae_kwargs(vae_config: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``vae_config`` that ``AutoencoderKL`` takes (the published code drops the
    rest the same way, ``_clean_config_dict``)."""
    accepted = set(inspect.signature(AutoencoderKL.__init__).parameters) - {"self"}
    return {k: v for k, v in vae_config.items() if k in accepted and not k.startswith("_")}


def decoder_config(folder: Path, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and its ``visual_decoder_config`` (an error naming the role if absent)."""
    config = read_config(folder, role)
    decoder = config.get("visual_decoder_config")
    if not isinstance(decoder, dict) or not isinstance(decoder.get("vae_config"), dict):
        raise CheckpointError(
            f"role {role}: {folder}/config.json has no visual_decoder_config.vae_config "
            "(a tiny folder built before the image decoder was published-layout: delete it "
            "to rebuild)"
        )
    return config, decoder


def load_vae(folder: str | Path, role: str, device: str | torch.device = "cpu") -> AutoencoderKL:
    """The refiner's ``AutoencoderKL``, every tensor under ``image_refiner.vae.`` of the image
    decoder file loaded strictly (missing, unexpected or mis-shaped: ``CheckpointError``)."""
    folder = Path(folder)
    decoder = decoder_config(folder, role)[1]
    path = folder / str(decoder.get("weight_path", WEIGHT_PATH))
    if not path.is_file():
        raise CheckpointError(f"role {role}: image decoder weights {path} missing from {folder}")
    vae = AutoencoderKL(**vae_kwargs(decoder["vae_config"]))
    with safe_open(str(path), framework="pt") as f:
        fill_strictly(
            vae,
            set(f.keys()),
            lambda names: {n: f.get_tensor(n) for n in names},
            VAE_PREFIX,
            role,
            path,
        )
    return vae.to(device).eval()


def vae_scale(vae: AutoencoderKL) -> int:
    """Pixels per latent pixel (the pipeline's ``vae_scale_factor``)."""
    return int(2 ** (len(vae.config["block_out_channels"]) - 1))


@torch.no_grad()
def latents_to_pixels(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """uint8 RGB [H, W, 3] of a latent [1, C, h, w], as the refiner pipeline decodes it."""
    z = latents.to(vae.dtype)
    scaling, shift = vae.config.get("scaling_factor"), vae.config.get("shift_factor")
    if scaling is not None:
        z = z / scaling
    if shift is not None:
        z = z + shift
    image = vae.decode(z, return_dict=False)[0][0]  # [3, H, W] in about [-1, 1]
    pixels = (image / 2 + 0.5).clamp(0, 1)
    return (pixels * 255.0).round().to(torch.uint8).permute(1, 2, 0).cpu()
