"""Which convolution path a model runs faster on this CPU, measured when it is loaded.

PyTorch runs a CPU convolution through oneDNN (mkldnn) where it can, else through its
own im2col + GEMM ("native"). oneDNN wins on long inputs and wide channels; on the short
inputs of a streamed chunk its per-call cost dominates: a one-token chunk of the tiny
LongCat audio decoder's mel took 10.5 ms through oneDNN and 6.8 ms natively on a 2-vCPU
AMD EPYC. Neither wins everywhere, so a role times its own forward both ways, in
interleaved rounds, and runs its forwards in ``conv_path`` of the faster. The flag is
process-wide in PyTorch; ``conv_path`` sets it for the call only and puts it back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ConvChoice:
    mkldnn: bool  # the path kept
    mkldnn_ms: float  # median forward time through oneDNN
    native_ms: float  # and through PyTorch's own convolutions

    @property
    def name(self) -> str:
        return "mkldnn" if self.mkldnn else "native"


@contextlib.contextmanager
def conv_path(mkldnn: bool) -> Iterator[None]:
    """Convolutions through oneDNN or not inside the ``with``; the flag as it was after."""
    before = torch.backends.mkldnn.enabled
    _use_mkldnn(mkldnn)
    try:
        yield
    finally:
        _use_mkldnn(bool(before))


def pick_conv_backend(forward: Callable[[], object], rounds: int = 5) -> ConvChoice:
    """Time ``forward`` with oneDNN on and off, ``rounds`` times each (A B A B ...), and
    say which had the lower median. Without oneDNN: native."""
    if not torch.backends.mkldnn.is_available():
        return ConvChoice(False, float("nan"), float("nan"))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for enabled in (True, False):
            with conv_path(enabled):
                forward()  # each path's first call after a switch pays for its setup
                start = time.perf_counter()
                forward()
                times[enabled].append((time.perf_counter() - start) * 1e3)
    on, off = (sorted(times[k])[rounds // 2] for k in (True, False))
    return ConvChoice(on <= off, on, off)


def _use_mkldnn(enabled: bool) -> None:
    torch.backends.mkldnn.set_flags(enabled, _fp32_precision=None)  # the rest left as it is
