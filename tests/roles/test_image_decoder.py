"""image_decoder role driven in-process: PNG contract, CFG and seed params, bad inputs."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from omniflow.roles.image_decoder import ImageDecoderRole
from omniflow.roles.vision_encoder import VisionEncoderRole
from omniflow.runtime.actor import BadRequest
from tests.roles.media import drive, image_bytes, make_ctx, make_request, run


def _codes(grid, size=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, size, (grid[0] * grid[1], 8), generator=generator)


def _decode_all(models_root, requests, **options):
    async def main():
        options.setdefault("model_path", str(models_root / "next"))
        options.setdefault("build_tiny", True)
        actor = ImageDecoderRole("image_decoder", 0, options)
        await actor.setup()
        try:
            outputs = []
            for request in requests:
                try:
                    (out,) = await drive(actor, request, make_ctx("image_decoder"))
                except BadRequest as e:
                    out = e
                outputs.append(out)
            return outputs
        finally:
            await actor.close()

    return run(main())


def _request(grid, codes=None, **params):
    codes = _codes(grid) if codes is None else codes
    return make_request({"image_grid": list(grid)}, {"image_codes": codes}, params)


def test_png_at_the_published_size(models_root):
    # A side of n tokens: the ViT decoder's 28 n px rounded up to the refiner's 16.
    (out,) = _decode_all(models_root, [_request((3, 4))])
    assert out["mime"] == "image/png"
    assert (out["width"], out["height"]) == (112, 96)
    image = Image.open(io.BytesIO(out["image"]))
    assert image.format == "PNG" and image.mode == "RGB" and image.size == (112, 96)


def test_cfg_scale_and_seed_params(models_root):
    grid = (2, 2)
    base, same, other_cfg, other_seed = _decode_all(
        models_root,
        [
            _request(grid),
            _request(grid),
            _request(grid, cfg_scale=4.0),
            _request(grid, seed=3),
        ],
        steps=2,
    )
    assert base["image"] == same["image"]
    assert base["image"] != other_cfg["image"]
    assert base["image"] != other_seed["image"]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_request((2, 2), codes=_codes((2, 3))), "image_codes"),
        (_request((2, 2), codes=_codes((2, 2)).float()), "image_codes"),
        (_request((1, 1), codes=torch.tensor([[0, 0, 0, 0, 0, 0, 0, 32]])), "image_codes"),
        (make_request({"image_grid": [2, 2]}), "image_codes"),
        (make_request({"image_grid": "2x2"}, {"image_codes": _codes((2, 2))}), "image_grid"),
        (_request((100, 100)), "image_grid"),
        (_request((1, 1), cfg_scale="high"), "cfg_scale"),
        (_request((1, 1), seed=1.5), "seed"),
    ],
    ids=["shape", "dtype", "range", "missing", "grid", "too-many-tokens", "cfg", "seed"],
)
def test_bad_inputs_name_the_field(models_root, request_, field):
    error, ok = _decode_all(models_root, [request_, _request((1, 1))])
    assert isinstance(error, BadRequest) and error.field == field
    assert ok["width"] == 32


def test_vision_codes_round_trip_to_an_image_of_the_same_size(models_root):
    async def main():
        encoder = VisionEncoderRole(
            "vision_encoder", 0, {"model_path": str(models_root / "vision"), "build_tiny": True}
        )
        decoder = ImageDecoderRole(
            "image_decoder",
            0,
            {
                "model_path": str(models_root / "next"),
                "build_tiny": True,
                "steps": 2,
            },
        )
        await encoder.setup()
        await decoder.setup()
        try:
            ctx = make_ctx("vision_encoder")
            (codes,) = await drive(encoder, make_request({"image": image_bytes(96, 64)}), ctx)
            request = make_request(
                {"image_grid": codes["image_grid"]}, {"image_codes": codes["image_codes"]}
            )
            (image,) = await drive(decoder, request, make_ctx("image_decoder"))
            return image
        finally:
            await encoder.close()
            await decoder.close()

    image = run(main())
    assert Image.open(io.BytesIO(image["image"])).size == (96, 64)
