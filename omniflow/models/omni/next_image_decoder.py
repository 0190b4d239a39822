"""The published image decoder end to end: codes → codebook rows → ViT decoder → refiner → VAE.

As ``modular_longcat_next_visual.py``'s ``decode_image`` and ``image_refiner.py``'s
``RefinerPipeline`` do it, for one image:

1. the 8 levels' rows of ``visual_bridge_model.quantizer.quantize.codebooks.i.embed`` (the
   vision tokenizer's codebooks, read from the shards) summed per token;
2. ``image_decoder.*`` (``next_vit_decoder.py``): a CLIP-normalised picture, 28 px a token;
3. that picture de-normalised to [0, 1], then to [-1, 1], resized (bilinear) up to the next
   multiple of ``patch_size × vae_scale`` (16 as published) and VAE-encoded: the reference
   latent ``(z - shift_factor) · scaling_factor``;
4. Euler steps of ``image_refiner.base_transformer`` (``next_refiner.py``) from noise (t = 0)
   to the image (t = 1) on the published scheduler times, the caption being
   ``image_refiner.cond_proj`` of the summed rows; guidance as published with three branches
   (caption + reference, reference only, neither):
   ``uncond + image_scale · (ref - uncond) + text_scale · (text - ref)``;
5. the VAE decode (``next_image.latents_to_pixels``).

So an h × w token grid becomes an image of ``image_size(grid)`` pixels: each side
max(16, ⌈28·n / 16⌉·16). Two things are ours: the posterior is sampled with a generator
seeded ``seed + 1`` (the release draws it from the global RNG) and the noise with one seeded
``seed`` (the release uses 42); the text and reference branches run as one batch of two.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from safetensors import safe_open
from torch import nn

from omniflow.models.omni.checkpoint import CheckpointError, fill_strictly, read_tensors
from omniflow.models.omni.next_codes import VISION_PREFIX
from omniflow.models.omni.next_image import (
    WEIGHT_PATH,
    decoder_config,
    latents_to_pixels,
    vae_kwargs,
    vae_scale,
)
from omniflow.models.omni.next_refiner import RefinerTransformer, schedule
from omniflow.models.omni.next_vit_decoder import VisionTransformerDecoder

CODEBOOK = VISION_PREFIX + "visual_bridge_model.quantizer.quantize.codebooks.{}.embed"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_GUIDANCE = 1.5  # RefinerPipeline.__call__'s image_guidance_scale default


class IdentityWithArgs(nn.Module):
    """The published ``cond_proj`` where codebook and caption widths agree (a ``_dummy``
    buffer in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("_dummy", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ImageRefiner(nn.Module):
    """``ImageRefinerContainer``: ``base_transformer``, ``vae``, ``cond_proj``."""

    def __init__(self, vdc: dict[str, Any]) -> None:
        super().__init__()
        tc = vdc["transformer_config"]
        self.base_transformer = RefinerTransformer(tc)
        self.vae = AutoencoderKL(**vae_kwargs(vdc["vae_config"]))
        text_dim = tc.get("text_feat_dim", 3584)
        codebook_dim = vdc.get("codebook_dim", text_dim)
        self.cond_proj: nn.Module = (
            nn.Linear(codebook_dim, text_dim) if codebook_dim != text_dim else IdentityWithArgs()
        )


class NextImageDecoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        vdc = config["visual_decoder_config"]
        vq = config["visual_config"]["vq_config"]
        self.codebook_sizes = [int(n) for n in vq["codebook_sizes"]]
        dim = int(vq["codebook_dim"])
        self.codebooks = nn.ParameterList(
            nn.Parameter(torch.zeros(n + 1, dim), requires_grad=False) for n in self.codebook_sizes
        )
        self.image_decoder = VisionTransformerDecoder(vdc["image_decoder_config"])
        self.image_refiner = ImageRefiner(vdc)
        self.dynamic_shift = bool(vdc.get("scheduler_config", {}).get("dynamic_time_shift"))
        vit = vdc["image_decoder_config"]
        self.token_pixels = int(vit["patch_size"]) * int(vit["spatial_merge_size"])
        self.base = self.image_refiner.base_transformer.patch * vae_scale(self.image_refiner.vae)

    def image_size(self, grid: tuple[int, int]) -> tuple[int, int]:
        """(height, width) in pixels of a token grid (h, w), as the published pipeline makes."""
        return side_pixels(grid[0], self.token_pixels, self.base), side_pixels(
            grid[1], self.token_pixels, self.base
        )

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        """Summed codebook rows [n, codebook_dim] of codes [n, L]."""
        device = self.codebooks[0].device
        return sum(book[codes[:, i].to(device)] for i, book in enumerate(self.codebooks))

    def reference(self, picture: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The reference latent [1, C, h, w] of the ViT decoder's CLIP-normalised [3, H, W]."""
        mean = torch.tensor(CLIP_MEAN, device=picture.device).view(3, 1, 1)
        std = torch.tensor(CLIP_STD, device=picture.device).view(3, 1, 1)
        img = torch.clamp((picture * std + mean) / (1 / 255) / 255.0, 0, 1)[None]
        img = 2.0 * img - 1.0  # RefinerImageProcessor.normalize
        if img.min() >= 0.0 and img.max() <= 1.0:  # _preprocess_to_vae_range, as published
            img = img * 2.0 - 1.0
        img = img.clamp(-1, 1)
        height, width = img.shape[-2:]
        target = (side_pixels_of(height, self.base), side_pixels_of(width, self.base))
        if (height, width) != target:
            img = F.interpolate(img, size=target, mode="bilinear", align_corners=False)
        vae = self.image_refiner.vae
        z = vae.encode(img.to(vae.dtype)).latent_dist.sample(generator)
        shift, scaling = vae.config.get("shift_factor"), vae.config.get("scaling_factor")
        if shift is not None:
            z = z - shift
        if scaling is not None:
            z = z * scaling
        return z

    def velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        caption: torch.Tensor,
        ref: torch.Tensor,
        scales: tuple[float, float],
    ) -> torch.Tensor:
        model = self.image_refiner.base_transformer
        text_scale, image_scale = scales
        times = t.expand(x.shape[0]).to(x.dtype)
        if text_scale <= 1.0 and image_scale <= 1.0:
            return model(x, times, caption, ref)
        both = model(
            torch.cat([x, x]),
            torch.cat([times, times]),
            torch.cat([caption, torch.zeros_like(caption)]),
            torch.cat([ref, ref]),
        )
        text, ref_only = both.chunk(2)
        uncond = model(x, times, torch.zeros_like(caption), None)
        if text_scale > 1.0 and image_scale > 1.0:
            return uncond + image_scale * (ref_only - uncond) + text_scale * (text - ref_only)
        if text_scale > 1.0:
            return uncond + text_scale * (text - uncond)
        return uncond + image_scale * (ref_only - uncond)

    @torch.no_grad()
    def latent(
        self,
        codes: torch.Tensor,
        grid: tuple[int, int],
        steps: int,
        text_scale: float,
        seed: int,
        image_scale: float = IMAGE_GUIDANCE,
    ) -> torch.Tensor:
        """The denoised latent [1, C, h, w] (the VAE decoder's input) of codes [h*w, L]."""
        if codes.shape[0] != grid[0] * grid[1]:
            raise ValueError(f"{codes.shape[0]} codes do not fill a {grid[0]}x{grid[1]} grid")
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        rows = self.rows(codes)
        picture = self.image_decoder(rows, grid)
        device = rows.device
        ref = self.reference(picture, torch.Generator(device=device).manual_seed(seed + 1))
        x = torch.randn(
            ref.shape, generator=torch.Generator(device=device).manual_seed(seed), device=device
        )
        caption = self.image_refiner.cond_proj(rows)[None]
        times = schedule(steps, ref.shape[-2] * ref.shape[-1], self.dynamic_shift).to(device)
        for i in range(steps):
            v = self.velocity(x, times[i], caption, ref, (text_scale, image_scale))
            x = (x.float() + (times[i + 1] - times[i]) * v).to(v.dtype)
        return x

    def decode(
        self, codes: torch.Tensor, grid: tuple[int, int], steps: int, cfg_scale: float, seed: int
    ) -> torch.Tensor:
        """uint8 RGB [H, W, 3] of codes [h*w, L]; ``cfg_scale`` is the text guidance."""
        latent = self.latent(codes, grid, steps, cfg_scale, seed)
        return latents_to_pixels(self.image_refiner.vae, latent)


def side_pixels_of(pixels: int, base: int) -> int:
    return max(base, math.ceil(pixels / base) * base)


def side_pixels(tokens: int, token_pixels: int, base: int) -> int:
    """Pixels of one side of ``tokens`` tokens: the ViT decoder's, rounded up for the refiner."""
    return side_pixels_of(tokens * token_pixels, base)


def load_next_image_decoder(
    folder: str | Path, role: str, device: str | torch.device = "cpu"
) -> NextImageDecoder:
    """Every tensor of the image decoder file (``image_decoder.*`` and ``image_refiner.*``,
    nothing else) and the vision codebooks from the shards, loaded strictly."""
    folder = Path(folder)
    config, vdc = decoder_config(folder, role)
    for key in ("image_decoder_config", "transformer_config"):
        if not isinstance(vdc.get(key), dict):
            raise CheckpointError(f"role {role}: {folder}/config.json has no {key}")
    model = NextImageDecoder(config)
    path = folder / str(vdc.get("weight_path", WEIGHT_PATH))
    if not path.is_file():
        raise CheckpointError(f"role {role}: image decoder weights {path} missing from {folder}")
    with safe_open(str(path), framework="pt") as f:
        stored = set(f.keys())
        for name in sorted(stored):
            if not name.startswith(("image_decoder.", "image_refiner.")):
                raise CheckpointError(f"role {role}: unexpected tensor {name} in {path}")
        parts = (("image_decoder.", model.image_decoder), ("image_refiner.", model.image_refiner))
        for prefix, part in parts:
            fill_strictly(
                part, stored, lambda ns: {n: f.get_tensor(n) for n in ns}, prefix, role, path
            )
    names = [CODEBOOK.format(i) for i in range(len(model.codebooks))]
    for name, book in zip(names, model.codebooks, strict=True):
        got = read_tensors(folder, [name], role)[name]
        if tuple(got.shape) != tuple(book.shape):
            raise CheckpointError(
                f"role {role}: tensor {name} in {folder} has shape {list(got.shape)}, "
                f"expected {list(book.shape)}"
            )
        book.data.copy_(got)
    return model.to(device).eval()


def tiny_image_decoder_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random ``image_decoder.*`` and ``image_refiner.*`` tensors under their published names
    (the file ``visual_decoder_config.weight_path``)."""
    vdc = config["visual_decoder_config"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = {
            "image_decoder.": VisionTransformerDecoder(vdc["image_decoder_config"]),
            "image_refiner.": ImageRefiner(vdc),
        }
    return {prefix + n: t for prefix, m in parts.items() for n, t in m.state_dict().items()}
