"""CPU weight layouts change only the memory layout: same names, shapes, values and logits.
Input-major float32 weights still take checkpoints; bf16 weights packed for oneDNN are used
by the engine and refuse loading afterwards."""

import copy
import os

import pytest
import torch

from omniflow.engine import LLMEngine, SamplingParams, model_runner
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.model_runner import CPU_BF16_ROW_BLOCK, CPU_KERNELS_ROW_BLOCK
from omniflow.kernels import cpu_kernels
from omniflow.models import build_tiny_model, load_decoder
from omniflow.models.layers import cpu_layouts
from omniflow.models.layers.cpu_layouts import KernelLinear, PackedLinear, packed_weights_supported
from omniflow.models.llama.decoder import causal_attention
from omniflow.models.loader import iter_checkpoint_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def logits(model, token_ids):
    with torch.inference_mode():
        return model(torch.tensor(token_ids), torch.arange(len(token_ids)), causal_attention)


def test_input_major_weights_keep_values_and_reload(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen2-tied-odd-heads", seed=3)
    model = load_decoder(path, device="cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = logits(model, [5, 9, 2, 7, 11])
    model.use_input_major_weights()
    projections = [
        p
        for name, p in model.named_parameters()
        if name.endswith(("proj.weight", "embed_tokens.weight"))
    ]
    assert projections and all(p.t().is_contiguous() for p in projections)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    # A different GEMM kernel may round differently: equal up to float32 noise.
    torch.testing.assert_close(logits(model, [5, 9, 2, 7, 11]), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    model.load_weights(iter_checkpoint_tensors(path))  # shard views of strided parameters
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name


needs_bf16_onednn = pytest.mark.skipif(
    not packed_weights_supported(torch.device("cpu"), torch.bfloat16),
    reason="this CPU's oneDNN has no bf16",
)


KERNELS = cpu_kernels()
# The kernels where they run the projections here (AMX, else AVX-512 BF16).
OURS = KERNELS if KERNELS is not None and KERNELS.packed_linear else None


@needs_bf16_onednn
@pytest.mark.parametrize("layout", ["onednn", "kernels"])
@pytest.mark.parametrize("preset", ["qwen2-tied-odd-heads", "llama-gqa", "llama-mha"])
def test_packed_weights_give_the_plain_logits(tmp_path, preset, layout):
    if layout == "kernels" and OURS is None:
        pytest.skip("neither AMX nor AVX-512 BF16 here (or no CPU kernels)")
    path = build_tiny_model(tmp_path / "m", preset, seed=5)
    model = load_decoder(path, device="cpu", dtype="bfloat16")
    plain = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens = [5, 9, 2, 7, 11, 3, 8]
    expected = logits(model, tokens)
    model.use_packed_weights(kernels=OURS if layout == "kernels" else None)
    assert model.packed
    packed = dict(model.named_parameters())
    assert packed.keys() == plain.keys()
    modules = {name + ".weight": m for name, m in model.named_modules()}
    kind = KernelLinear if layout == "kernels" else PackedLinear
    projections = [n for n in packed if n.endswith("proj.weight")]
    assert projections and all(isinstance(modules[n], kind) for n in projections)
    for name, parameter in packed.items():
        module = modules.get(name)
        if isinstance(module, KernelLinear):
            dense = module.dense_weight()
        else:
            dense = parameter.to_dense() if parameter.layout == torch._mkldnn else parameter
        assert torch.equal(dense, plain[name]), name
    assert (model.lm_head is None) == (model._packed_output is not None)
    # bf16 GEMMs in another layout may round differently: equal up to bf16 noise.
    torch.testing.assert_close(logits(model, tokens), expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="after use_packed_weights"):
        model.load_weights(iter_checkpoint_tensors(path))


@needs_bf16_onednn
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_bf16_engine_runs_on_packed_weights(tmp_path, cpu_kernels):
    path = build_tiny_model(tmp_path / "m", "llama-gqa", seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[4, 8, 15, 16, 23, 42], [7, 7, 3]]
    runs = []
    for _ in range(2):
        config = EngineConfig(device="cpu", dtype="bfloat16", cpu_kernels=cpu_kernels)
        engine = LLMEngine(path, config)
        # The kernels' layout where the engine runs them and they run projections here.
        kind = KernelLinear if cpu_kernels and OURS is not None else PackedLinear
        layer = engine.model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, kind)
        assert isinstance(layer.mlp.gate_up_proj, kind) and isinstance(layer.mlp.down_proj, kind)
        if not cpu_kernels:
            assert engine.runner.kernels is None and not engine.runner.kernel_decode
        block = CPU_BF16_ROW_BLOCK if engine.runner.kernels is None else CPU_KERNELS_ROW_BLOCK
        assert engine.model.model.layers[0].mlp.row_block == block
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, params)
        produced = {f"r{index}": [] for index in range(len(prompts))}
        for delta in engine.run_to_completion():
            produced[delta.request_id] += delta.token_ids
        runs.append(produced)
    assert all(len(tokens) == 12 for tokens in runs[0].values())
    assert runs[0] == runs[1]


@needs_bf16_onednn
def test_kernels_without_their_projections_keep_onednn_projections(tmp_path, monkeypatch):
    """A CPU with the kernels but neither AMX nor AVX-512 BF16 projections (a kernel that
    refuses the tile state, OMNIFLOW_CPU_AVX512_LINEAR=0): oneDNN's projections, the kernels
    for the rest, no one-call decode step."""
    if KERNELS is None:
        pytest.skip("no CPU kernels here")
    without_amx = copy.copy(KERNELS)
    without_amx.amx = without_amx.avx512_linear = without_amx.packed_linear = False
    monkeypatch.setattr(model_runner, "cpu_kernels", lambda: without_amx)
    path = build_tiny_model(tmp_path / "m", "llama-gqa", seed=9)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16"))
    assert engine.runner.kernels is without_amx and not engine.runner.fused_decode
    assert isinstance(engine.model.model.layers[0].mlp.gate_up_proj, PackedLinear)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for index, prompt in enumerate([[4, 8, 15, 16, 23, 42], [7, 7, 3]]):
        engine.add_request(f"r{index}", prompt, params)
    produced = {"r0": [], "r1": []}
    for delta in engine.run_to_completion():
        produced[delta.request_id] += delta.token_ids
    assert [len(tokens) for tokens in produced.values()] == [8, 8]


def test_a_torch_without_onednns_private_ops_runs_the_plain_layouts(tmp_path, monkeypatch):
    """The packed layouts call oneDNN's private ops (cpu_layouts.PRIVATE_ONEDNN_OPS). Where
    this torch lacks one (renamed, dropped), bf16 runs the plain weights on PyTorch's public
    ops: no PackedLinear, no KernelLinear, no one-call decode; the engine still serves."""
    monkeypatch.setattr(
        cpu_layouts, "PRIVATE_ONEDNN_OPS", (*cpu_layouts.PRIVATE_ONEDNN_OPS, "_gone_in_this_torch")
    )
    assert not packed_weights_supported(torch.device("cpu"), torch.bfloat16)
    path = build_tiny_model(tmp_path / "m", "llama-gqa", seed=6)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16"))
    assert not engine.model.packed and engine.runner.fused_decode is None
    layer = engine.model.model.layers[0]
    assert type(layer.mlp.gate_up_proj) is torch.nn.Linear
    prompt = [4, 8, 15, 16, 23, 42]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", prompt, params)
    assert len([t for d in engine.run_to_completion() for t in d.token_ids]) == 6


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_mlp_row_blocks_give_the_whole_batch_logits(tmp_path, dtype, tolerance):
    path = build_tiny_model(tmp_path / "m", "llama-gqa", seed=8)
    model = load_decoder(path, device="cpu", dtype=dtype)
    tokens = list(range(3, 14))  # 11 rows: blocks of 4, 4 and 3
    expected = logits(model, tokens)
    model.set_row_block(4)
    assert all(layer.mlp.row_block == 4 for layer in model.model.layers)
    torch.testing.assert_close(logits(model, tokens), expected, rtol=tolerance, atol=tolerance)
    model.set_row_block(None)
    assert torch.equal(logits(model, tokens), expected)
