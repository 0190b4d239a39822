"""audio_decoder role driven in-process: a stream of code chunks in, PCM16 chunks out."""

from __future__ import annotations

import io
import wave

import pytest
import torch

from omniflow.models.omni.next_builder import tiny_config
from omniflow.models.omni.next_hift import to_pcm16
from omniflow.roles.audio_decoder import AudioDecoderRole
from omniflow.runtime.actor import BadRequest
from tests.roles.media import drive, make_ctx, make_request, run

SIZES = tiny_config()["audio_config"]["vq_config"]["codebook_sizes"]  # published: 8192, ...
OVERLAP = 1200  # the default crossfade_ms, 50, at 24 kHz


def _codes(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, s, (n,), generator=generator) for s in SIZES], dim=1)


def _actor(models_root, **options):
    options.setdefault("model_path", str(models_root / "next"))
    options.setdefault("build_tiny", True)
    options.setdefault("conv", "native")  # one path: actors compared byte for byte agree
    return AudioDecoderRole("audio_decoder", 0, options)


def _stream(models_root, chunks, closing_marker=True, **options):
    """Feed ``chunks`` as one streamed request through one Context; outputs per chunk, then
    (with the closing marker) the closing chunk's: the cross-fade's held-back tail."""

    async def main():
        actor = _actor(models_root, **options)
        await actor.setup()
        try:
            ctx = make_ctx("audio_decoder", "stream-1")
            per_chunk = []
            for seq, codes in enumerate(chunks):
                last = seq == len(chunks) - 1 and not closing_marker
                request = make_request(
                    tensors={"audio_codes": codes}, request_id="stream-1", seq=seq, last=last
                )
                per_chunk.append(await drive(actor, request, ctx))
            if closing_marker:
                marker = make_request(request_id="stream-1", seq=len(chunks), last=True)
                per_chunk.append(await drive(actor, marker, ctx))
            return per_chunk
        finally:
            await actor.close()

    return run(main())


def test_each_chunk_yields_pcm_as_it_arrives(models_root):
    sizes = [3, 5, 2]
    per_chunk = _stream(models_root, [_codes(n, seed=n) for n in sizes])
    assert [len(outputs) for outputs in per_chunk] == [1, 1, 1, 1]  # then the closing tail
    outputs = [outputs[0] for outputs in per_chunk]
    assert [out["index"] for out in outputs] == [0, 1, 2, 3]
    assert all(out["sample_rate"] == 24000 for out in outputs)
    # each chunk holds back its last 50 ms (1200 samples) for the next one's cross-fade
    lengths = [3 * 1920 - OVERLAP, 5 * 1920, 2 * 1920, OVERLAP]
    assert [len(out["audio_chunk"]) for out in outputs] == [n * 2 for n in lengths]

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:  # the assembly the module docstring documents
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(24000)
        writer.writeframes(b"".join(out["audio_chunk"] for out in outputs))
    with wave.open(io.BytesIO(buffer.getvalue()), "rb") as reader:
        assert reader.getframerate() == 24000
        assert reader.getnframes() == sum(sizes) * 1920


def test_chunks_decode_the_same_as_a_fresh_request_of_that_chunk(models_root):
    first = _stream(models_root, [_codes(4)], closing_marker=False)
    again = _stream(models_root, [_codes(4)], closing_marker=False)
    assert first[0][0]["audio_chunk"] == again[0][0]["audio_chunk"]


def test_empty_chunk_yields_nothing(models_root):
    per_chunk = _stream(models_root, [_codes(2), torch.zeros(0, 8, dtype=torch.int64)])
    assert len(per_chunk[0]) == 1 and per_chunk[1] == []
    assert len(per_chunk[2][0]["audio_chunk"]) == OVERLAP * 2  # the closing: the tail


