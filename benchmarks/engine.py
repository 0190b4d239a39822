"""Engine throughput and prefix-cache TTFT on CPU, against transformers' batched generate.

Prints a JSON object as its last line:
  tokens_per_s      omniflow, 32 concurrent requests, 128 prompt + 128 output tokens
  hf_tokens_per_s   transformers' batched generate on the same model in the same run
  ttft_cached_ms    time to first token with a 1,024-token prefix already cached
  ttft_uncached_ms  the same request with prefix caching off
  speedup           median over rounds of omniflow / transformers within the round (a paired
                    figure: a burst of load from other processes hits both sides of a round)
Subject and baseline run interleaved (A B A B ...); each figure is a median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from omniflow.engine import LLMEngine, SamplingParams  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.models import build_tiny_model  # noqa: E402


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def omniflow_throughput(engine: LLMEngine, prompts, output_len: int, tag: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    produced = sum(len(delta.token_ids) for delta in engine.run_to_completion())
    elapsed = time.perf_counter() - started
    assert produced == len(prompts) * output_len, produced
    return produced / elapsed


def hf_throughput(model, prompts, output_len: int) -> float:
    input_ids = torch.tensor(prompts)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    folder = build_tiny_model(tempfile.mkdtemp(prefix="omniflow-bench-"), "llama-bench-30m")
    config = EngineConfig(device="cpu", dtype=args.dtype, max_num_seqs=64)
    engine = LLMEngine(folder, config)
    uncached_engine = LLMEngine(
        folder, EngineConfig(device="cpu", dtype=args.dtype, enable_prefix_caching=False)
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, args.dtype)
    )
    hf_model.eval()
    parameters = sum(p.numel() for p in engine.model.parameters())
    vocab = engine.vocab_size
    print(f"model: {parameters / 1e6:.1f}M parameters, threads={torch.get_num_threads()}")

    warm = random_prompts(4, 16, vocab, seed=99)
    omniflow_throughput(engine, warm, 4, "warmup")
    hf_throughput(hf_model, warm, 4)

    ours, theirs = [], []
    for round_index in range(args.rounds):
        prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=round_index)
        ours.append(omniflow_throughput(engine, prompts, args.output_len, f"tp{round_index}"))
        theirs.append(hf_throughput(hf_model, prompts, args.output_len))
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
        "model_params_m": round(parameters / 1e6, 1),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "rounds": args.rounds,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
