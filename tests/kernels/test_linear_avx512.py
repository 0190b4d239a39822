"""The projections on AVX-512 BF16 (kernels/linear_avx512.c), for CPUs without AMX: against
float32 torch, and the one-call decode step on them against the kernels called one by one.
Gated on the CPU feature (cpuid), not on AMX: on an AMX CPU they run with the AMX paths off."""

import pytest
import torch
import torch.nn.functional as F

from omniflow.engine import SamplingParams
from omniflow.kernels import cpu, cpu_kernels

from .test_cpu_kernels import (
    BF16,
    KERNEL_SPEC,
    bf16_randn,
    counted,
    ragged_prompts,
    small_pages_engine,
    staggered_run,
)

loaded = cpu_kernels()


@pytest.fixture
def kernels(monkeypatch):
    """The kernels as a CPU with AVX-512 BF16 and no AMX sees them."""
    if loaded is None or not loaded._lib.omniflow_avx512_linear_supported():
        pytest.skip("no AVX-512 BF16 here (or no CPU kernels)")
    monkeypatch.setenv(cpu.AMX_SWITCH, "0")
    without = cpu.CpuKernels(loaded._lib)
    assert without.avx512_linear and without.packed_linear and not without.amx
    return without


def test_the_avx512_switch_turns_the_path_off(kernels, monkeypatch):
    monkeypatch.setenv(cpu.AVX512_LINEAR_SWITCH, "0")
    off = cpu.CpuKernels(kernels._lib)
    assert not off.avx512_linear and not off.packed_linear


@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [
        (32, 512, 1024),
        (1, 64, 32),
        (5, 96, 100),
        (9, 33, 47),  # an odd input count: the last pair half past K
        (37, 1408, 512),
        (65, 95, 17),  # chunks of 64 rows, a ragged last chunk
        (300, 64, 48),
        (19, 40, 33),
        (16, 1, 3),
    ],
)
def test_linear_on_avx512_equals_a_float32_projection(kernels, rows, in_features, out_features):
    x = bf16_randn(rows, in_features, seed=40)
    weight = bf16_randn(out_features, in_features, seed=41, scale=0.05)
    bias = bf16_randn(out_features, seed=42)
    packed = kernels.pack_linear(weight)
    expected = F.linear(x.float(), weight.float(), bias.float())
    for with_bias in (True, False):
        out = kernels.linear(x, packed, out_features, bias if with_bias else None)
        reference = expected if with_bias else expected - bias.float()
        assert out.shape == (rows, out_features) and out.dtype == BF16
        # Accumulated in float32 and rounded once: within half a bf16 step of the float32 sum.
        assert ((out.float() - reference).abs() <= reference.abs() * 2**-8 + 1e-6).all()


def test_linear_on_avx512_reads_strided_rows_and_nothing_past_k(kernels):
    """x a column slice of a wider buffer whose next columns hold NaN: none of them is read."""
    wide = torch.full((11, 64), float("nan"), dtype=BF16)
    wide[:, :45] = bf16_randn(11, 45, seed=43)
    x = wide[:, :45]
    weight = bf16_randn(70, 45, seed=44, scale=0.1)
    out = kernels.linear(x, kernels.pack_linear(weight), 70)
    expected = F.linear(x.float(), weight.float())
    assert ((out.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("rows,inter", [(32, 1408), (7, 23), (70, 16)])
def test_fused_gate_up_on_avx512_equals_the_unfused_ops(kernels, rows, inter):
    x = bf16_randn(rows, 97, seed=45)
    weight = bf16_randn(2 * inter, 97, seed=46, scale=0.1)
    bias = bf16_randn(2 * inter, seed=47)
    packed = kernels.pack_linear(weight, gate_up=inter)
    gate_up = kernels.linear(x, packed, 2 * inter, bias, gate_up=inter)
    plain = kernels.linear(x, kernels.pack_linear(weight), 2 * inter, bias)
    assert torch.equal(gate_up, plain)  # the same sums in the same order, halves in place
    fused = kernels.linear(x, packed, 2 * inter, bias, gate_up=inter, silu=True)
    assert torch.equal(fused, kernels.silu_mul(gate_up))  # rounded where the two ops round
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(fused, F.silu(gate) * up, rtol=2**-7, atol=0)


def test_fused_decode_steps_on_avx512_equal_the_kernels_layer_by_layer(
    kernels, tmp_path, monkeypatch
):
    """The one-call decode step with its projections on AVX-512 BF16: the same tokens and
    log-probabilities, bit for bit, as the same kernels called layer by layer."""
    from omniflow.models import build_tiny_model

    monkeypatch.setattr(cpu, "_loaded", kernels)  # the engine's kernels: these
    path = build_tiny_model(tmp_path / "m", KERNEL_SPEC, seed=48)
    prompts = ragged_prompts(seed=49)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for fused in (True, False):
        engine = small_pages_engine(path, None)
        assert engine.runner.fused_decode is not None and engine.model.cpu_kernels is kernels
        calls = counted(engine.runner.fused_decode, "run")
        if not fused:
            engine.runner.fused_decode = None
        produced, _ = staggered_run(engine, prompts, params, logprobs=True)
        assert (len(calls) > 5) == fused
        runs.append(produced)
    assert runs[0] == runs[1]
    assert all(pairs for pairs in runs[0].values())
