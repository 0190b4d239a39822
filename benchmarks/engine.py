"""Engine throughput and prefix-cache TTFT on CPU, against transformers' batched generate.

Prints a JSON object as its last line:
  tokens_per_s      omniflow, 32 concurrent requests, 128 prompt + 128 output tokens
  hf_tokens_per_s   transformers' batched generate on the same model in the same run
  ttft_cached_ms    time to first token with a 1,024-token prefix already cached
  ttft_uncached_ms  the same request with prefix caching off
  speedup           median over rounds of omniflow / transformers within the round (a paired
                    figure: a burst of load from other processes hits both sides of a round)
Where the time goes, to read the 2x target against (medians over rounds):
  prefill_s, decode_step_ms        omniflow: until every request has its first token; one
                                   decode step of the 32 requests after that
  hf_prefill_s, hf_decode_step_ms  transformers: generate with 1 new token; (128 - 1) / 127
  gemm_step_ms                     a decode step's projections alone: every weight of the
                                   model once, at 32 rows, as a step reads them
  gemm_bound_tokens_per_s          the throughput if a decode step cost only its projections:
                                   tokens / (prefill_s + (output_len - 1) * gemm_step_ms)
A floor for any engine on this machine, same model, same precision:
  floor_step_ms                    the bytes a decode step must read, every weight once and the
                                   K and V of 32 contexts of the mean length, at the bandwidth a
                                   float32 sum over a buffer that size reaches in the round
  prefill_floor_s                  the prompts' projections alone (4,096 rows at once, in the
                                   engine's layout), best of two
  floor_tokens_per_s               tokens / (prefill_floor_s + (output_len - 1) * floor_step_ms)
  floor_speedup                    median over rounds of floor / transformers within the round:
                                   about the most an engine could show here against transformers
Subject and baseline run interleaved (A B A B ...); each figure is a median over rounds.
With --backend sglang it measures instead the SGLang backend (SGLang's forward over omniflow's
pages, omniflow's scheduler and sampler) beside the torch backend on the same model, A B A B:
  sglang_tokens_per_s, torch_tokens_per_s   throughput as above, each backend's engine
  sglang_ttft_cached_ms, torch_ttft_cached_ms      TTFT with the prefix cached
  sglang_ttft_uncached_ms, torch_ttft_uncached_ms  and with prefix caching off
  sglang_over_torch                         median over rounds of sglang / torch tokens/s
  cpu, device                               where it ran (on CPU SGLang runs its torch_native
                                            attention: a correctness path, expected slower)
With --model deepseek_v2 (a tiny DeepSeek-V2: MLA + DeepSeekMoE) it adds
  mla_kv_bytes_per_token           the engine's latent pages: (kv_lora_rank + rope) x layers
  mha_kv_bytes_per_token           K and V of an MHA of the same width and heads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_name, scratch_dir  # noqa: E402

from omniflow.engine import LLMEngine, SamplingParams  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.engine.paged_attention import KVCache  # noqa: E402
from omniflow.models import build_tiny_model  # noqa: E402
from omniflow.models.layers.cpu_layouts import packed_weights_supported  # noqa: E402

# --model: the tiny preset each benchmarks.
MODELS = {"llama": "llama-bench-30m", "deepseek_v2": "deepseek-v2-bench"}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def omniflow_throughput(engine: LLMEngine, prompts, output_len: int, tag: str):
    """tokens/s, the time until every request had a token, the median decode step after."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    produced, started_ids, prefill_s, steps = 0, set(), 0.0, []
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            step_started = time.perf_counter()
            deltas = engine.step()
            if prefill_s:
                steps.append(time.perf_counter() - step_started)
            produced += sum(len(delta.token_ids) for delta in deltas)
            started_ids.update(delta.request_id for delta in deltas if delta.token_ids)
            if not prefill_s and len(started_ids) == len(prompts):
                prefill_s = time.perf_counter() - started
    elapsed = time.perf_counter() - started
    assert produced == len(prompts) * output_len, produced
    return produced / elapsed, prefill_s, statistics.median(steps)


