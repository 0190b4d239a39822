"""LongCat-Next's vocoder: ``Cosy24kVocoder`` = CosyVoice's HiFT generator, 24 kHz.

The checkpoint's ``cosy24k_vocoder`` builds ``HiFTGenerator(in_channels=80, base_channels=512,
nb_harmonics=8, sampling_rate=24000, nsf_alpha=0.1, nsf_sigma=0.003, nsf_voiced_threshold=10,
upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7], resblock_kernel_sizes=[3, 7, 11],
resblock_dilation_sizes=[[1, 3, 5]] * 3, source_resblock_kernel_sizes=[7, 7, 11],
source_resblock_dilation_sizes=[[1, 3, 5]] * 3, lrelu_slope=0.1, audio_limit=0.99,
f0_predictor=ConvRNNF0Predictor(1, 80, 512))`` with CosyVoice's default iSTFT (n_fft 16, hop 4)
and loads ``cosy24k_vocoder/hift.pt`` (a state dict: weight-normed convolutions as
``weight_g``/``weight_v``, Snake ``alpha``s). The generator (CosyVoice
``cosyvoice/hifigan/generator.py``, ``f0_predictor.py``):

* F0 from the mel: five weight-normed Conv1d(3) + ELU (``f0_predictor.condnet``), a linear
  ``classifier``, ``abs``;
* a harmonic source: F0 upsampled (nearest) by 480, 9 harmonics ``sin(2π cumsum(k f0 / sr))``
  (random phase for k > 1), amplitude 0.1 where voiced (F0 > 10 Hz), plus noise (0.003 voiced,
  0.1 / 3 unvoiced), merged by ``m_source.l_linear`` + tanh; its STFT (16, hop 4, Hann);
* the filter: ``conv_pre`` (7), per upsampling LeakyReLU(0.1), ``ups.i`` (ConvTranspose1d),
  a reflection pad on the last, + ``source_resblocks.i(source_downs.i(source STFT))``, the mean
  of three ``resblocks`` (Snake, dilated conv, Snake, conv; residual); LeakyReLU(0.01),
  ``conv_post`` (7) to 18 channels = exp-magnitude and sin-phase of 9 bins; iSTFT; clamp 0.99.

``base_channels`` and the predictor's ``cond_channels`` are read from the weights' shapes (the
tiny builder writes narrow ones); everything else is the published constants.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from omniflow.models.omni.checkpoint import CheckpointError, fill_strictly

F = nn.functional
HIFT_PATH = "cosy24k_vocoder/hift.pt"
RATE = 24000
UPS = [(8, 16), (5, 11), (3, 7)]  # (rate, kernel)
KERNELS = [3, 7, 11]
SOURCE_KERNELS = [7, 7, 11]
DILATIONS = [1, 3, 5]
HARMONICS = 8
N_FFT, HOP = 16, 4
HOP_SAMPLES = 8 * 5 * 3 * HOP  # 480


class WNConv(nn.Module):
    """A weight-normed (``weight_g`` · ``weight_v`` / ‖``weight_v``‖, norm per output row of
    the stored weight) Conv1d or ConvTranspose1d."""

    def __init__(
        self,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        dilation: int = 1,
        pad: int = 0,
        transpose: bool = False,
    ) -> None:
        super().__init__()
        shape = (cin, cout, k) if transpose else (cout, cin, k)
        self.weight_g = nn.Parameter(torch.ones(shape[0], 1, 1))
        self.weight_v = nn.Parameter(torch.randn(shape) * 0.01)
        self.bias = nn.Parameter(torch.zeros(cout))
        self.stride, self.dilation, self.pad, self.transpose = stride, dilation, pad, transpose
        # the weight, computed once for inference: a buffer (not saved), so .to() moves it
        self.folded: torch.Tensor | None
        self.register_buffer("folded", None, persistent=False)

    def weight(self) -> torch.Tensor:
        v = self.weight_v
        return self.weight_g * v / v.flatten(1).norm(dim=1).view(-1, 1, 1)

    def fold(self) -> None:
        """Compute the weight once (``load_hift`` does, after loading): a forward no longer
        pays for the norm, the division and the product (a quarter of a small vocoder's ops)."""
        with torch.no_grad():
            self.folded = self.weight().detach()

    def unfold(self) -> None:
        self.folded = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight() if self.folded is None else self.folded
        if self.transpose:
            return F.conv_transpose1d(x, w, self.bias, self.stride, self.pad)
        return F.conv1d(x, w, self.bias, self.stride, self.pad, self.dilation)


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        # alpha shaped and 1 / alpha, once for inference: buffers (not saved), .to() moves them
        self.folded_alpha: torch.Tensor | None
        self.folded_inverse: torch.Tensor | None
        self.register_buffer("folded_alpha", None, persistent=False)
        self.register_buffer("folded_inverse", None, persistent=False)

    def fold(self) -> None:
        """Shape alpha and take its inverse once (``load_hift`` does, after loading)."""
        with torch.no_grad():
            a = self.alpha.detach()[None, :, None]
            self.folded_alpha, self.folded_inverse = a.clone(), 1.0 / (a + 1e-9)

    def unfold(self) -> None:
        self.folded_alpha = self.folded_inverse = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, inverse = self.folded_alpha, self.folded_inverse
        if a is None or inverse is None:
            a = self.alpha[None, :, None]
            return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)
        return x + inverse * torch.sin(x * a).pow(2)


