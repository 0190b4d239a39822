"""RVQ, code embedder, vision and audio tokenizers: shapes, ranges, determinism."""

from __future__ import annotations

import pytest
import torch

from omniflow.models.omni import ResidualVQ, mel_filterbank


def test_rvq_encode_decode_shapes_and_residual_error():
    torch.manual_seed(0)
    rvq = ResidualVQ(16, [64, 32, 32, 16])
    x = torch.randn(50, 16) * 0.5
    ids = rvq.encode(x)
    assert ids.shape == (50, 4) and ids.dtype == torch.int64
    for level, size in enumerate(rvq.codebook_sizes):
        assert 0 <= int(ids[:, level].min()) and int(ids[:, level].max()) < size
    full_error = (rvq.decode(ids) - x).norm()
    first_error = (rvq.codebooks[0](ids[:, 0]) - x).norm()
    assert full_error <= first_error
    assert torch.equal(rvq.encode(x), ids)


def test_rvq_rejects_out_of_range_ids():
    rvq = ResidualVQ(8, [4, 4])
    with pytest.raises(ValueError, match="level 1"):
        rvq.decode(torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        rvq.decode(torch.tensor([[0, 1, 2]]))


def test_vision_native_resolution(models):
    vision = models["vision"]
    step = vision.config.pixels_per_token
    for height, width in [(step, step), (2 * step, 3 * step), (5 * step, step)]:
        image = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8)
        codes, grid = vision.encode(image)
        assert grid == (height // step, width // step)
        assert codes.shape == (grid[0] * grid[1], 8) and codes.dtype == torch.int64
        embeds = vision.embed(codes)
        assert embeds.shape == (codes.shape[0], vision.config.hidden_size)
        assert torch.equal(vision.encode(image).codes, codes)


def test_vision_rejects_sizes_off_the_grid(models):
    vision = models["vision"]
    with pytest.raises(ValueError, match="multiple"):
        vision.encode(torch.zeros(33, 64, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        vision.encode(torch.zeros(64, 64, 3))


def test_vision_codes_depend_on_content(models):
    vision = models["vision"]
    a = torch.zeros(64, 64, 3, dtype=torch.uint8)
    b = torch.full((64, 64, 3), 255, dtype=torch.uint8)
    assert not torch.equal(vision.encode(a).codes, vision.encode(b).codes)


def test_mel_filterbank_shape():
    filters = mel_filterbank(16000, 400, 80)
    assert filters.shape == (80, 201)
    assert (filters >= 0).all() and (filters.sum(dim=1) > 0).all()


@pytest.mark.parametrize("seconds", [0.05, 1.0, 2.5])
def test_audio_token_count(models, seconds):
    audio = models["audio"]
    samples = int(16000 * seconds)
    wave = torch.sin(torch.arange(samples) * 0.05) * 0.3
    codes = audio.encode(wave)
    assert codes.shape == (audio.tokens_for(samples), 8)
    assert audio.tokens_for(samples) == max(1, -(-samples // 1280))
    for level, size in enumerate(audio.config.codebook_sizes):
        assert int(codes[:, level].max()) < size
    assert audio.embed(codes).shape == (codes.shape[0], audio.config.hidden_size)
    assert torch.equal(audio.encode(wave), codes)


def test_audio_rejects_empty(models):
    with pytest.raises(ValueError, match="non-empty"):
        models["audio"].encode(torch.zeros(0))
