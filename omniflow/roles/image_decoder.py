"""``image_decoder`` role: vision codes → PNG, as the published image decoder makes it.

``model_path`` is a published-layout LongCat-Next folder. The role reads the vision
codebooks (``model.visual_tokenizer.visual_bridge_model.quantizer.quantize.codebooks.i.embed``
from the shards) and every tensor of ``image_decoder/image_decoder.safetensors``: the ViT
decoder ``image_decoder.*`` and the refiner ``image_refiner.{base_transformer,vae,cond_proj}.*``
(``models/omni/next_image_decoder.py``).

Input:
    tensors["image_codes"]: int64 (or int32) [h*w, 8]   RVQ ids, row-major over the grid
    data["image_grid"]: [h, w]
    params: "cfg_scale" (float, default option ``cfg_scale``), "seed" (int noise seed, default 0),
            "steps" (denoising steps, default option ``steps``)
Output:
    image:  bytes    PNG, RGB; each side of n tokens max(16, ceil(28 n / 16) * 16) pixels
                     (the ViT decoder's 28 px a token, rounded up for the refiner)
    width:  int
    height: int
    mime:   "image/png"

Options: ``ImageDecoderOptions`` in roles/options.py.
"""

from __future__ import annotations

from typing import Any

import torch

from omniflow.models.omni.checkpoint import ensure_next
from omniflow.models.omni.next_image_decoder import NextImageDecoder, load_next_image_decoder
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
        self.model: NextImageDecoder = await self._run(self._load)
        # Warm-up: the first forward pays for allocator and kernel setup; do it before serving.
        warm = torch.zeros(1, len(self.model.codebook_sizes), dtype=torch.int64)
        await self._run(self._decode, warm, (1, 1), self.cfg_scale, 0, self.steps)

    def _load(self) -> NextImageDecoder:
        opts = self.options
        if opts.build_tiny:
            ensure_next(opts.model_path, opts.seed)
        return load_next_image_decoder(opts.model_path, "image_decoder", opts.device)

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
        levels = len(self.model.codebook_sizes)
        if not torch.is_tensor(codes) or codes.dtype not in (torch.int64, torch.int32):
            got = "nothing" if codes is None else getattr(codes, "dtype", type(codes).__name__)
            raise BadRequest("image_codes", f"expected an int64 tensor [h*w, {levels}], got {got}")
        if list(codes.shape) != [grid[0] * grid[1], levels]:
            raise BadRequest(
                "image_codes",
                f"expected shape [{grid[0] * grid[1]}, {levels}] for grid {list(grid)}, "
                f"got {list(codes.shape)}",
            )
        for level, size in enumerate(self.model.codebook_sizes):
            column = codes[:, level]
            if int(column.min()) < 0 or int(column.max()) >= size:
                raise BadRequest("image_codes", f"level {level} ids must lie in [0, {size})")
        return codes.to(torch.int64)

    def _decode(
        self, codes: torch.Tensor, grid: tuple[int, int], cfg_scale: float, seed: int, steps: int
    ) -> tuple[bytes, tuple[int, int]]:
        pixels = self.model.decode(codes, grid, steps, cfg_scale, seed)
        return png_bytes(pixels.numpy()), (pixels.shape[0], pixels.shape[1])
