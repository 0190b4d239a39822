"""Media tokens and block steps through the engine, against full recompute, on the LongCat
tiny model (the llm role's: llama-mha, hidden 64, its image depth head and code embedder).

Prints the CPU it ran on, then a JSON object as its last line:
  context_tokens           the context lengths measured
  engine_ms_per_token      the next image token (with CFG) at each context length through the
                           engine: one decode step of the guided pair plus the depth head
  recompute_ms_per_token   the same token by re-running the whole context (and the
                           unconditional one) through the model, as the llm role used to
  tokens_per_s_c1, _c8     image tokens/s (CFG, 16x16 grid) with 1 and 8 concurrent requests
  block_step_ms_reuse      one block step of 256 rows over a kept 1,024-token prefix
  block_step_ms_recompute  the same block step computing the prefix with it (no reuse)
Subject and baseline run interleaved (A B A B ...); each figure is a median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_name, emit, scratch_dir  # noqa: E402

from omniflow.engine import LLMEngine, SamplingParams  # noqa: E402
from omniflow.engine.heads import Guidance, guided  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.models.omni import load_depth_head  # noqa: E402
from omniflow.models.omni.loader import ensure_model, load_model  # noqa: E402
from omniflow.models.tiny.builder import build_tiny_model  # noqa: E402

IMAGE_CODEBOOKS = [1024] * 8  # as roles/llm.py
CFG_SCALE = 2.0


class ImageHead:
    """The llm role's image head: the depth head, greedy, and the code embedder."""

    key, placeholder_id = "image", 0

    def __init__(self, folder, hidden: int):
        ensure_model(
            "depth_head", folder / "head", 1, hidden_size=hidden, codebook_sizes=IMAGE_CODEBOOKS
        )
        ensure_model(
            "code_embedder",
            folder / "embedder",
            3,
            hidden_size=hidden,
            codebook_sizes=IMAGE_CODEBOOKS,
        )
        self.depth_head = load_depth_head(folder / "head", "cpu")
        self.embedder = load_model("code_embedder", folder / "embedder", "cpu")

    def codes(self, hidden: torch.Tensor, pick=None) -> torch.Tensor:
        return self.depth_head.generate(hidden, temperature=0.0)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embedder(codes)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


def engine_ms_per_token(engine: LLMEngine, head, context: list[int], tokens: int, tag: str):
    """ms per image token after the first (the prefill is not counted)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    engine.add_request(tag, context, params, head=head, guidance=Guidance([1], CFG_SCALE))
    while not any(d.codes is not None for d in engine.step()):
        pass
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - started) * 1000 / (tokens - 1)


@torch.inference_mode()
def recompute_ms_per_token(model, head, context: list[int], tokens: int) -> float:
    """The llm role's old _generate_codes: the whole context again for every token."""
    x = model.embed(torch.tensor(context))
    uncond = model.embed(torch.tensor([1]))
    started = time.perf_counter()
    for _ in range(tokens):
        hidden = guided(model.hidden_states(x)[-1:], model.hidden_states(uncond)[-1:], CFG_SCALE)
        step = head.embed(head.codes(hidden)).to(x.dtype)
        x, uncond = torch.cat([x, step]), torch.cat([uncond, step])
    return (time.perf_counter() - started) * 1000 / tokens


def throughput(engine: LLMEngine, head, concurrency: int, tokens: int, seed: int) -> float:
    for index in range(concurrency):
        engine.add_request(
            f"c{concurrency}-{seed}-{index}",
            prompt_of(32, seed * 100 + index),
            SamplingParams(max_tokens=tokens, temperature=0.0),
            head=head,
            guidance=Guidance([1], CFG_SCALE),
        )
    started = time.perf_counter()
    engine.run_to_completion()
    return concurrency * tokens / (time.perf_counter() - started)


def block_step_ms(engine: LLMEngine, prefix: list[int], rows, reuse: bool, tag: str) -> float:
    """One block step over prefix: on a kept context whose prefix an earlier step computed
    (reuse), or on a fresh context each time (prefix caching off: computed with the block)."""
    positions = torch.arange(len(prefix), len(prefix) + len(rows))
    if reuse:
        if "bench-ctx" not in engine.kept:
            engine.keep_context("bench-ctx", prefix)
            engine.block_step(f"{tag}-warm", "bench-ctx", rows, positions)
            engine.run_to_completion()
        context = "bench-ctx"
    else:
        context = f"{tag}-ctx"
        engine.keep_context(context, prefix)
    engine.block_step(tag, context, rows, positions)
    started = time.perf_counter()
    engine.run_to_completion()
    elapsed = (time.perf_counter() - started) * 1000
    if not reuse:
        engine.release(context)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=17, help="image tokens per measurement")
    parser.add_argument("--grid-tokens", type=int, default=256, help="tokens per image (16x16)")
    # One thread by default: on a small shared VM a step's second thread often waits on a
    # busy core, and the figures swing by several times from run to run.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_name()}; torch threads {torch.get_num_threads()}", flush=True)
    root = scratch_dir("omni-decode-")
    folder = build_tiny_model(root / "llm", "llama-mha", seed=0, hidden_size=64, vocab_size=512)
    longest = max(args.contexts) + args.tokens + 8
    config = EngineConfig(device="cpu", max_model_len=longest, kv_cache_bytes=256 << 20)
    engine = LLMEngine(folder, config)
    baseline = LLMEngine(folder, EngineConfig(device="cpu", enable_prefix_caching=False))
    head = ImageHead(root / "omni", engine.model.config.hidden_size)
    model = engine.model
    engine_ms: dict[int, list[float]] = {n: [] for n in args.contexts}
    recompute_ms: dict[int, list[float]] = {n: [] for n in args.contexts}
    c1: list[float] = []
    c8: list[float] = []
    reuse_ms: list[float] = []
    recompute_block_ms: list[float] = []
    prefix = prompt_of(1024, 7)
    block_rows = torch.randn(
        256, model.config.hidden_size, generator=torch.Generator().manual_seed(8)
    )
    for round_index in range(args.rounds):
        for n in args.contexts:
            context = prompt_of(n, 1000 * round_index + n)
            engine_ms[n].append(
                engine_ms_per_token(engine, head, context, args.tokens, f"e{round_index}-{n}")
            )
            recompute_ms[n].append(recompute_ms_per_token(model, head, context, 3))
        c1.append(throughput(engine, head, 1, args.grid_tokens, round_index))
        c8.append(throughput(engine, head, 8, args.grid_tokens, round_index))
        for repeat in range(3):  # short: a few pairs a round, for a steadier median
            tag = f"{round_index}-{repeat}"
            reuse_ms.append(block_step_ms(engine, prefix, block_rows, True, f"r{tag}"))
            recompute_block_ms.append(block_step_ms(baseline, prefix, block_rows, False, f"x{tag}"))
    med = statistics.median
    emit(
        {
            "context_tokens": args.contexts,
            "engine_ms_per_token": [round(med(engine_ms[n]), 3) for n in args.contexts],
            "recompute_ms_per_token": [round(med(recompute_ms[n]), 3) for n in args.contexts],
            "tokens_per_s_c1": round(med(c1), 1),
            "tokens_per_s_c8": round(med(c8), 1),
            "block_step_ms_reuse": round(med(reuse_ms), 3),
            "block_step_ms_recompute": round(med(recompute_block_ms), 3),
            "cpu": cpu_name(),
        }
    )


if __name__ == "__main__":
    main()
