"""``vae_decoder`` role: a HunyuanImage-3 latent → PNG, through the model's VAE decoder.

Input (from diffusion):
    tensors["latent"]: float [C, h*p, w*p]     the denoised latent (p: the patch size)
Output:
    image:  bytes    PNG, RGB, width x height
    width:  int
    height: int
    mime:   "image/png"

Same latent, same PNG bytes (the decoder is deterministic). Options: ``VAEDecoderOptions``
in roles/options.py.
"""

from __future__ import annotations

from typing import Any

import torch

from omniflow.roles.base import ModelActor
from omniflow.roles.hunyuan_backbone import image_parts
from omniflow.roles.image_params import png_bytes
from omniflow.roles.options import NoParams, VAEDecoderOptions
from omniflow.runtime.actor import BadRequest, Context, Request


class VAEDecoderRole(ModelActor):
    Options = VAEDecoderOptions
    Params = NoParams
    Makes = ("image",)
    options: VAEDecoderOptions

    async def setup(self) -> None:
        self.start_model_thread()
        # The VAE's decoder is all it reads (vae.decoder.*).
        self.parts = await self._run(image_parts, self.options, self.role, True)
        self.channels = self.parts.config.latent_channels

    async def handle(self, request: Request, ctx: Context) -> dict[str, Any]:
        latent = self._latent(request.tensors.get("latent"))
        png, (width, height) = await self._run(self._decode, latent)
        return {"image": png, "width": width, "height": height, "mime": "image/png"}

    def _latent(self, latent: Any) -> torch.Tensor:
        if not torch.is_tensor(latent) or not latent.is_floating_point() or latent.dim() != 3:
            got = "nothing" if latent is None else getattr(latent, "shape", type(latent).__name__)
            raise BadRequest("latent", f"expected a float tensor [C, h, w], got {got}")
        channels, height, width = latent.shape
        if channels != self.channels:
            raise BadRequest("latent", f"expected {self.channels} channels, got {channels}")
        patch = self.parts.config.patch_size
        if height * width > self.options.max_image_tokens * patch * patch:
            raise BadRequest(
                "latent", f"{height}x{width} exceeds the limit (option max_image_tokens)"
            )
        if not bool(torch.isfinite(latent).all()):
            raise BadRequest("latent", "holds NaN or infinite values")
        return latent

    def _decode(self, latent: torch.Tensor) -> tuple[bytes, tuple[int, int]]:
        rgb = self.parts.decode_image(latent)  # uint8 [H, W, 3]
        return png_bytes(rgb.numpy()), (rgb.shape[1], rgb.shape[0])
