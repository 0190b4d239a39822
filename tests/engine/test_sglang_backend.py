"""The SGLang backend (engine/sglang_backend.py): SGLang's model forward over omniflow's
pages, with omniflow's scheduler, prefix cache and sampler, gives the greedy tokens of
transformers and of the torch backend, writes K/V only into the pages omniflow allocated,
and refuses at config load what it cannot serve.

Needs sglang==0.5.23 (the extra ``sglang``; CI installs its CPU variant). On a CPU,
torchvision and sgl_kernel are stood in for by tests/engine/sglang_stubs (see there)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, random_prompts

from omniflow.engine import EmbeddingSpan, LLMEngine, SamplingParams
from omniflow.engine.heads import Guidance
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.sglang_backend import sglang_missing

STUBS = Path(__file__).parent / "sglang_stubs"
REAL_KERNELS = sglang_missing() is None  # a GPU install: nothing stood in for

if not REAL_KERNELS and str(STUBS) not in sys.path:
    sys.path.insert(0, str(STUBS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(STUBS), os.environ.get("PYTHONPATH")])
    )

MISSING = sglang_missing()
if MISSING is not None:
    if os.environ.get("CI"):
        raise RuntimeError(f"CI runs the SGLang tests: this environment lacks {MISSING}")
    pytest.skip(f"SGLang backend tests need {MISSING}", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MIXED_LENGTHS = (3, 17, 9, 40, 1, 25)


def engine_for(path, **options):
    return LLMEngine(path, EngineConfig(device="cpu", **options))


def generate(engine, prompts, params=GREEDY, prefix="r"):
    """Greedy tokens per prompt, and every request's cached-token count."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{index}", prompt, params)
    produced = {f"{prefix}{i}": [] for i in range(len(prompts))}
    cached = {}
    for delta in engine.run_to_completion():
        produced[delta.request_id] += delta.token_ids
        cached.setdefault(delta.request_id, delta.num_cached_tokens)
    names = [f"{prefix}{i}" for i in range(len(prompts))]
    return [produced[n] for n in names], [cached[n] for n in names]


@pytest.mark.parametrize("preset", ["llama-gqa", "qwen2-tied-odd-heads"])
def test_batched_greedy_equals_transformers_and_torch_backend(tiny_models, preset):
    path = tiny_models[preset]
    prompts = random_prompts(MIXED_LENGTHS, seed=7)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    torch_tokens, _ = generate(engine_for(path, page_size=8), prompts)
    # A 16-token budget chunks the long prompts: chunks share steps with decodes.
    sglang = engine_for(path, page_size=8, max_num_batched_tokens=16, backend="sglang")
    got, _ = generate(sglang, prompts)
    assert got == expected
    assert torch_tokens == expected


def test_cached_prefix_extends_from_shared_pages(tiny_models):
    path = tiny_models["llama-gqa"]
    [shared] = random_prompts((48,), seed=11)
    prompts = [shared + suffix for suffix in random_prompts((5, 9, 3), seed=12)]
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    engine = engine_for(path, page_size=8, backend="sglang")
    generate(engine, [shared], SamplingParams(temperature=0.0, max_tokens=1), prefix="warm")
    got, cached = generate(engine, prompts)
    assert cached == [48, 48, 48]  # EXTEND with extend_prefix_lens 48 over cached pages
    assert got == expected