class Projections:
    """A model's projections alone, timed: every weight once, as a step reads them (through
    the model's own modules, so in the layout the engine put them in). Random inputs are
    made once per row count, outside the timing."""

    def __init__(self, model):
        # qkv, o, gate_up, down per layer, in registration order (MLA: its linear
        # projections; kv_b_proj is absorbed into attention, the experts run per group)
        self.modules = [
            m
            for name, m in model.named_modules()
            if name.endswith("proj") and hasattr(m, "in_features")
        ]
        self.per_layer = len(self.modules) // model.config.num_hidden_layers
        self.model = model
        self.hidden = model.config.hidden_size
        self.dtype = model.model.embed_tokens.weight.dtype
        self._inputs: dict[int, dict[int, torch.Tensor]] = {}

    def _inputs_for(self, rows: int) -> dict[int, torch.Tensor]:
        if rows not in self._inputs:
            sizes = {m.in_features for m in self.modules} | {self.hidden}
            self._inputs[rows] = {size: torch.randn(rows, size, dtype=self.dtype) for size in sizes}
        return self._inputs[rows]

    def step_s(self, rows: int, head_rows: int | None = None) -> float:
        """Every projection at ``rows`` rows, the output projection at ``head_rows`` (default:
        rows)."""
        inputs = self._inputs_for(rows)
        head_input = self._inputs_for(head_rows or rows)[self.hidden]
        with torch.inference_mode():
            started = time.perf_counter()
            for module in self.modules:
                module(inputs[module.in_features])
            self.model.logits(head_input)
            return time.perf_counter() - started


def projected_tokens_per_s(tokens: int, output_len: int, prefill_s: float, step_s: float):
    """Throughput if the prompts took ``prefill_s`` and each later decode step ``step_s``."""
    return tokens / (prefill_s + (output_len - 1) * step_s)


