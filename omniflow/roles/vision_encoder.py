"""``vision_encoder`` role: image → LongCat-style vision codes and LLM input embeddings.

Input (one of):
    data["image"]: bytes          an encoded image (PNG, JPEG, anything Pillow reads)
    data["images"]: [bytes, ...]  several; then image_spans lists [hash, tokens] per image
    tensors["image"]: uint8 [H, W, 3]
Output:
    image_embeds: float32 [N, hidden_size]   one LLM input vector per token
    image_codes:  int64 [N, 8]               RVQ ids, row-major over the token grid
    image_grid:   [h, w]                     token grid, N = h * w
    image_hash:   str                        blake2b-128 hex of the input (cache / prefix key)

The image is resized to a multiple of the model's pixels per token (aspect kept) with at most
``max_pixels`` pixels. An image whose header claims more than ``max_image_pixels`` is rejected
before its pixels are decoded. Options: ``VisionEncoderOptions`` in roles/options.py.
"""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from omniflow.content import content_hash
from omniflow.models.omni.checkpoint import ensure_next
from omniflow.models.omni.next_vision import NextVisionTokenizer, load_next_vision
from omniflow.roles.encoder_cache import CachingEncoder, EncoderOutputCache, role_cache
from omniflow.roles.options import NoParams, VisionEncoderOptions
from omniflow.runtime.actor import BadRequest, Context, Request

__all__ = ["EncoderOutputCache", "VisionEncoderRole", "content_hash", "fit_to_grid"]


def fit_to_grid(width: int, height: int, step: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) near the original aspect, multiples of ``step``, at most ``max_pixels``."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    new_w = max(step, round(width * scale / step) * step)
    new_h = max(step, round(height * scale / step) * step)
    while new_w * new_h > max_pixels and max(new_w, new_h) > step:
        if new_w >= new_h:
            new_w -= step
        else:
            new_h -= step
    return new_w, new_h