def test_preemption_under_small_page_budget(tiny_models):
    path = tiny_models["qwen2-tied-odd-heads"]
    prompts = random_prompts((30, 12, 25, 7, 18, 22), seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = hf_greedy(path, prompts, params.max_tokens)
    engine = engine_for(path, page_size=4, num_pages=14, backend="sglang")
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    sequences = dict(engine.sequences)
    produced = {f"r{i}": [] for i in range(len(prompts))}
    for delta in engine.run_to_completion():
        produced[delta.request_id] += delta.token_ids
    assert [produced[f"r{i}"] for i in range(len(prompts))] == expected
    assert sum(s.num_preemptions for s in sequences.values()) > 0
    assert engine.allocator.usage().free_pages == 14


def test_kv_lands_only_in_allocated_pages_as_the_torch_backend_writes_it(tiny_models):
    path = tiny_models["llama-mha"]
    prompts = random_prompts((13, 6, 21), seed=3)
    engines = [engine_for(path, page_size=4, num_pages=40, backend=b) for b in ("torch", "sglang")]
    allocated: set[int] = set()
    allocate = engines[1].allocator.allocate

    def allocate_and_record(num_pages):  # the real allocator, its answers noted
        pages = allocate(num_pages)
        allocated.update(pages)
        return pages

    engines[1].allocator.allocate = allocate_and_record
    for engine in engines:
        generate(engine, prompts)
    torch_cache, sglang_cache = (e.cache for e in engines)
    written = {
        page
        for page in range(sglang_cache.num_pages)
        if sglang_cache.keys[:, :, page].any() or sglang_cache.values[:, :, page].any()
    }
    assert written and written <= allocated
    # Same scheduler, same allocation order: the same K/V in the same slots.
    torch.testing.assert_close(sglang_cache.keys, torch_cache.keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sglang_cache.values, torch_cache.values, rtol=1e-4, atol=1e-5)


def test_embedding_spans_enter_as_input_embeds_like_the_torch_backend(tiny_models):
    path = tiny_models["qwen2-tied-odd-heads"]
    [prompt] = random_prompts((14,), seed=41)
    placeholder = prompt[:2] + [0] * 6 + prompt[8:]
    media = torch.randn(6, 60, generator=torch.Generator().manual_seed(5)) * 3
    outputs = {}
    for backend in ("torch", "sglang"):
        engine = engine_for(path, page_size=4, backend=backend)
        runs = []
        for tag in ("first", "again"):  # again: the span's pages come from the prefix cache
            engine.add_request(tag, placeholder, GREEDY, [EmbeddingSpan(2, media, "hash-media")])
            deltas = engine.run_to_completion()
            runs.append(([t for d in deltas for t in d.token_ids], deltas[0].num_cached_tokens))
        outputs[backend] = runs
    assert outputs["sglang"] == outputs["torch"]
    assert outputs["sglang"][1][1] == 12  # three full pages, the span's among them
    plain, _ = generate(engine_for(path, page_size=4, backend="sglang"), [placeholder])
    assert plain[0] != outputs["sglang"][0][0]  # the span's rows did replace the embeddings


def test_latent_attention_checkpoints_are_refused_at_load(tmp_path):
    from omniflow.models import build_tiny_model

    path = build_tiny_model(tmp_path / "deepseek", "deepseek-v2-tiny", seed=0)
    with pytest.raises(ValueError, match="backend 'sglang' serves Llama/Qwen2.*DeepseekV2"):
        engine_for(path, backend="sglang")


def test_requests_it_cannot_serve_are_refused_by_name(tiny_models):
    engine = engine_for(tiny_models["llama-mha"], page_size=8, backend="sglang")
    with pytest.raises(ValueError, match="request g1: field guidance"):
        engine.add_request("g1", [5, 6, 7], GREEDY, guidance=Guidance([5], 2.0))
    with pytest.raises(ValueError, match="request c1: field block_steps"):
        engine.keep_context("c1", [5, 6, 7])
    got, _ = generate(engine, [[5, 6, 7]])  # and it keeps serving text
    assert got == hf_greedy(tiny_models["llama-mha"], [[5, 6, 7]], GREEDY.max_tokens)


DEPLOYMENT = """
name = "sglang_text"
registry = "embedded"

[roles.llm]
actor = "omniflow.roles.llm:LLMRole"

[roles.llm.options]
model_path = "models/llama-tiny"
build_tiny = true
backend = "sglang"
max_tokens = 16

[graph]
edges = [{ from = "input", to = "llm" }]

[runtime]
start_timeout_s = 170
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_deployment_with_backend_sglang_serves_omniflow_send(tmp_path, monkeypatch):
    import json
    import tempfile

    from tests.helpers import cli

    root = Path(__file__).resolve().parents[2]
    # The role's worker processes import SGLang: the stand-ins go on their path too.
    path = [str(root)] + ([] if REAL_KERNELS else [str(STUBS)])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    (tmp_path / "sglang.toml").write_text(DEPLOYMENT)
    cli("up", "sglang.toml", "--detach", cwd=tmp_path, timeout=240)
    try:
        proc = cli(
            "send",
            "--name",
            "sglang_text",
            "--text",
            "hello there",
            "--json",
            "--param",
            "max_tokens=6",
            "--param",
            "temperature=0",
            cwd=tmp_path,
        )
        reply = json.loads(proc.stdout)
        assert reply["usage"]["completion_tokens"] == 6
        refused = cli(
            "send",
            "--name",
            "sglang_text",
            "--text",
            "hi",
            "--want",
            "text,image",
            cwd=tmp_path,
            check=False,
        )
        assert refused.returncode != 0
        assert "params.want" in refused.stdout + refused.stderr
        assert "sglang" in refused.stdout + refused.stderr
    finally:
        cli("down", "--name", "sglang_text", check=False, cwd=tmp_path)
