"""A condition image's ViT span is the processor's max_num_patches rows, the patches past
its grid padding, as the release feeds them (last_hidden_state whole, into <img> tokens):
the padded rows equal transformers' Siglip2VisionModel with its pixel_attention_mask."""

import json

import pytest
import torch

from omniflow.models.hunyuan_image3.parts import load_image_parts
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3


@pytest.mark.parametrize("shape", [(3, 5), (2, 7), (4, 4)])
def test_padded_vit_rows_match_transformers(tmp_path, shape):
    transformers = pytest.importorskip("transformers")
    folder = build_tiny_hunyuan_image3(tmp_path / "tiny", seed=3)
    raw = json.loads((folder / "config.json").read_text())
    parts = load_image_parts(folder)
    theirs = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**raw["vit"]))
    state = {
        k.removeprefix("vision_model."): v
        for k, v in parts.state_dict().items()
        if k.startswith("vision_model.")
    }
    getattr(theirs, "vision_model", theirs).load_state_dict(state, strict=True)
    theirs.eval()
    h, w = shape
    budget = raw["vit_processor"]["max_num_patches"]
    pixels = torch.rand(1, 3, h * 8, w * 8, generator=torch.Generator().manual_seed(h)) * 2 - 1
    patches, _ = parts.vision_model.patchify(pixels)
    padded = torch.zeros(1, budget, patches.shape[-1])
    padded[:, : h * w] = patches
    mask = torch.zeros(1, budget, dtype=torch.long)
    mask[:, : h * w] = 1
    with torch.inference_mode():
        expected = theirs(
            pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=torch.tensor([shape])
        ).last_hidden_state
        got = parts.vision_model.forward_patches(patches, shape, budget)
        assert parts.vision_model(pixels).shape == (1, budget, raw["vit"]["hidden_size"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