class VisionEncoderRole(CachingEncoder):
    Options = VisionEncoderOptions
    Params = NoParams
    options: VisionEncoderOptions

    async def setup(self) -> None:
        opts = self.options
        self.max_pixels = opts.max_pixels
        self.max_image_pixels = opts.max_image_pixels
        self.max_bytes = opts.max_bytes
        self.cache = role_cache(self)  # in the deployment's page pool when there is one
        self.encoded = 0
        self.start_model_thread()
        self.model: NextVisionTokenizer = await self._run(self._load)
        step = self.model.config.pixels_per_token
        if self.max_pixels < step * step:
            raise ValueError(f"max_pixels {self.max_pixels} is below one token ({step}x{step})")
        # Warm-up: the first forward pays for allocator and kernel setup; do it before serving.
        await self._run(self.model.encode, torch.zeros(step, step, 3, dtype=torch.uint8))

    def _load(self) -> NextVisionTokenizer:
        opts = self.options
        if opts.build_tiny:
            ensure_next(opts.model_path, opts.seed, hidden_size=opts.hidden_size)
        return load_next_vision(opts.model_path, opts.device)

    async def handle(self, request: Request, ctx: Context) -> dict[str, Any]:
        images = request.data.get("images")
        if images is None:
            return await self._one(
                request.data.get("image"), request.tensors.get("image"), ctx, "image"
            )
        if not isinstance(images, list) or not images:
            raise BadRequest("images", "expected a non-empty list of encoded images")
        outputs = [await self._one(raw, None, ctx, f"images[{i}]") for i, raw in enumerate(images)]
        # Several images: embeddings back to back; image_spans says which rows are which.
        return {
            "image_embeds": torch.cat([o["image_embeds"] for o in outputs]),
            "image_codes": torch.cat([o["image_codes"] for o in outputs]),
            "image_grid": outputs[-1]["image_grid"],
            "image_spans": [[o["image_hash"], int(o["image_embeds"].shape[0])] for o in outputs],
        }

    async def _one(self, raw: Any, pixels: Any, ctx: Context, field: str) -> dict[str, Any]:
        if raw is None and pixels is not None:
            self._check_pixels(pixels)
            blob = repr(tuple(pixels.shape)).encode() + pixels.contiguous().numpy().tobytes()
            key = await _hash(blob)
            source: bytes | torch.Tensor = pixels
        elif isinstance(raw, (bytes, bytearray, memoryview)):
            if len(raw) > self.max_bytes:
                raise BadRequest(field, f"{len(raw)} bytes exceeds the limit of {self.max_bytes}")
            source = bytes(raw)
            key = await _hash(source)
        else:
            got = "nothing" if raw is None else type(raw).__name__
            raise BadRequest(field, f"expected encoded image bytes or a uint8 tensor, got {got}")
        cached = await self.cache.get(key, ctx)
        if cached is not None:
            ctx.add_usage(encoder_cache_hits=1)
            return cached
        try:
            output = await self._run(self._encode, source)
        except BadRequest as e:
            if field == "image":
                raise
            raise BadRequest(field, str(e).split(": ", 1)[-1]) from None
        self.encoded += 1
        output["image_hash"] = key
        return await self.cache.put(key, output, ctx)

    def _encode(self, source: bytes | torch.Tensor) -> dict[str, Any]:
        image = self._decode(source) if isinstance(source, bytes) else _to_pil(source)
        step = self.model.config.pixels_per_token
        size = fit_to_grid(image.width, image.height, step, self.max_pixels)
        if size != image.size:
            image = image.resize(size, Image.Resampling.BICUBIC)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())
        codes, grid = self.model.encode(pixels)
        embeds = self.model.embed(codes)
        return {
            "image_embeds": embeds.float(),  # on the device: the hop decides (CUDA IPC)
            "image_codes": codes,
            "image_grid": [int(grid[0]), int(grid[1])],
        }

    def _decode(self, data: bytes) -> Image.Image:
        try:
            image = Image.open(io.BytesIO(data))  # reads the header only
        except Image.DecompressionBombError as e:
            raise BadRequest("image", f"too large: {e}") from None
        except UnidentifiedImageError:
            raise BadRequest("image", "unreadable image: not a format Pillow recognizes") from None
        except (OSError, ValueError) as e:
            raise BadRequest("image", f"unreadable image: {e}") from None
        width, height = image.size
        if width <= 0 or height <= 0:
            raise BadRequest("image", f"empty image {width}x{height}")
        if width * height > self.max_image_pixels:
            raise BadRequest(
                "image",
                f"{width}x{height} = {width * height} pixels exceeds the limit of "
                f"{self.max_image_pixels} (option max_image_pixels)",
            )
        try:
            return image.convert("RGB")  # decodes the pixels; truncated data fails here
        except (OSError, ValueError, SyntaxError) as e:
            raise BadRequest("image", f"unreadable image data: {e}") from None

    def _check_pixels(self, pixels: Any) -> None:
        if not torch.is_tensor(pixels) or pixels.dtype != torch.uint8 or pixels.dim() != 3:
            raise BadRequest("image", "a tensor image must be uint8 [H, W, 3]")
        height, width, channels = pixels.shape
        if channels != 3 or height == 0 or width == 0:
            raise BadRequest(
                "image", f"a tensor image must be uint8 [H, W, 3], got {[height, width, channels]}"
            )
        if height * width > self.max_image_pixels:
            raise BadRequest(
                "image",
                f"{width}x{height} pixels exceeds the limit of {self.max_image_pixels} "
                "(option max_image_pixels)",
            )


async def _hash(data: bytes) -> str:
    # hashlib drops the GIL on large inputs: hash big ones in a thread so the loop keeps serving.
    if len(data) < (1 << 20):
        return content_hash(data)
    return await asyncio.to_thread(content_hash, data)


def _to_pil(pixels: torch.Tensor) -> Image.Image:
    return Image.fromarray(pixels.contiguous().cpu().numpy())
