"""``image_decoder`` role: vision codes → PNG, through the flow-matching refiner with CFG.

``model_path`` is a published-layout LongCat-Next folder: the pixels come from its
refiner VAE (``image_refiner.vae.*`` of ``image_decoder/image_decoder.safetensors``, diffusers'
``AutoencoderKL``). The codes → latent part is still our stand-in, read from ``standin_path``.

Input:
    tensors["image_codes"]: int64 (or int32) [h*w, 8]   RVQ ids, row-major over the grid
    data["image_grid"]: [h, w]
    params: "cfg_scale" (float, default option ``cfg_scale``), "seed" (int noise seed, default 0),
            "steps" (denoising steps, default option ``steps``)
Output:
    image:  bytes    PNG, RGB, height = h * pixels_per_token, width = w * pixels_per_token
    width:  int
    height: int
    mime:   "image/png"

Options: ``ImageDecoderOptions`` in roles/options.py.
"""

from __future__ import annotations

from typing import Any

import torch

from omniflow.models.omni import ImageDecoder, ensure_model, load_image_decoder
from omniflow.models.omni.next_builder import ensure_next
from omniflow.models.omni.next_image import latents_to_pixels, load_vae, vae_scale
from omniflow.roles.base import ModelActor
from omniflow.roles.image_params import png_bytes
from omniflow.roles.options import ImageDecoderOptions, ImageDecoderParams
from omniflow.runtime.actor import BadRequest, Context, Request

_MAX_CFG_SCALE = 30.0


class ImageDecoderRole(ModelActor):
    Options = ImageDecoderOptions
    Params = ImageDecoderParams
    Makes = ("image",)
    options: ImageDecoderOptions

    async def setup(self) -> None:
        opts = self.options
        self.steps = opts.steps
        self.cfg_scale = opts.cfg_scale
        self.max_tokens = opts.max_tokens
        self.start_model_thread()
        self.model: ImageDecoder = await self._run(self._load)
        # Warm-up: the first forward pays for allocator and kernel setup; do it before serving.
        warm = torch.zeros(1, len(self.model.config.codebook_sizes), dtype=torch.int64)
        await self._run(self._decode, warm, (1, 1), self.cfg_scale, 0, self.steps)

    def _load(self) -> ImageDecoder:
        opts = self.options
        if opts.build_tiny:
            ensure_next(opts.model_path, opts.seed)
            ensure_model("image_decoder", opts.standin_path, opts.seed)
        self.vae = load_vae(opts.model_path, "image_decoder", opts.device)
        model = load_image_decoder(opts.standin_path, opts.device)
        channels = self.vae.config["latent_channels"]
        if (model.config.latent_channels, model.config.vae_scale) != (
            channels,
            vae_scale(self.vae),
        ):
            raise ValueError(
                f"role image_decoder: the stand-in at {opts.standin_path} makes "
                f"{model.config.latent_channels}-channel latents for a scale of "
                f"{model.config.vae_scale}; the VAE in {opts.model_path} takes {channels} "
                f"channels at a scale of {vae_scale(self.vae)}"
            )
        return model

    async def handle(self, request: Request, ctx: Context) -> dict[str, Any]:
        grid = self._grid(request.data.get("image_grid"))
        codes = self._codes(request.tensors.get("image_codes"), grid)
        cfg_scale = request.params.get("cfg_scale", self.cfg_scale)
        if not isinstance(cfg_scale, (int, float)) or not 0.0 <= cfg_scale <= _MAX_CFG_SCALE:
            raise BadRequest(
                "cfg_scale", f"expected a number in [0, {_MAX_CFG_SCALE}], got {cfg_scale!r}"
            )
        seed = request.params.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise BadRequest("seed", f"expected an integer, got {seed!r}")
        steps = request.params.get("steps", self.steps)
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 200:
            raise BadRequest("steps", f"expected an integer in [1, 200], got {steps!r}")
        png, (height, width) = await self._run(
            self._decode, codes, grid, float(cfg_scale), seed, steps
        )
        return {"image": png, "width": width, "height": height, "mime": "image/png"}

    def _grid(self, grid: Any) -> tuple[int, int]:
        if (
            not isinstance(grid, (list, tuple))
            or len(grid) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in grid)
        ):
            raise BadRequest("image_grid", f"expected [h, w] of positive integers, got {grid!r}")
        if grid[0] * grid[1] > self.max_tokens:
            raise BadRequest(
                "image_grid",
                f"{grid[0]}x{grid[1]} tokens exceeds the limit of {self.max_tokens} "
                "(option max_tokens)",
            )
        return int(grid[0]), int(grid[1])

    def _codes(self, codes: Any, grid: tuple[int, int]) -> torch.Tensor:
        levels = len(self.model.config.codebook_sizes)
        if not torch.is_tensor(codes) or codes.dtype not in (torch.int64, torch.int32):
            got = "nothing" if codes is None else getattr(codes, "dtype", type(codes).__name__)
            raise BadRequest("image_codes", f"expected an int64 tensor [h*w, {levels}], got {got}")
        if list(codes.shape) != [grid[0] * grid[1], levels]:
            raise BadRequest(
                "image_codes",
                f"expected shape [{grid[0] * grid[1]}, {levels}] for grid {list(grid)}, "
                f"got {list(codes.shape)}",
            )
        for level, size in enumerate(self.model.config.codebook_sizes):
            column = codes[:, level]
            if int(column.min()) < 0 or int(column.max()) >= size:
                raise BadRequest("image_codes", f"level {level} ids must lie in [0, {size})")
        return codes.to(torch.int64)

    def _decode(
        self, codes: torch.Tensor, grid: tuple[int, int], cfg_scale: float, seed: int, steps: int
    ) -> tuple[bytes, tuple[int, int]]:
        latent = self.model.latent(codes, grid, steps=steps, cfg_scale=cfg_scale, seed=seed)
        pixels = latents_to_pixels(self.vae, latent)
        return png_bytes(pixels.numpy()), (pixels.shape[0], pixels.shape[1])
