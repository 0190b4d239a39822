"""RVQ and the mel filterbank of the stand-in parts: shapes, ranges."""

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


def test_mel_filterbank_shape():
    filters = mel_filterbank(16000, 400, 80)
    assert filters.shape == (80, 201)
    assert (filters >= 0).all() and (filters.sum(dim=1) > 0).all()
