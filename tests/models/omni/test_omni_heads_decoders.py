"""Depth head (our stand-in) and the PCM16 packing of the audio decoder role."""

from __future__ import annotations

import torch

from omniflow.models.omni import to_pcm16


def test_depth_head_greedy_matches_teacher_forced_argmax(models):
    head = models["depth_head"]
    hidden = torch.randn(6, head.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = head.generate(hidden)
    assert ids.shape == (6, 8) and ids.dtype == torch.int64
    with torch.no_grad():
        logits = head.logits(hidden, ids)
    for level, level_logits in enumerate(logits):
        assert level_logits.shape == (6, head.config.codebook_sizes[level])
        assert torch.equal(level_logits.argmax(dim=-1), ids[:, level])


def test_depth_head_batched_equals_one_by_one(models):
    head = models["depth_head"]
    hidden = torch.randn(4, head.config.hidden_size, generator=torch.Generator().manual_seed(2))
    batched = head.generate(hidden)
    single = torch.cat([head.generate(hidden[i : i + 1]) for i in range(4)])
    assert torch.equal(batched, single)


def test_depth_head_sampling_is_seeded(models):
    head = models["depth_head"]
    hidden = torch.randn(3, head.config.hidden_size)

    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return head.generate(hidden, temperature=1.0, top_k=50, generator=generator)

    first = sample(7)
    assert torch.equal(first, sample(7))
    for level, size in enumerate(head.config.codebook_sizes):
        assert int(first[:, level].max()) < size


def test_pcm16_is_little_endian_mono():
    pcm = to_pcm16(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    assert pcm == b"\x00\x00\xff\x7f\x01\x80\x00\x40"
