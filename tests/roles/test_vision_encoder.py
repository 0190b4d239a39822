"""vision_encoder role driven in-process: contract, cache, resize policy and bad inputs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omniflow.models.omni.checkpoint import has_checkpoint
from omniflow.roles.vision_encoder import VisionEncoderRole, fit_to_grid
from omniflow.runtime.actor import BadRequest
from tests.roles.media import (
    drive,
    image_bytes,
    make_ctx,
    make_request,
    png_claiming_size,
    run,
)


def _actor(models_root, **options):
    options.setdefault("model_path", str(models_root / "vision"))
    options.setdefault("build_tiny", True)
    return VisionEncoderRole("vision_encoder", 0, options)


async def _encode(actor, image, **kwargs):
    ctx = make_ctx("vision_encoder")
    (out,) = await drive(actor, make_request({"image": image}, **kwargs), ctx)
    return out, ctx


def test_png_contract_and_cache_hit(models_root):
    async def main():
        actor = _actor(models_root)
        await actor.setup()
        try:
            png = image_bytes(100, 60)
            out, ctx = await _encode(actor, png)
            assert ctx.usage == {}
            again, ctx2 = await _encode(actor, png)
            assert ctx2.usage == {"encoder_cache_hits": 1}
            return out, again
        finally:
            await actor.close()

    out, again = run(main())
    h, w = out["image_grid"]
    assert (h, w) == (2, 4)  # 60x100 → 56x112 at 28 pixels per token (patch 14, merge 2)
    assert out["image_codes"].shape == (h * w, 8) and out["image_codes"].dtype == torch.int64
    assert out["image_embeds"].shape == (h * w, 64) and out["image_embeds"].dtype == torch.float32
    assert len(out["image_hash"]) == 32
    assert torch.equal(out["image_codes"], again["image_codes"])
    assert torch.equal(out["image_embeds"], again["image_embeds"])


def test_setup_builds_the_tiny_model_on_a_fresh_path(tmp_path):
    async def main():
        actor = VisionEncoderRole(
            "vision_encoder", 0, {"model_path": str(tmp_path / "v"), "build_tiny": True}
        )
        await actor.setup()
        await actor.close()

    run(main())
    assert has_checkpoint(tmp_path / "v")  # the published layout: config + index + shards


def test_jpeg_and_tensor_inputs(models_root):
    async def main():
        actor = _actor(models_root)
        await actor.setup()
        try:
            jpeg, _ = await _encode(actor, image_bytes(64, 64, fmt="JPEG"))
            ctx = make_ctx("vision_encoder")
            pixels = torch.randint(0, 256, (40, 70, 3), dtype=torch.uint8)
            (tensor,) = await drive(actor, make_request(tensors={"image": pixels}), ctx)
            return jpeg, tensor
        finally:
            await actor.close()

    jpeg, tensor = run(main())
    assert jpeg["image_grid"] == [2, 2]
    assert tensor["image_grid"] == [1, 2]  # 40x70 → 28x56


def test_max_pixels_caps_the_resize(models_root):
    async def main():
        actor = _actor(models_root, max_pixels=128 * 128)
        await actor.setup()
        try:
            out, _ = await _encode(actor, image_bytes(1000, 500))
            return out
        finally:
            await actor.close()

    h, w = run(main())["image_grid"]
    assert h * w * 28 * 28 <= 128 * 128
    assert w > h


def test_fit_to_grid():
    assert fit_to_grid(100, 60, 32, 10**6) == (96, 64)
    assert fit_to_grid(5, 5, 32, 10**6) == (32, 32)
    w, h = fit_to_grid(4000, 3000, 32, 448 * 448)
    assert w % 32 == 0 and h % 32 == 0 and w * h <= 448 * 448 and w > h


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (b"definitely not an image", "unreadable image"),
        (image_bytes(64, 64)[:200], "unreadable image"),
        (png_claiming_size(10_000, 10_000), "exceeds the limit of"),
        ("a string", "expected encoded image bytes"),
    ],
    ids=["garbage", "truncated", "100-megapixels-by-header", "wrong-type"],
)
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bad_images(models_root, image, message):
    async def main():
        actor = _actor(models_root)
        await actor.setup()
        try:
            with pytest.raises(BadRequest, match=message) as error:
                await _encode(actor, image)
            assert error.value.field == "image"
            out, _ = await _encode(actor, image_bytes(32, 32))  # still serving
            return out
        finally:
            await actor.close()

    assert run(main())["image_grid"] == [1, 1]


def test_hard_limit_is_an_option(models_root):
    async def main():
        actor = _actor(models_root, max_image_pixels=100 * 100)
        await actor.setup()
        try:
            with pytest.raises(BadRequest, match="max_image_pixels"):
                await _encode(actor, image_bytes(200, 100))
        finally:
            await actor.close()

    run(main())


def test_event_loop_stays_responsive_while_encoding(models_root):
    async def main():
        actor = _actor(models_root)
        await actor.setup()
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        try:
            await _encode(actor, image_bytes(448, 448, seed=9))
        finally:
            done.set()
            await task
            await actor.close()
        return ticks

    assert run(main()) > 1
