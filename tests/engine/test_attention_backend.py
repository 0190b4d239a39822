"""The runner's attention seam (engine/attention_backend.py): the backend is picked once per
runner, from the model and the kernels it got, and the step's metadata is built as it asks."""

import pytest
import torch

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.attention_backend import (
    CpuKernelAttention,
    TorchAttention,
    create_attention_backend,
)
from omniflow.engine.cpu_attention import CpuPagedAttention
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.paged_attention import DecodeSpec, PagedAttention, build_attention_batch
from omniflow.kernels import cpu_kernels


def test_float32_runs_on_the_torch_reference_and_builds_decode_masks(llama_path):
    engine = LLMEngine(llama_path, EngineConfig(dtype="float32", page_size=4, num_pages=64))
    backend = engine.runner.attention
    assert isinstance(backend, TorchAttention) and backend.name == "torch"
    assert backend.decode_masks and not backend.decodes_in_place
    assert engine.runner.fused_decode is None
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params)
    assert sum(len(d.token_ids) for d in engine.run_to_completion()) == 3


@pytest.mark.skipif(cpu_kernels() is None, reason="no CPU kernels here")
def test_bf16_on_cpu_kernels_reads_pages_in_place_and_off_they_fall_back(llama_path):
    on = LLMEngine(llama_path, EngineConfig(dtype="bfloat16", page_size=4, num_pages=64))
    off = LLMEngine(
        llama_path,
        EngineConfig(dtype="bfloat16", page_size=4, num_pages=64, cpu_kernels=False),
    )
    assert isinstance(on.runner.attention, CpuKernelAttention)
    config, backend = on.model.config, on.runner.attention
    in_place = backend.kernels.decode_attention_supported(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim
    )
    # decode rows read the pages in place where the kernel takes the heads, else masks
    assert backend.decodes_in_place == in_place == (not backend.decode_masks)
    assert on.runner.kernel_decode == in_place
    step = build_attention_batch(
        on.cache,
        [DecodeSpec([1], 2)],
        [],
        on.cache.keys.device,
        torch.bfloat16,
        decode_masks=backend.decode_masks,
    )
    assert isinstance(backend.bind(step), CpuPagedAttention)
    assert (on.runner.mirror.max_bytes == 0) == in_place
    assert isinstance(off.runner.attention, TorchAttention) and off.runner.kernels is None
    assert off.runner.fused_decode is None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for engine in (on, off):
        engine.add_request("r", [5, 6, 7, 8, 9], params)
        assert sum(len(d.token_ids) for d in engine.run_to_completion()) == 4


def test_a_backend_binds_the_step_metadata_it_asked_for(llama_path):
    engine = LLMEngine(llama_path, EngineConfig(dtype="float32", page_size=4, num_pages=64))
    cache, config = engine.cache, engine.model.config
    backend = create_attention_backend(cache, config, None)
    assert backend.scale == config.head_dim**-0.5
    batch = build_attention_batch(
        cache, [DecodeSpec([1, 2], 6)], [], cache.keys.device, cache.keys.dtype
    )
    bound = backend.bind(batch)
    assert type(bound) is PagedAttention and bound.batch is batch  # the reference, no kernels
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(1, heads, dim)
    k, v = torch.randn(1, kv_heads, dim), torch.randn(1, kv_heads, dim)
    assert bound(0, q, k, v).shape == q.shape