class ResBlock(nn.Module):
    def __init__(self, ch: int, k: int) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(WNConv(ch, ch, k, 1, d, (k * d - d) // 2) for d in DILATIONS)
        self.convs2 = nn.ModuleList(WNConv(ch, ch, k, 1, 1, (k - 1) // 2) for _ in DILATIONS)
        self.activations1 = nn.ModuleList(Snake(ch) for _ in DILATIONS)
        self.activations2 = nn.ModuleList(Snake(ch) for _ in DILATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = x + c2(a2(c1(a1(x))))
        return x


class F0Predictor(nn.Module):
    def __init__(self, mels: int, cond: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [WNConv(mels if i == 0 else cond, cond, 3, pad=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """F0 [B, T] (Hz) of mel [B, 80, T]."""
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class SourceModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l_linear = nn.Linear(HARMONICS + 1, 1)

    def forward(self, f0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Excitation [B, 1, N] of per-sample F0 [B, N]."""
        b, n = f0.shape
        k = torch.arange(1, HARMONICS + 2, dtype=f0.dtype, device=f0.device)
        theta = 2 * math.pi * (torch.cumsum(f0[:, None, :] * k[None, :, None] / RATE, -1) % 1)
        phase = (torch.rand(b, HARMONICS + 1, 1, generator=generator) * 2 - 1) * math.pi
        phase[:, 0] = 0
        sines = 0.1 * torch.sin(theta + phase.to(f0))
        uv = (f0[:, None, :] > 10).to(f0.dtype)
        noise_amp = uv * 0.003 + (1 - uv) * 0.1 / 3
        sines = sines * uv + noise_amp * torch.randn(sines.shape, generator=generator).to(f0)
        return torch.tanh(self.l_linear(sines.transpose(1, 2))).transpose(1, 2)


class HiFTGenerator(nn.Module):
    """``Cosy24kVocoder.hifigan_generator``: mel [B, 80, T] → waveform [B, 480 T]."""

    window: torch.Tensor

    def __init__(self, base: int = 512, cond: int = 512, mels: int = 80) -> None:
        super().__init__()
        self.m_source = SourceModule()
        self.conv_pre = WNConv(mels, base, 7, pad=3)
        self.ups = nn.ModuleList(
            WNConv(base >> i, base >> (i + 1), k, u, pad=(k - u) // 2, transpose=True)
            for i, (u, k) in enumerate(UPS)
        )
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip([15, 3, 1], SOURCE_KERNELS, strict=True)):
            ch = base >> (i + 1)
            down = (
                nn.Conv1d(N_FFT + 2, ch, 1)
                if u == 1
                else nn.Conv1d(N_FFT + 2, ch, 2 * u, u, u // 2)
            )
            self.source_downs.append(down)
            self.source_resblocks.append(ResBlock(ch, k))
        self.resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k) for i in range(len(UPS)) for k in KERNELS
        )
        self.conv_post = WNConv(base >> len(UPS), N_FFT + 2, 7, pad=3)
        self.f0_predictor = F0Predictor(mels, cond)
        self.register_buffer("window", torch.hann_window(N_FFT, periodic=True), persistent=False)

    def source_stft(self, mel: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        f0 = self.f0_predictor(mel)
        f0 = f0.repeat_interleave(HOP_SAMPLES, dim=-1)  # nearest upsampling by 480
        s = self.m_source(f0, generator)[:, 0]
        spec = torch.stft(s, N_FFT, HOP, N_FFT, window=self.window, return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def forward(self, mel: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        s = self.source_stft(mel, generator)
        x = self.conv_pre(mel)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, 0.1))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            blocks = self.resblocks[i * len(KERNELS) : (i + 1) * len(KERNELS)]
            x = sum(block(x) for block in blocks) / len(KERNELS)
        x = self.conv_post(F.leaky_relu(x))
        bins = N_FFT // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        wave = torch.istft(spec, N_FFT, HOP, N_FFT, window=self.window)
        return wave.clamp(-0.99, 0.99)


def tiny_hift_state(seed: int, base: int = 32, cond: int = 16) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HiFTGenerator(base, cond)
        for p in model.parameters():
            if p.dim() == 3 and p.shape[1:] == (1, 1):  # weight_g: unit rows at init
                continue
            p.data.normal_(0, 0.05 if p.dim() > 1 else 0.01)
        for m in model.modules():
            if isinstance(m, Snake):
                m.alpha.data.fill_(1.0)
    return dict(model.state_dict())


def load_hift(folder: str | Path, role: str, device: str = "cpu") -> HiFTGenerator:
    """``cosy24k_vocoder/hift.pt`` of ``folder`` (a state dict, read with ``weights_only``),
    strictly: a missing, unexpected or mis-shaped tensor names itself, the role and the file."""
    path = Path(folder) / HIFT_PATH
    if not path.is_file():
        raise CheckpointError(f"role {role}: {HIFT_PATH} missing from {folder}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"role {role}: {path} holds no state dict")
    for name in ("conv_pre.weight_v", "f0_predictor.condnet.0.weight_v"):
        if name not in state:
            raise CheckpointError(f"role {role}: tensor {name} missing from {path}")
    base = int(state["conv_pre.weight_v"].shape[0])
    cond = int(state["f0_predictor.condnet.0.weight_v"].shape[0])
    model = HiFTGenerator(base, cond)
    fill_strictly(model, set(state), lambda names: {n: state[n] for n in names}, "", role, path)
    model = model.to(device).eval()
    for module in model.modules():
        if isinstance(module, WNConv | Snake):
            module.fold()
    return model


def to_pcm16(wave: torch.Tensor) -> bytes:
    """Raw little-endian PCM16 mono frames of a float waveform in [-1, 1]."""
    ints = (wave.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return ints.numpy().astype("<i2").tobytes()
