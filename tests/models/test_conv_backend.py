"""The convolution path a role picks by timing: both paths compute the same model, the
pick names the faster of its own measurements, and PyTorch's process-wide flag is left as
it was."""

from __future__ import annotations

import math

import torch

from omniflow.models.conv_backend import conv_path, pick_conv_backend
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_hift import Snake, WNConv, load_hift


def test_conv_path_sets_the_flag_for_the_with_only():
    before = torch.backends.mkldnn.enabled
    for wanted in (True, False):
        with conv_path(wanted):
            assert torch.backends.mkldnn.enabled == wanted
        assert torch.backends.mkldnn.enabled == before


def test_the_pick_is_the_lower_median_and_leaves_the_flag():
    before = torch.backends.mkldnn.enabled
    conv = torch.nn.Conv1d(16, 16, 5, padding=2)
    x = torch.randn(1, 16, 40)
    seen: list[bool] = []

    def forward():
        seen.append(bool(torch.backends.mkldnn.enabled))
        with torch.no_grad():
            conv(x)

    choice = pick_conv_backend(forward, rounds=3)
    assert torch.backends.mkldnn.enabled == before
    if torch.backends.mkldnn.is_available():
        assert seen == [True, True, False, False] * 3  # A B A B, a warm call before each
        assert math.isfinite(choice.mkldnn_ms) and math.isfinite(choice.native_ms)
        assert choice.mkldnn == (choice.mkldnn_ms <= choice.native_ms)
        assert choice.name == ("mkldnn" if choice.mkldnn else "native")


def test_the_vocoder_is_the_same_on_both_paths_and_folded(tmp_path):
    """Either convolution path, and folded or not (bit for bit)."""
    folder = build_tiny_next(tmp_path / "next", seed=3)
    model = load_hift(folder, "audio_decoder")
    mel = torch.randn(1, 80, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        waves = {}
        for mkldnn in (True, False):
            with conv_path(mkldnn):
                waves[mkldnn] = model(mel, torch.Generator().manual_seed(2))
        folds = [m for m in model.modules() if isinstance(m, WNConv | Snake)]
        kept = [b for m in folds for b in m.buffers()]
        assert folds and len(kept) == len(folds) + sum(isinstance(m, Snake) for m in folds)
        assert not any(n.startswith("folded") for m in folds for n in m.state_dict())
        for module in folds:
            module.unfold()  # weight norm and 1 / alpha computed per forward again
        unfolded = model(mel, torch.Generator().manual_seed(2))
    assert torch.allclose(waves[True], waves[False], atol=1e-5)
    assert torch.equal(unfolded, waves[bool(torch.backends.mkldnn.enabled)])
    for module in folds:  # what fold keeps moves with the model (here: to float64)
        module.fold()
    assert all(b.dtype == torch.float64 for b in model.to(torch.float64).buffers())


def test_the_flow_keeps_one_generations_attention_biases_and_decodes_the_same(tmp_path):
    from omniflow.models.omni import next_flow_mel
    from omniflow.models.omni.next_audio_decoder import load_next_audio_decoder

    folder = build_tiny_next(tmp_path / "next", seed=3)
    model = load_next_audio_decoder(folder, "audio_decoder")
    codes = torch.zeros(2, len(model.codebook_sizes), dtype=torch.int64)
    built: list[int] = []
    plain = next_flow_mel.chunk_bias

    def counted(mask):
        built.append(mask.shape[-1])
        return plain(mask)

    with torch.no_grad():
        cached = model.mel(codes, torch.Generator().manual_seed(4))
        next_flow_mel.chunk_bias = counted
        try:
            again = model.mel(codes, torch.Generator().manual_seed(4))
        finally:
            next_flow_mel.chunk_bias = plain
    assert torch.equal(cached, again)
    assert len(built) == len(set(built))  # each mask length once for all the Euler steps