def decode_step_bytes(model, rows: int, context: int) -> int:
    """What a decode step must read: every weight once (a tied table once, as the output
    projection), and the K and V of ``rows`` contexts of ``context`` tokens in every layer."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    element = next(model.parameters()).element_size()
    layers, kv_heads, head_dim = config.kv_layout
    return weights + 2 * layers * rows * context * kv_heads * head_dim * element


def kv_bytes_per_token(engine: LLMEngine) -> int:
    cache = engine.cache
    stored = (cache.keys.numel() + cache.values.numel()) * cache.keys.element_size()
    return stored // (cache.num_pages * cache.page_size)


def mha_kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V per token of an MHA decoder with the config's width, heads and layers."""
    heads = config.num_attention_heads
    layers = config.kv_layout[0]
    return KVCache.bytes_per_page(layers, 1, heads, config.hidden_size // heads, dtype)


class ReadBandwidth:
    """Bytes per second a float32 sum reaches over a buffer of ``nbytes`` (random values,
    made once): the rate at which this machine streams a step's bytes right now."""

    def __init__(self, nbytes: int):
        self.buffer = torch.randn(nbytes // 4)

    def bytes_per_s(self) -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            self.buffer.sum()
            return self.buffer.numel() * 4 / (time.perf_counter() - started)


def hf_throughput(model, prompts, output_len: int) -> float:
    input_ids = torch.tensor(prompts, device=model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - started
    produced = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    assert produced == len(prompts) * output_len, produced
    return produced / elapsed


def ttft_ms(engine: LLMEngine, prompt: list[int], tag: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(tag, prompt, params)
    first = None
    while first is None:
        for delta in engine.step():
            if delta.token_ids:
                first = time.perf_counter()
    return (first - started) * 1000


def compare_backends(args, folder) -> None:
    """The SGLang backend beside the torch backend: tokens/s and TTFT, interleaved rounds."""
    device = args.device
    engines = {}
    for backend in ("torch", "sglang"):
        options = dict(device=device, dtype=args.dtype, max_num_seqs=64, backend=backend)
        engines[backend] = (
            LLMEngine(folder, EngineConfig(**options)),
            LLMEngine(folder, EngineConfig(**options, enable_prefix_caching=False)),
        )
    vocab = engines["torch"][0].vocab_size
    print(f"cpu: {cpu_name()}, device={device}, threads={torch.get_num_threads()}")
    warm = random_prompts(4, 16, vocab, seed=99)
    for engine, _ in engines.values():
        omniflow_throughput(engine, warm, 4, "warmup")
    rates: dict[str, list[float]] = {"torch": [], "sglang": []}
    for round_index in range(args.rounds):
        prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=round_index)
        for backend, (engine, _) in engines.items():
            rate, _, _ = omniflow_throughput(engine, prompts, args.output_len, f"tp{round_index}")
            rates[backend].append(rate)
        print(
            f"round {round_index}: torch {rates['torch'][-1]:.1f} tok/s, "
            f"sglang {rates['sglang'][-1]:.1f}"
        )
    [prefix] = random_prompts(1, args.prefix_len, vocab, seed=1000)
    for engine, _ in engines.values():
        ttft_ms(engine, prefix + [5], "prefix-warm")  # puts the prefix in the cache
    ttft: dict[str, list[float]] = {}
    for round_index in range(args.rounds + 2):
        [suffix] = random_prompts(1, 16, vocab, seed=2000 + round_index)
        for backend, (engine, uncached_engine) in engines.items():
            for kind, which in (("cached", engine), ("uncached", uncached_engine)):
                ms = ttft_ms(which, prefix + suffix, f"{kind}{round_index}")
                ttft.setdefault(f"{backend}_{kind}", []).append(ms)
        print(
            f"ttft round {round_index}: "
            + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in ttft.items())
        )
    result = {
        "sglang_tokens_per_s": round(statistics.median(rates["sglang"]), 1),
        "torch_tokens_per_s": round(statistics.median(rates["torch"]), 1),
        "sglang_over_torch": round(
            statistics.median(a / b for a, b in zip(rates["sglang"], rates["torch"], strict=True)),
            3,
        ),
        **{
            f"{backend}_ttft_{kind}_ms": round(statistics.median(ttft[f"{backend}_{kind}"]), 2)
            for backend in ("sglang", "torch")
            for kind in ("cached", "uncached")
        },
        "model": args.model,
        "dtype": args.dtype,
        "device": device,
        "cpu": cpu_name(),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "rounds": args.rounds,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 where this CPU multiplies bf16 natively (oneDNN: AMX or "
        "AVX-512 BF16), as a CPU deployment would run; float32 elsewhere",
    )
    parser.add_argument(
        "--compare-pytorch-ops",
        action="store_true",
        help="bf16: also run the engine with its CPU kernels off (cpu_kernels=False) in every "
        "round, and report pytorch_ops_tokens_per_s and kernels_speedup",
    )
    parser.add_argument(
        "--backend",
        default="torch",
        choices=["torch", "sglang"],
        help="sglang: the SGLang backend beside the torch backend (needs sglang==0.5.23)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both backends)")
    args = parser.parse_args()
    if args.device != "cpu":
        args.dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    if args.dtype == "auto":
        native = packed_weights_supported(torch.device("cpu"), torch.bfloat16)
        args.dtype = "bfloat16" if native else "float32"

    import transformers

    transformers.logging.set_verbosity_error()
    folder = build_tiny_model(scratch_dir("omniflow-bench-"), MODELS[args.model])
    if args.backend == "sglang":
        compare_backends(args, folder)
        return
    config = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=64)
    engine = LLMEngine(folder, config)
    uncached_engine = LLMEngine(
        folder, EngineConfig(device=args.device, dtype=args.dtype, enable_prefix_caching=False)
    )
    ops_engine = None
    if args.compare_pytorch_ops:
        ops_engine = LLMEngine(folder, replace(config, cpu_kernels=False))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, args.dtype)
    )
    hf_model.to(args.device).eval()
    parameters = sum(p.numel() for p in engine.model.parameters())
    vocab = engine.vocab_size
    print(f"model: {parameters / 1e6:.1f}M parameters, threads={torch.get_num_threads()}")

    warm = random_prompts(4, 16, vocab, seed=99)
    omniflow_throughput(engine, warm, 4, "warmup")
    if ops_engine is not None:
        omniflow_throughput(ops_engine, warm, 4, "warmup")
    hf_throughput(hf_model, warm, 4)

    ours, theirs, prefill, steps, hf_prefill, hf_steps, gemms = [], [], [], [], [], [], []
    floors, prefill_floors, floor_ratios, ops = [], [], [], []
    tokens = args.requests * args.output_len
    projections = Projections(engine.model)
    mean_context = args.prompt_len + args.output_len // 2
    step_bytes = decode_step_bytes(engine.model, args.requests, mean_context)
    bandwidth = ReadBandwidth(step_bytes)
    for round_index in range(args.rounds):
        prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=round_index)
        rate, prefill_s, step_s = omniflow_throughput(
            engine, prompts, args.output_len, f"tp{round_index}"
        )
        ours.append(rate)
        if ops_engine is not None:
            ops.append(
                omniflow_throughput(ops_engine, prompts, args.output_len, f"ops{round_index}")[0]
            )
        prefill.append(prefill_s)
        steps.append(step_s)
        theirs.append(hf_throughput(hf_model, prompts, args.output_len))
        one = len(prompts) / hf_throughput(hf_model, prompts, 1)  # seconds for 1 new token
        hf_prefill.append(one)
        total = len(prompts) * args.output_len / theirs[-1]
        hf_steps.append((total - one) / (args.output_len - 1))
        gemms += [projections.step_s(args.requests) for _ in range(10)]
        round_floors = [step_bytes / bandwidth.bytes_per_s() for _ in range(10)]
        floors += round_floors
        round_prefill = min(
            projections.step_s(len(prompts) * args.prompt_len, head_rows=args.requests)
            for _ in range(2)
        )
        prefill_floors.append(round_prefill)
        floor_rate = projected_tokens_per_s(
            tokens, args.output_len, round_prefill, statistics.median(round_floors)
        )
        floor_ratios.append(floor_rate / theirs[-1])
        print(f"round {round_index}: omniflow {ours[-1]:.1f} tok/s, transformers {theirs[-1]:.1f}")

    [prefix] = random_prompts(1, args.prefix_len, vocab, seed=1000)
    ttft_engine_warm = prefix + [5]
    ttft_ms(engine, ttft_engine_warm, "prefix-warm")  # puts the prefix in the cache
    cached, uncached = [], []
    for round_index in range(args.rounds + 2):
        [suffix] = random_prompts(1, 16, vocab, seed=2000 + round_index)
        uncached.append(ttft_ms(uncached_engine, prefix + suffix, f"u{round_index}"))
        cached.append(ttft_ms(engine, prefix + suffix, f"c{round_index}"))
        print(f"ttft round {round_index}: uncached {uncached[-1]:.1f} ms, cached {cached[-1]:.1f}")

    result = {
        "tokens_per_s": round(statistics.median(ours), 1),
        "hf_tokens_per_s": round(statistics.median(theirs), 1),
        "speedup": round(statistics.median(a / b for a, b in zip(ours, theirs, strict=True)), 2),
        "ttft_cached_ms": round(statistics.median(cached), 2),
        "ttft_uncached_ms": round(statistics.median(uncached), 2),
        "prefill_s": round(statistics.median(prefill), 3),
        "decode_step_ms": round(statistics.median(steps) * 1e3, 2),
        "hf_prefill_s": round(statistics.median(hf_prefill), 3),
        "hf_decode_step_ms": round(statistics.median(hf_steps) * 1e3, 2),
        "gemm_step_ms": round(statistics.median(gemms) * 1e3, 2),
        "gemm_bound_tokens_per_s": round(
            projected_tokens_per_s(
                tokens, args.output_len, statistics.median(prefill), statistics.median(gemms)
            ),
            1,
        ),
        "floor_step_ms": round(statistics.median(floors) * 1e3, 2),
        "prefill_floor_s": round(statistics.median(prefill_floors), 3),
        "floor_tokens_per_s": round(
            projected_tokens_per_s(
                tokens,
                args.output_len,
                statistics.median(prefill_floors),
                statistics.median(floors),
            ),
            1,
        ),
        "floor_speedup": round(statistics.median(floor_ratios), 2),
        "model": args.model,
        "dtype": args.dtype,
        "decode_step_mb": round(step_bytes / 1e6, 1),
        "model_params_m": round(parameters / 1e6, 1),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "rounds": args.rounds,
    }
    if ops:
        result["pytorch_ops_tokens_per_s"] = round(statistics.median(ops), 1)
        result["kernels_speedup"] = round(
            statistics.median(a / b for a, b in zip(ours, ops, strict=True)), 2
        )
        result["cpu_kernels"] = engine.runner.kernels is not None
    if args.model == "deepseek_v2":
        result["mla_kv_bytes_per_token"] = kv_bytes_per_token(engine)
        dtype = getattr(torch, args.dtype)
        result["mha_kv_bytes_per_token"] = mha_kv_bytes_per_token(engine.model.config, dtype)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
