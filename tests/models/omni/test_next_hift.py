"""LongCat-Next's vocoder (``Cosy24kVocoder``) against the published layout and equations.

Sources: the checkpoint's ``cosy24k_vocoder`` (``Cosy24kVocoder``: the ``HiFTGenerator`` and
``ConvRNNF0Predictor`` arguments, ``hift.pt`` loaded into ``hifigan_generator``) and CosyVoice's
``cosyvoice/hifigan/generator.py`` (``HiFTGenerator``, ``ResBlock``, ``SineGen``,
``SourceModuleHnNSF``), ``f0_predictor.py`` and ``transformer/activation.py`` (``Snake``). The
published ``hift.pt`` holds 328 tensors, weight-normed ones as ``weight_g``/``weight_v``
(from a public inventory of it). The reference below is a float64 transcription.
"""

from __future__ import annotations

import math

import pytest
import torch

from omniflow.models.omni.checkpoint import CheckpointError
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_hift import HIFT_PATH, HiFTGenerator, load_hift

F = torch.nn.functional


def _wn(p, shape):
    return {p + "weight_g": (shape[0], 1, 1), p + "weight_v": shape}


def _resblock_names(p, ch, k):
    n = {}
    for j in range(3):
        n |= _wn(f"{p}convs1.{j}.", (ch, ch, k)) | {f"{p}convs1.{j}.bias": (ch,)}
        n |= _wn(f"{p}convs2.{j}.", (ch, ch, k)) | {f"{p}convs2.{j}.bias": (ch,)}
        n |= {f"{p}activations1.{j}.alpha": (ch,), f"{p}activations2.{j}.alpha": (ch,)}
    return n


def published_hift_names(base=512, cond=512):
    """``HiFTGenerator(...)`` as ``Cosy24kVocoder`` builds it: names → shapes."""
    n = _wn("conv_pre.", (base, 80, 7)) | {"conv_pre.bias": (base,)}
    for i, k in enumerate([16, 11, 7]):  # ConvTranspose1d weights are [in, out, k]
        n |= _wn(f"ups.{i}.", (base >> i, base >> (i + 1), k)) | {
            f"ups.{i}.bias": (base >> (i + 1),)
        }
    for i, (u, k) in enumerate(zip([15, 3, 1], [7, 7, 11], strict=True)):
        ch = base >> (i + 1)
        n |= {f"source_downs.{i}.weight": (ch, 18, 1 if u == 1 else 2 * u)}
        n |= {f"source_downs.{i}.bias": (ch,)} | _resblock_names(f"source_resblocks.{i}.", ch, k)
    for i in range(3):
        for j, k in enumerate([3, 7, 11]):
            n |= _resblock_names(f"resblocks.{3 * i + j}.", base >> (i + 1), k)
    n |= _wn("conv_post.", (18, base >> 3, 7)) | {"conv_post.bias": (18,)}
    n |= {"m_source.l_linear.weight": (1, 9), "m_source.l_linear.bias": (1,)}
    for i in range(5):
        n |= _wn(f"f0_predictor.condnet.{2 * i}.", (cond, 80 if i == 0 else cond, 3))
        n |= {f"f0_predictor.condnet.{2 * i}.bias": (cond,)}
    return n | {"f0_predictor.classifier.weight": (1, cond), "f0_predictor.classifier.bias": (1,)}


def test_published_names_count_as_hift_pt():
    assert len(published_hift_names()) == 328
    got = {k: tuple(v.shape) for k, v in HiFTGenerator().state_dict().items()}
    assert got == published_hift_names()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("next-hift") / "next", seed=2)


def _state(folder):
    return torch.load(folder / HIFT_PATH, weights_only=True)


def test_builder_writes_hift_pt_in_the_published_names(folder):
    state = _state(folder)
    base, cond = (
        state["conv_pre.weight_v"].shape[0],
        state["f0_predictor.condnet.0.weight_v"].shape[0],
    )
    assert {k: tuple(v.shape) for k, v in state.items()} == published_hift_names(base, cond)


def _w(sd, p):
    v = sd[p + "weight_v"]
    return sd[p + "weight_g"] * v / torch.sqrt((v * v).sum(dim=(1, 2), keepdim=True))


def _snake(x, alpha):
    a = alpha[None, :, None]
    return x + 1.0 / (a + 1e-9) * torch.sin(x * a) ** 2


def _resblock(sd, p, x, k):
    for j, d in enumerate([1, 3, 5]):
        t = _snake(x, sd[f"{p}activations1.{j}.alpha"])
        t = F.conv1d(
            t,
            _w(sd, f"{p}convs1.{j}."),
            sd[f"{p}convs1.{j}.bias"],
            padding=(k * d - d) // 2,
            dilation=d,
        )
        t = _snake(t, sd[f"{p}activations2.{j}.alpha"])
        x = x + F.conv1d(
            t, _w(sd, f"{p}convs2.{j}."), sd[f"{p}convs2.{j}.bias"], padding=(k - 1) // 2
        )
    return x


