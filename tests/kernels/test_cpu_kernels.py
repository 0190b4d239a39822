"""omniflow's CPU kernels (built here from kernels/*.c with the machine's compiler) against
the PyTorch ops they replace, and the engine and decoder on them against PyTorch ops."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.cpu_attention import CpuPagedAttention
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.paged_attention import KVCache, PagedAttention, build_attention_batch
from omniflow.kernels import build, cpu, cpu_kernels, unavailable_reason
from omniflow.models import build_tiny_model, load_decoder
from omniflow.models.layers.rope import apply_rotary
from omniflow.models.llama.decoder import causal_attention
from omniflow.models.tiny.builder import TinySpec

kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(
    kernels is None, reason=f"CPU kernels unavailable: {unavailable_reason()}"
)
BF16 = torch.bfloat16


def bf16_randn(*shape, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(BF16)


@needs_kernels
def test_loading_the_kernels_leaves_subnormal_floats_alone():
    """The library must not switch the process to flush-to-zero / denormals-are-zero (as
    GCC's crtfastmath.o does when it links with -ffast-math): torch and Python floats in
    the same process would lose their subnormals."""
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0 and tiny / 2.0 == 0.0
    subnormal = torch.tensor([1e-40], dtype=torch.float32)
    assert (subnormal * 1.0).item() > 0.0


@needs_kernels
def test_add_rms_norm_adds_in_place_and_rounds_as_transformers():
    # 300 rows of 512: above the size where the rows are split across threads.
    x, delta = bf16_randn(300, 512, seed=1), bf16_randn(300, 512, seed=2)
    weight = (1 + bf16_randn(512, seed=3, scale=0.1).float()).to(BF16)
    expected_x = x + delta
    xf = expected_x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)
    expected = weight * normed
    out = kernels.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(x, expected_x)  # the residual add, in place and rounded alike
    # The float32 sum of squares runs in another order: at most one bf16 step apart, rarely.
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=0)
    assert (out != expected).float().mean() < 0.01
    alone = kernels.add_rms_norm(expected_x.clone(), None, weight, 1e-6)
    assert torch.equal(alone, out)
    with pytest.raises(ValueError, match="delta"):
        kernels.add_rms_norm(x, delta[:10], weight, 1e-6)
    with pytest.raises(ValueError, match="x: expected a contiguous bf16"):
        kernels.add_rms_norm(x.t(), None, weight, 1e-6)


@needs_kernels
def test_rotary_in_place_equals_apply_rotary():
    tokens, heads, kv_heads, dim = 37, 8, 2, 64
    qkv = bf16_randn(tokens, (heads + 2 * kv_heads) * dim, seed=4)
    positions = torch.arange(100, 100 + tokens).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    rotated = heads + kv_heads
    expected = apply_rotary(qkv[:, : rotated * dim].reshape(tokens, rotated, dim), cos, sin)
    out = qkv.clone()
    kernels.rotary_(out, rotated, cos, sin)
    assert torch.equal(out[:, : rotated * dim].view(tokens, rotated, dim), expected)
    assert torch.equal(out[:, rotated * dim :], qkv[:, rotated * dim :])  # v untouched


@needs_kernels
def test_silu_mul_equals_pytorch():
    gate_up = bf16_randn(70, 2 * 1408, seed=5, scale=3.0)
    gate, up = gate_up.split(1408, dim=-1)
    out, expected = kernels.silu_mul(gate_up), F.silu(gate) * up
    # Rounded where PyTorch rounds; another exp and division may land a float32 silu that
    # sits on a bf16 rounding tie one step away (seen: 0.06% of these values).
    torch.testing.assert_close(out, expected, rtol=2**-6, atol=0)  # a step, then * up
    assert (out != expected).float().mean() < 0.005
    moderate = bf16_randn(70, 2 * 1408, seed=5)
    gate, up = moderate.split(1408, dim=-1)
    assert torch.equal(kernels.silu_mul(moderate), F.silu(gate) * up)


@needs_kernels
def test_kv_write_stores_each_row_at_its_slot():
    layer_keys = torch.zeros(2, 6, 4, 64, dtype=BF16)  # [kv_heads, pages, page_size, dim]
    layer_values = torch.zeros_like(layer_keys)
    qkv = bf16_randn(5, (4 + 2 + 2) * 64, seed=6).view(5, 8, 64)
    k, v = qkv[:, 4:6], qkv[:, 6:8]  # strided rows, as the decoder passes them
    slots = torch.tensor([3, 22, 0, 9, 17])
    kernels.kv_write(k, v, layer_keys, layer_values, slots)
    flat_keys, flat_values = layer_keys.view(2, 24, 64), layer_values.view(2, 24, 64)
    assert torch.equal(flat_keys[:, slots].transpose(0, 1), k)
    assert torch.equal(flat_values[:, slots].transpose(0, 1), v)
    untouched = [s for s in range(24) if s not in slots.tolist()]
    assert not flat_keys[:, untouched].any() and not flat_values[:, untouched].any()


needs_amx = pytest.mark.skipif(
    kernels is None or not kernels.amx, reason="no AMX here (or no CPU kernels)"
)


@pytest.fixture(params=["amx", "avx512"])
def attention_kernels(request, monkeypatch):
    """The kernels with their AMX paths (where this CPU has AMX) or without (OMNIFLOW_CPU_AMX=0,
    as on a CPU with AVX-512 BF16 but no AMX): prefill attention runs on either."""
    if kernels is None:
        pytest.skip(f"CPU kernels unavailable: {unavailable_reason()}")
    if request.param == "amx":
        if not kernels.amx:
            pytest.skip("no AMX here")
        return kernels
    monkeypatch.setenv(cpu.AMX_SWITCH, "0")
    without = cpu.CpuKernels(kernels._lib)
    if not without.context_attention_supported(2, 1, 32):
        pytest.skip("no AVX-512 BF16 here")
    return without


@needs_kernels
def test_the_amx_switch_turns_the_amx_paths_off(monkeypatch):
    monkeypatch.setenv(cpu.AMX_SWITCH, "0")
    assert not cpu.CpuKernels(kernels._lib).amx
    monkeypatch.setenv(cpu.AMX_SWITCH, "1")
    assert cpu.CpuKernels(kernels._lib).amx == bool(kernels._lib.omniflow_amx_supported())


@needs_amx
@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [(32, 512, 1024), (5, 96, 100), (37, 1408, 512), (300, 64, 48), (19, 40, 33), (16, 60, 17)],
)
def test_linear_on_amx_equals_a_float32_projection(rows, in_features, out_features):
    """Row and column counts off the 16/32 tiles, inputs off the 32-wide k-blocks, a bias, and
    300 rows (two tasks of rows, both threads)."""
    x = bf16_randn(rows, in_features, seed=20)
    weight = bf16_randn(out_features, in_features, seed=21, scale=0.05)
    bias = bf16_randn(out_features, seed=22)
    packed = kernels.pack_linear(weight)
    assert packed.shape[2:] == cpu.PACKED_TILE
    assert torch.equal(kernels.unpack_linear(packed, out_features, in_features), weight)
    expected = F.linear(x.float(), weight.float(), bias.float())
    for with_bias in (True, False):
        out = kernels.linear(x, packed, out_features, bias if with_bias else None)
        reference = expected if with_bias else expected - bias.float()
        assert out.shape == (rows, out_features) and out.dtype == BF16
        # Accumulated in float32 and rounded once: within half a bf16 step of the float32 sum.
        assert ((out.float() - reference).abs() <= reference.abs() * 2**-8 + 1e-6).all()


@needs_amx
@pytest.mark.parametrize("rows,inter", [(32, 1408), (7, 23), (40, 16)])
def test_fused_gate_up_on_amx_equals_the_unfused_ops(rows, inter):
    x = bf16_randn(rows, 96, seed=23)
    weight = bf16_randn(2 * inter, 96, seed=24, scale=0.1)
    bias = bf16_randn(2 * inter, seed=25)
    packed = kernels.pack_linear(weight, gate_up=inter)
    assert torch.equal(kernels.unpack_linear(packed, 2 * inter, 96, gate_up=inter), weight)
    gate_up = kernels.linear(x, packed, 2 * inter, bias, gate_up=inter)
    plain = kernels.linear(x, kernels.pack_linear(weight), 2 * inter, bias)
    assert torch.equal(gate_up, plain)  # the same sums in the same order, halves in place
    fused = kernels.linear(x, packed, 2 * inter, bias, gate_up=inter, silu=True)
    assert torch.equal(fused, kernels.silu_mul(gate_up))  # rounded where the two ops round
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(fused, F.silu(gate) * up, rtol=2**-7, atol=0)


@needs_amx
def test_linear_refuses_what_does_not_fit_its_weight():
    packed = kernels.pack_linear(bf16_randn(64, 32, seed=26))
    with pytest.raises(ValueError, match="does not fit a packed"):
        kernels.linear(bf16_randn(4, 64, seed=27), packed, 64)  # 64 inputs, not 32
    with pytest.raises(ValueError, match="does not fit a packed"):
        kernels.linear(bf16_randn(4, 32, seed=27).float(), packed, 64)
    with pytest.raises(ValueError, match="silu needs a fused gate/up"):
        kernels.linear(bf16_randn(4, 32, seed=27), packed, 64, silu=True)
    with pytest.raises(ValueError, match="bias"):
        kernels.linear(bf16_randn(4, 32, seed=27), packed, 64, bf16_randn(63, seed=28))
    with pytest.raises(ValueError, match="not gate \\+ up"):
        kernels.pack_linear(bf16_randn(64, 32, seed=26), gate_up=30)


def attention_reference(q, layer_keys, layer_values, tables, lengths, scale):
    kv_heads, _, _, dim = layer_keys.shape
    group = q.shape[1] // kv_heads
    outputs = []
    for row, length in enumerate(lengths.tolist()):
        keys = layer_keys[:, tables[row]].reshape(kv_heads, -1, dim)[:, :length].float()
        values = layer_values[:, tables[row]].reshape(kv_heads, -1, dim)[:, :length].float()
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = (q[row].float()[:, None, :] @ keys.transpose(1, 2)) * scale
        outputs.append((scores.softmax(-1) @ values)[:, 0])
    return torch.stack(outputs)


@needs_kernels
@pytest.mark.parametrize(
    "heads,kv_heads,dim,page_size",
    [(8, 4, 64, 16), (6, 2, 64, 4), (2, 1, 128, 16), (16, 2, 32, 8), (8, 8, 64, 5)],
)
def test_decode_attention_over_ragged_pages(heads, kv_heads, dim, page_size):
    # Lengths around the kernel's 16-token blocks, unordered pages.
    lengths = torch.tensor([1, 2, 15, 16, 17, 33, 190])
    width = -(-190 // page_size)
    generator = torch.Generator().manual_seed(heads * dim + page_size)
    pages = 3 * width
    tables = torch.stack([torch.randperm(pages, generator=generator)[:width] for _ in lengths])
    layer_keys = bf16_randn(kv_heads, pages, page_size, dim, seed=7)
    layer_values = bf16_randn(kv_heads, pages, page_size, dim, seed=8)
    qkv = bf16_randn(len(lengths), (heads + 2 * kv_heads) * dim, seed=9)
    q = qkv[:, : heads * dim].view(len(lengths), heads, dim)  # rows strided as in the decoder
    assert kernels.decode_attention_supported(heads, kv_heads, dim)
    scale = dim**-0.5
    out = kernels.decode_attention(q, layer_keys, layer_values, tables, lengths, scale)
    expected = attention_reference(q, layer_keys, layer_values, tables, lengths, scale)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_decode_attention_refuses_what_it_does_not_build():
    assert not kernels.decode_attention_supported(6, 2, 8)  # head size 8
    assert not kernels.decode_attention_supported(18, 1, 64)  # 18 query heads per kv head
    q = bf16_randn(2, 6, 8)
    pages = bf16_randn(2, 4, 4, 8)
    tables, lengths = torch.zeros(2, 1, dtype=torch.long), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="not supported by this build"):
        kernels.decode_attention(q, pages, pages, tables, lengths, 1.0)


def context_attention_reference(q, layer_keys, layer_values, pages, start, scale):
    """float32 attention of q's tokens (positions start..) over the pages, causal, with the
    probabilities rounded to bf16 before the values as PyTorch's bf16 attention does."""
    chunk, heads, dim = q.shape
    kv_heads = layer_keys.shape[0]
    n = start + chunk
    keys = layer_keys[:, pages].reshape(kv_heads, -1, dim)[:, :n].float()
    values = layer_values[:, pages].reshape(kv_heads, -1, dim)[:, :n].float()
    group = heads // kv_heads
    future = torch.arange(n)[None, :] > (start + torch.arange(chunk))[:, None]
    out = torch.empty(chunk, heads, dim)
    for head in range(heads):
        scores = (q[:, head].float() @ keys[head // group].T * scale).masked_fill(future, -1e30)
        out[:, head] = scores.softmax(-1).to(BF16).float() @ values[head // group]
    return out


@pytest.mark.parametrize(
    "chunk,start,heads,kv_heads,dim,page_size",
    [(16, 1024, 8, 4, 64, 16), (5, 0, 4, 2, 32, 4), (37, 50, 6, 2, 128, 16), (1, 7, 2, 2, 64, 4)],
)
def test_context_attention_over_scattered_pages(
    attention_kernels, chunk, start, heads, kv_heads, dim, page_size
):
    """A chunk of new tokens over its cached context (1,024 tokens; none; ragged blocks of 16
    tokens and keys), its pages out of order among others, q strided as in a fused q/k/v row."""
    count = (start + chunk + page_size - 1) // page_size
    layer_keys = bf16_randn(kv_heads, 2 * count + 3, page_size, dim, seed=30)
    layer_values = bf16_randn(kv_heads, 2 * count + 3, page_size, dim, seed=31)
    pages = torch.randperm(2 * count + 3, generator=torch.Generator().manual_seed(32))[:count]
    qkv = bf16_randn(chunk, (heads + 2 * kv_heads) * dim, seed=33)
    q = qkv[:, : heads * dim].view(chunk, heads, dim)
    out = attention_kernels.context_attention(q, layer_keys, layer_values, pages, start, dim**-0.5)
    expected = context_attention_reference(q, layer_keys, layer_values, pages, start, dim**-0.5)
    # float32 sums in another order, rounded once: within a bf16 step or two of the reference.
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2e-3)
    with pytest.raises(ValueError, match="do not hold"):
        attention_kernels.context_attention(
            q, layer_keys, layer_values, pages[:-1], start + 16, 0.1
        )


@needs_kernels
def test_paged_attention_on_the_kernels_equals_sdpa():
    """Through PagedAttention: a batch built without decode masks writes K/V and decodes on
    the kernels; the same batch with masks runs PyTorch's SDPA. Same K/V, close outputs."""
    page, kv_heads, heads, dim = 4, 2, 6, 64
    decodes = [([3, 5, 7], 10), ([1], 3), ([2, 8, 9, 10], 16), ([4, 6], 5)]
    outputs, caches = [], []
    for use_kernels in (True, False):
        cache = KVCache(1, 12, page, kv_heads, dim, BF16, torch.device("cpu"))
        cache.keys.copy_(bf16_randn(*cache.keys.shape, seed=10))
        cache.values.copy_(bf16_randn(*cache.values.shape, seed=11))
        qkv = bf16_randn(len(decodes), (heads + 2 * kv_heads) * dim, seed=12)
        q, k, v = qkv.view(len(decodes), -1, dim).split([heads, kv_heads, kv_heads], dim=1)
        batch = build_attention_batch(
            cache, decodes, [], cache.keys.device, BF16, decode_masks=not use_kernels
        )
        assert (batch.decode_bias is None) == use_kernels
        attention = (
            CpuPagedAttention(cache, batch, dim**-0.5, kernels)
            if use_kernels
            else PagedAttention(cache, batch, dim**-0.5)
        )
        outputs.append(attention(0, q, k, v))
        caches.append(cache)
    assert torch.equal(caches[0].keys, caches[1].keys)  # the same new K/V, at the same slots
    assert torch.equal(caches[0].values, caches[1].values)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("row_block", [None, 4])
def test_decoder_on_the_kernels_gives_the_pytorch_logits(tmp_path, row_block):
    path = build_tiny_model(tmp_path / "m", "llama-gqa", seed=13)
    model = load_decoder(path, device="cpu", dtype="bfloat16")
    tokens = torch.tensor([5, 9, 2, 7, 11, 3, 8, 4, 6, 10, 12])  # 11 rows: blocks of 4, 4, 3
    positions = torch.arange(len(tokens))
    with torch.inference_mode():
        expected = model(tokens, positions, causal_attention)
        model.set_row_block(row_block)
        model.use_cpu_kernels(kernels)
        out = model(tokens, positions, causal_attention)
        model.use_cpu_kernels(None)
        again = model(tokens, positions, causal_attention)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert (out == expected).float().mean() > 0.9  # mostly bit-equal
    torch.testing.assert_close(again, expected, rtol=2e-2, atol=2e-2)


def test_float32_models_refuse_the_kernels(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama-gqa", seed=14)
    model = load_decoder(path, device="cpu", dtype="float32")
    if kernels is None:
        pytest.skip(f"CPU kernels unavailable: {unavailable_reason()}")
    with pytest.raises(ValueError, match="bf16 CPU model"):
        model.use_cpu_kernels(kernels)


def test_unavailable_compiler_or_switch_gives_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    with pytest.raises(build.Unavailable, match="OMNIFLOW_CPU_KERNELS=0"):
        build.build()
    monkeypatch.delenv(build.ENV_SWITCH)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang either
    with pytest.raises(build.Unavailable, match="no C compiler"):
        build.build()
    assert not any(tmp_path.iterdir())  # nothing half-built left behind


def test_a_failing_build_gives_the_compiler_output(monkeypatch, tmp_path):
    if build.platform.machine() not in ("x86_64", "AMD64") or not build.shutil.which("cc"):
        pytest.skip("needs x86-64 and a C compiler")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(build, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(build.Unavailable, match="failed"):
        build.build()
    assert not list((tmp_path / "cache").rglob("*.so"))


# Head size 32, two query heads per kv head: a shape the decode kernel runs.
KERNEL_SPEC = TinySpec(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
)


def ragged_prompts(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (30, 12, 25, 7, 18)]


def small_pages_engine(path, num_pages, **config):
    """A bf16 engine on pages of 4 tokens, 32 tokens a step (prompts run in chunks)."""
    return LLMEngine(
        path,
        EngineConfig(
            device="cpu",
            dtype="bfloat16",
            page_size=4,
            num_pages=num_pages,
            max_num_batched_tokens=32,
            **config,
        ),
    )


def staggered_run(engine, prompts, params, logprobs=False):
    """Requests arrive over the first steps (steps mix prefills and decodes); r1 is aborted
    mid-decode. Returns each request's tokens (with logprobs: (token, logprob) pairs), and
    the preemptions they went through."""
    produced = {i: [] for i in range(len(prompts))}
    pending, steps, sequences = list(range(len(prompts))), 0, []
    while pending or engine.has_unfinished_requests():
        steps += 1
        if pending:
            index = pending.pop(0)
            engine.add_request(f"r{index}", prompts[index], params)
            sequences.append(engine.sequences[f"r{index}"])
        if steps == 9 and "r1" in engine.sequences:
            engine.abort("r1")
        for delta in engine.step():
            pairs = zip(delta.token_ids, delta.logprobs, strict=True)
            produced[int(delta.request_id[1:])] += list(pairs) if logprobs else delta.token_ids
    return produced, sum(sequence.num_preemptions for sequence in sequences)


@needs_kernels
@pytest.mark.parametrize("num_pages", [None, 14])
def test_engine_picks_the_float32_tokens_on_kernels_and_pytorch_ops(tmp_path, num_pages):
    """The bf16 engine on the kernels (decode attention over the pages in place) and on
    PyTorch ops (SDPA over the decode mirror), batched and ragged, with an abort and, with 14
    pages of 4 tokens, preemption: every greedy token is the float32 model's choice, up to
    bf16 noise. (The two bf16 paths can split on a near-tie: seen 2 of 100 tokens, where the
    float32 top two logits were 0.008 and 0.018 apart.)"""
    path = build_tiny_model(tmp_path / "m", KERNEL_SPEC, seed=15)
    prompts = ragged_prompts(seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    runs = []
    for use_kernels in (True, False):
        engine = small_pages_engine(path, num_pages, cpu_kernels=use_kernels)
        assert engine.runner.kernel_decode == use_kernels
        produced, preemptions = staggered_run(engine, prompts, params)
        runs.append(produced)
        if use_kernels:
            assert engine.runner.mirror.keys.shape[1] == 0  # decodes read the pages in place
        assert (preemptions > 0) == (num_pages is not None)
    assert len(runs[0][1]) < params.max_tokens  # aborted mid-decode
    for produced in runs:
        assert_float32_picks(path, dict(enumerate(prompts)), produced)


def counted(obj, name):
    """Wraps obj.name to record its calls; returns the list of calls."""
    calls, method = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


@needs_amx
@pytest.mark.parametrize(
    "spec,num_pages",
    [
        (KERNEL_SPEC, None),
        (KERNEL_SPEC, 14),
        (replace(KERNEL_SPEC, attention_bias=True), None),  # q/k/v and output biases
    ],
)
def test_fused_decode_steps_equal_the_kernels_called_layer_by_layer(tmp_path, spec, num_pages):
    """Decode-only steps run every layer in one call (engine/cpu_decode.py FusedDecode): the same
    tokens and log-probabilities, bit for bit, as the same kernels called one by one. Batched
    and ragged, steps mixing prefills and decodes (those keep the calls one by one), an
    abort and, with 14 pages of 4 tokens, preemption."""
    path = build_tiny_model(tmp_path / "m", spec, seed=17)
    prompts = ragged_prompts(seed=18)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    runs = []
    for fused in (True, False):
        engine = small_pages_engine(path, num_pages)
        assert engine.runner.fused_decode is not None  # AMX here: on by default
        calls = counted(engine.runner.fused_decode, "run")
        if not fused:
            engine.runner.fused_decode = None
        produced, preemptions = staggered_run(engine, prompts, params, logprobs=True)
        assert (len(calls) > 10) == fused
        assert (preemptions > 0) == (num_pages is not None)
        runs.append(produced)
    assert runs[0] == runs[1]
    assert all(len(pairs) == 20 for index, pairs in runs[0].items() if index != 1)


@needs_amx
def test_decode_layers_refuses_inputs_that_do_not_fit():
    x = bf16_randn(4, 64, seed=29)
    pages = torch.zeros(2, 8, 4, 32, dtype=BF16)
    layers = torch.zeros(1, len(cpu.DECODE_LAYER_FIELDS), dtype=torch.int64)
    cos = sin = torch.zeros(4, 32, dtype=BF16)
    index = torch.zeros(4, dtype=torch.int64)
    tables = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="decode_layers: inputs do not fit"):
        kernels.decode_layers(
            x, layers[:, :5], cos, sin, pages, index, tables, index, 4, 128, 1e-6, 0.1
        )
    with pytest.raises(ValueError, match="decode_layers: inputs do not fit"):
        kernels.decode_layers(
            x, layers, cos[:3], sin, pages, index, tables, index, 4, 128, 1e-6, 0.1
        )


@pytest.mark.parametrize(
    "chunks,tokens,heads,kv_heads,dim",
    [
        (32, 128, 8, 4, 64),
        (3, 37, 6, 2, 128),
        (1, 1, 2, 1, 32),
        (1, 1040, 8, 4, 64),
        (2, 50, 4, 4, 96),
    ],
)
def test_chunks_attention_equals_causal_sdpa(
    attention_kernels, chunks, tokens, heads, kv_heads, dim
):
    """Equal prompts with no cached context, q/k/v strided as in fused q/k/v rows: causal
    attention within each prompt, as float32 SDPA up to bf16 probabilities."""
    qkv = bf16_randn(chunks * tokens, (heads + 2 * kv_heads) * dim, seed=34)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    out = attention_kernels.chunks_attention(q, k, v, chunks, dim**-0.5)

    def split(x):
        return x.float().view(chunks, tokens, -1, dim).transpose(1, 2)

    expected = F.scaled_dot_product_attention(
        split(q), split(k), split(v), is_causal=True, scale=dim**-0.5, enable_gqa=True
    )
    expected = expected.transpose(1, 2).reshape(-1, heads, dim)
    torch.testing.assert_close(out.float(), expected, rtol=2**-6, atol=2e-2)
    with pytest.raises(ValueError, match="equal chunks"):
        attention_kernels.chunks_attention(q, k, v, chunks * tokens + 1, 0.1)
    with pytest.raises(ValueError, match="equal chunks"):
        apart = torch.cat([v, v], dim=-1)[..., :dim]  # v's heads strided unlike k's
        attention_kernels.chunks_attention(q, k, apart, chunks, 0.1)


def assert_float32_picks(path, prompts, produced):
    """Every greedy token is the float32 model's choice, up to bf16 noise (0.05 logit)."""
    reference = load_decoder(path, device="cpu", dtype="float32")
    for index, tokens in produced.items():
        assert tokens, index
        full = torch.tensor(prompts[index] + tokens)
        with torch.inference_mode():
            logits = reference(full, torch.arange(len(full)), causal_attention)
        chosen = logits[len(prompts[index]) - 1 : -1]  # the logits each token came from
        picked = chosen.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        # A wrong context (table, length, K/V slot) picks tokens whole logits below.
        assert (chosen.max(-1).values - picked).max() < 0.05, index


@pytest.mark.parametrize("amx", [True, False])
def test_cached_prefix_chunks_attend_on_the_kernels_and_pick_the_float32_tokens(
    tmp_path, monkeypatch, amx
):
    """A second turn over a cached 60-token prefix: its new tokens attend over the pages on
    the kernels (context_attention; AMX tiles, or AVX-512 BF16 with the AMX paths off), and
    every token is still the float32 model's pick."""
    if kernels is None or (amx and not kernels.amx):
        pytest.skip("no AMX here (or no CPU kernels)")
    monkeypatch.setattr(kernels, "amx", amx)  # the engine's projections and decode too
    if not kernels.context_attention_supported(2, 1, 32):
        pytest.skip("no AVX-512 BF16 here")
    path = build_tiny_model(tmp_path / "m", KERNEL_SPEC, seed=19)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16", page_size=4))
    calls, context_attention = [], kernels.context_attention
    monkeypatch.setattr(
        kernels,
        "context_attention",
        lambda *args, **kwargs: calls.append(1) or context_attention(*args, **kwargs),
    )
    prefix = ragged_prompts(seed=20)[0] * 2  # 60 tokens
    prompts = {0: prefix + [7, 8, 9], 1: prefix + [11, 12, 13, 14, 15]}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    produced, cached = {0: [], 1: []}, {}
    for index, prompt in prompts.items():
        engine.add_request(f"r{index}", prompt, params)
        for delta in engine.run_to_completion():
            produced[index] += delta.token_ids
            cached[index] = delta.num_cached_tokens
    assert cached[0] == 0 and cached[1] >= 56 and calls
    assert_float32_picks(path, prompts, produced)


def test_an_unwritable_cache_leaves_the_kernels_off(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache folder would have to be created under a file
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_loaded", None)
    monkeypatch.setattr(cpu, "_reason", None)
    assert cpu.cpu_kernels() is None
    assert cpu.unavailable_reason()
