"""The image decoder's published VAE (``image_refiner.vae.*``) against diffusers' own classes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor
from safetensors.torch import load_file, save_file

from omniflow.models.omni.checkpoint import CheckpointError
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_image import VAE_PREFIX, latents_to_pixels, load_vae
from omniflow.roles.image_decoder import ImageDecoderRole
from tests.roles.media import run


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("next-image") / "next", seed=3)


def _decoder_config(folder):
    return json.loads((folder / "config.json").read_text())["visual_decoder_config"]


def _reference_vae(folder) -> AutoencoderKL:
    """Built as the published ``ImageRefinerContainer`` builds it: ``AutoencoderKL(**vae_config)``,
    its state dict the file's ``image_refiner.vae.*`` with the prefix removed."""
    config = _decoder_config(folder)
    vae = AutoencoderKL(**config["vae_config"])
    tensors = load_file(str(folder / config["weight_path"]))
    state = {k.removeprefix(VAE_PREFIX): v for k, v in tensors.items() if k.startswith(VAE_PREFIX)}
    vae.load_state_dict(state, strict=True)
    return vae.eval()


def test_builder_writes_the_published_vae_names(folder):
    config = _decoder_config(folder)
    assert config["weight_path"] == "image_decoder/image_decoder.safetensors"
    names = {n for n in load_file(str(folder / config["weight_path"])) if n.startswith(VAE_PREFIX)}
    want = {VAE_PREFIX + n for n in AutoencoderKL(**config["vae_config"]).state_dict()}
    assert names == want
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.startswith("image_refiner.") for n in index)  # outside the index, as published


def test_vae_decode_matches_diffusers(folder):
    ours = load_vae(folder, "image_decoder")
    reference = _reference_vae(folder)
    latents = torch.randn(1, 4, 6, 5, generator=torch.Generator().manual_seed(0))
    pixels = latents_to_pixels(ours, latents)
    with torch.no_grad():  # the refiner pipeline's last lines, then diffusers' postprocess
        z = latents / reference.config.scaling_factor + reference.config.shift_factor
        image = reference.decode(z, return_dict=False)[0]
    [expected] = VaeImageProcessor(vae_scale_factor=8).postprocess(image, output_type="pil")
    assert pixels.shape == (48, 40, 3)
    assert np.array_equal(pixels.numpy(), np.asarray(expected))
    assert int(pixels.max()) > int(pixels.min())  # not a constant image


@pytest.mark.parametrize("damage", ["renamed", "missing", "extra", "misshaped"])
def test_vae_loading_is_strict(folder, tmp_path, damage):
    copy = tmp_path / "next"
    shutil.copytree(folder, copy)
    path = copy / _decoder_config(folder)["weight_path"]
    tensors = load_file(str(path))
    name = VAE_PREFIX + "decoder.conv_in.weight"
    if damage == "renamed":
        tensors[VAE_PREFIX + "decoder.conv_inn.weight"] = tensors.pop(name)
        named = VAE_PREFIX + "decoder.conv_in.weight"
    elif damage == "missing":
        del tensors[name]
        named = name
    elif damage == "extra":
        tensors[VAE_PREFIX + "decoder.conv_extra.weight"] = torch.zeros(1)
        named = VAE_PREFIX + "decoder.conv_extra.weight"
    else:
        tensors[name] = torch.zeros(2, 2)
        named = name
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as error:
        load_vae(copy, "image_decoder")
    assert named in str(error.value) and "role image_decoder" in str(error.value)
    assert str(copy) in str(error.value)


def test_role_setup_fails_naming_the_vae_tensor(folder, tmp_path):
    copy = tmp_path / "next"
    shutil.copytree(folder, copy)
    path = copy / _decoder_config(folder)["weight_path"]
    tensors = load_file(str(path))
    del tensors[VAE_PREFIX + "decoder.conv_out.bias"]
    save_file(tensors, str(path))
    role = ImageDecoderRole("image_decoder", 0, {"model_path": str(copy), "build_tiny": True})

    async def main():
        try:
            await role.setup()
        finally:
            await role.close()

    with pytest.raises(CheckpointError, match="image_refiner.vae.decoder.conv_out.bias"):
        run(main())