def test_a_segments_chunks_cross_fade_and_the_samples_add_up(models_root):
    """Chunk 1 is decoded after chunk 0's last token (its noise seeded by index 1); the
    overlap before its own first sample fades in over chunk 0's held-back 50 ms. Without
    the cross-fade each chunk decodes on its own, as before."""
    a, b = _codes(3, seed=4), _codes(2, seed=5)
    faded = _stream(models_root, [a, b])
    plain = _stream(models_root, [a, b], crossfade_ms=0)

    async def waves():
        actor = _actor(models_root)
        await actor.setup()
        try:
            runs = [(a, 0), (torch.cat([a[-1:], b]), 1), (a, 0), (b, 1)]
            return [actor._wave(c, torch.Generator().manual_seed(i)) for c, i in runs]
        finally:
            await actor.close()

    wa, wab, alone_a, alone_b = run(waves())
    fade = torch.linspace(0.0, 1.0, OVERLAP + 2)[1:-1]
    seam = wa[-OVERLAP:] * (1 - fade) + wab[1920 - OVERLAP : 1920] * fade
    want = to_pcm16(torch.cat([wa[:-OVERLAP], seam, wab[1920:]]))
    assert b"".join(o[0]["audio_chunk"] for o in faded) == want
    assert len(want) == 5 * 1920 * 2
    assert [o[0]["audio_chunk"] for o in plain[:2]] == [to_pcm16(alone_a), to_pcm16(alone_b)]
    assert plain[2] == []  # nothing held back


@pytest.mark.parametrize(
    "codes",
    [
        None,
        _codes(2).float(),
        torch.zeros(2, 7, dtype=torch.int64),
        torch.full((1, 8), 9000, dtype=torch.int64),
        _codes(600),
        torch.tensor([[SIZES[0], 0, 0, SIZES[3] + 1, 0, 0, 0, 0]]),
    ],
    ids=["missing", "dtype", "levels", "range", "too-long", "flag-row-range"],
)
def test_bad_chunks_name_the_field(models_root, codes):
    async def main():
        actor = _actor(models_root)
        await actor.setup()
        try:
            tensors = {} if codes is None else {"audio_codes": codes}
            with pytest.raises(BadRequest) as error:
                await drive(actor, make_request(tensors=tensors), make_ctx("audio_decoder"))
            assert error.value.field == "audio_codes"
            ok = make_request(tensors={"audio_codes": _codes(1)})
            return await drive(actor, ok, make_ctx("audio_decoder", "r2"))
        finally:
            await actor.close()

    (out,) = run(main())
    assert out["index"] == 0 and len(out["audio_chunk"]) == 1920 * 2


def test_end_of_audio_rows_split_the_chunk_and_are_dropped(models_root):
    """Level 0 = codebook_sizes[0] is the published end-of-audio flag: the runs on either side
    decode on their own (as lazy_decode_and_save splits at it) and the flag makes no sound."""
    flag = torch.tensor([[SIZES[0]] + [0] * 7])
    first, second = _codes(3, seed=1), _codes(2, seed=2)
    (split,), (alone,), flags_only, _ = _stream(
        models_root, [torch.cat([first, flag, second]), first, torch.cat([flag, flag])]
    )
    assert flags_only == []
    assert [split["index"], alone["index"]] == [0, 1]
    assert len(split["audio_chunk"]) == ((3 + 2) * 1920 - OVERLAP) * 2  # its tail held back
    assert len(alone["audio_chunk"]) == 3 * 1920 * 2
    # a stream's chunk 0 decodes `first` first under the same noise seed: the same samples
    again = _stream(models_root, [first], closing_marker=False)[0][0]["audio_chunk"]
    assert split["audio_chunk"][: 3 * 1920 * 2] == again


def test_a_chunk_longer_than_the_positions_is_refused_by_name(models_root):
    """With max_chunk_tokens above it, the decoder's own limit (positional_embedding rows /
    avg_pooler: 3000 / 4 tokens in the tiny config) still answers 400, not a model error."""

    async def main():
        actor = _actor(models_root, max_chunk_tokens=1000)
        await actor.setup()
        try:
            with pytest.raises(BadRequest) as error:
                request = make_request(tensors={"audio_codes": _codes(751)})
                await drive(actor, request, make_ctx("audio_decoder"))
            return error.value
        finally:
            await actor.close()

    error = run(main())
    assert error.field == "audio_codes" and "limit of 750" in str(error)
    assert "positional_embedding" in str(error)


def test_setup_times_both_convolution_paths_and_keeps_the_process_flag(models_root):
    before = torch.backends.mkldnn.enabled

    async def main():
        actor = _actor(models_root, conv="auto")
        await actor.setup()
        try:
            return actor.conv
        finally:
            await actor.close()

    conv = run(main())
    assert conv is not None and conv.name in ("mkldnn", "native")
    assert torch.backends.mkldnn.enabled == before  # set around each decode only