def _reference(sd, mel, generator):
    """``Cosy24kVocoder.decode``: mel [1, 80, T] → waveform [1, 480 T]."""
    x = mel
    for i in range(5):
        p = f"f0_predictor.condnet.{2 * i}."
        x = F.elu(F.conv1d(x, _w(sd, p), sd[p + "bias"], padding=1))
    f0 = (
        x.transpose(1, 2) @ sd["f0_predictor.classifier.weight"].t()
        + sd["f0_predictor.classifier.bias"]
    ).abs()[..., 0]
    f0 = f0[:, :, None].expand(-1, -1, 480).reshape(1, -1)  # Upsample(scale 480), nearest
    fmat = torch.stack([f0[0] * (h + 1) / 24000 for h in range(9)])[None]  # [1, 9, N]
    theta = 2 * math.pi * (torch.cumsum(fmat, -1) % 1)
    phase = -math.pi + torch.rand(1, 9, 1, generator=generator).double() * 2 * math.pi
    phase[:, 0] = 0
    sines = 0.1 * torch.sin(theta + phase)
    uv = (f0[:, None] > 10).double()
    noise = (uv * 0.003 + (1 - uv) * 0.1 / 3) * torch.randn(
        sines.shape, generator=generator
    ).double()
    sines = sines * uv + noise
    s = torch.tanh(
        sines.transpose(1, 2) @ sd["m_source.l_linear.weight"].t() + sd["m_source.l_linear.bias"]
    )
    window = torch.tensor(
        [0.5 - 0.5 * math.cos(2 * math.pi * i / 16) for i in range(16)], dtype=torch.float64
    )
    spec = torch.stft(s[:, :, 0], 16, 4, 16, window=window, return_complex=True)
    s_stft = torch.cat([spec.real, spec.imag], 1)
    x = F.conv1d(mel, _w(sd, "conv_pre."), sd["conv_pre.bias"], padding=3)
    for i, (u, k) in enumerate([(8, 16), (5, 11), (3, 7)]):
        x = F.conv_transpose1d(
            F.leaky_relu(x, 0.1), _w(sd, f"ups.{i}."), sd[f"ups.{i}.bias"], u, (k - u) // 2
        )
        if i == 2:
            x = torch.cat([x[:, :, 1:2], x], -1)  # ReflectionPad1d((1, 0))
        d = [15, 3, 1][i]
        si = F.conv1d(
            s_stft,
            sd[f"source_downs.{i}.weight"],
            sd[f"source_downs.{i}.bias"],
            *((1, 0) if d == 1 else (d, d // 2)),
        )
        x = x + _resblock(sd, f"source_resblocks.{i}.", si, [7, 7, 11][i])
        x = (
            sum(_resblock(sd, f"resblocks.{3 * i + j}.", x, k) for j, k in enumerate([3, 7, 11]))
            / 3
        )
    x = F.conv1d(F.leaky_relu(x, 0.01), _w(sd, "conv_post."), sd["conv_post.bias"], padding=3)
    mag = torch.clip(torch.exp(x[:, :9]), max=1e2)
    ph = torch.sin(x[:, 9:])
    wave = torch.istft(
        torch.complex(mag * torch.cos(ph), mag * torch.sin(ph)), 16, 4, 16, window=window
    )
    return torch.clamp(wave, -0.99, 0.99)


@pytest.mark.parametrize("frames, voiced", [(4, False), (28, False), (9, True)])
def test_waveform_matches_the_published_forward(folder, tmp_path, frames, voiced):
    """Unvoiced (the tiny F0 is near 0 Hz: noise only) and voiced (F0 lifted to ~150 Hz by the
    classifier's bias: the harmonics, their random phases and the voiced noise level)."""
    if voiced:
        import shutil

        shutil.copytree(folder, tmp_path / "voiced")
        folder = tmp_path / "voiced"
        state = _state(folder)
        state["f0_predictor.classifier.bias"] = torch.tensor([150.0])
        torch.save(state, folder / HIFT_PATH)
    model = load_hift(folder, "audio_decoder")
    mel = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        got = model(mel, torch.Generator().manual_seed(5))
        assert (model.f0_predictor(mel) > 10).all() == voiced
    sd = {k: v.double() for k, v in _state(folder).items()}
    want = _reference(sd, mel.double(), torch.Generator().manual_seed(5))
    assert got.shape == want.shape == (1, 480 * frames)
    assert float((got.double() - want).abs().max()) <= 1e-4


@pytest.mark.parametrize("damage", ["renamed", "missing", "extra", "misshaped"])
def test_a_damaged_hift_pt_fails_naming_tensor_role_and_file(folder, tmp_path, damage):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    state = _state(bad)
    name = "resblocks.4.convs1.2.weight_v"
    if damage == "renamed":
        state["resblocks.4.convs1.2.weight_V"] = state.pop(name)
    elif damage == "missing":
        del state[name]
    elif damage == "extra":
        state["resblocks.9.activations1.0.alpha"] = torch.ones(4)
    else:
        state[name] = state[name][:, :, :-1].clone()
    torch.save(state, bad / HIFT_PATH)
    with pytest.raises(CheckpointError) as error:
        load_hift(bad, "audio_decoder")
    text = str(error.value)
    wanted = "resblocks.9.activations1.0.alpha" if damage == "extra" else name
    assert wanted in text and "role audio_decoder" in text and str(bad / HIFT_PATH) in text
