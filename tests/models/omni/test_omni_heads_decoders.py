"""Depth head, audio decoder (chunked) and vocoder (our stand-ins)."""

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


def _audio_codes(decoder, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    columns = [
        torch.randint(0, size, (n,), generator=generator) for size in decoder.config.codebook_sizes
    ]
    return torch.stack(columns, dim=1)


def test_audio_decoder_chunk_lengths_add_up(models):
    decoder = models["audio_decoder"]
    per_token = decoder.config.samples_per_token
    assert per_token == 1920 and decoder.config.sample_rate == 24000
    codes = _audio_codes(decoder, 10)
    whole = decoder.decode_chunk(codes)
    assert whole.shape == (10 * per_token,)
    assert whole.abs().max() <= 1.0
    pieces, offset = [], 0
    for size in (3, 4, 3):
        pieces.append(decoder.decode_chunk(codes[offset : offset + size], offset))
        offset += size
    assert [p.numel() for p in pieces] == [3 * per_token, 4 * per_token, 3 * per_token]
    assert sum(p.numel() for p in pieces) == whole.numel()
    assert torch.equal(pieces[0], decoder.decode_chunk(codes[:3], 0))


def test_pcm16_is_little_endian_mono():
    pcm = to_pcm16(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    assert pcm == b"\x00\x00\xff\x7f\x01\x80\x00\x40"
