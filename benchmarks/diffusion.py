"""The HunyuanImage-3 pipeline on the tiny model: denoising steps over a reused prefix, CFG
batched, one weight copy across ar and diffusion, end-to-end t2i against separate stages.

A 256-token prompt and 256 image tokens (16 x 16 at the tiny model's base size), random
weights (the images are noise), by default at widths where compute fills a step (`--width`). Prints the CPU it ran on, then a JSON object last:
  step_ms_reuse            one guided denoising step (block step of 257 rows, cond + uncond)
                           over the prompt's KV computed once and kept
  step_ms_recompute        the same step computing the prompt's KV with it (no reuse)
  step_reuse_ceiling_*     recompute / reuse as arithmetic, the most reuse can win: rows
                           forwarded ((257 + 260) / 257 = 2.0), attention FLOPs, all FLOPs.
                           Both halves of a guided step reuse; the prompt is about as many
                           rows as the image, so no step can be 3x faster from reuse alone
  cfg_batched_ms           that step with cond and uncond paired in one forward
  cfg_sequential_ms        the same two halves as two forwards, one after the other
  weights_mb_two_roles     backbone bytes resident in ar + diffusion of a real deployment:
                           tensors that resolve (/proc/<pid>/maps) to the same shared file and
                           offset count once, the rest per process
  weights_mb_one_role      the backbone bytes one role holds alone
  t2i_s                    one t2i request (8 steps) through the deployment, warm
  t2i_separate_stages_s    the same request through the same runtime deployed as separate
                           stages (configs/hunyuan_image3.toml with share_weights = false on
                           ar and diffusion, lend_kv = false on ar, reuse_prefix = false on
                           diffusion): each role loads its own weights, diffusion computes the
                           prompt's KV itself; both deployments up, requests interleaved
Subject and baseline run interleaved (A B A B ...); each figure is a median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_name, emit, median, scratch_dir, short_run_root  # noqa: E402

import omniflow  # noqa: E402
from omniflow.control.discovery import list_actors  # noqa: E402
from omniflow.engine import Guidance, LLMEngine  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.memory.mappings import mapping_at  # noqa: E402
from omniflow.models.flow_matching import initial_noise  # noqa: E402
from omniflow.models.hunyuan_image3.parts import load_image_parts  # noqa: E402
from omniflow.models.hunyuan_image3.tokens import (  # noqa: E402
    ImageTokens,
    context_ids,
    image_block,
    unconditional_ids,
)
from omniflow.models.loader import load_decoder, load_tokenizer  # noqa: E402
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 256
GRID = (16, 16)  # 256 image tokens
STEPS = 8
CFG = 2.5


# Config overrides of the tiny model family (models/tiny/hunyuan_image3.py).
WIDTHS: dict[str, dict[str, int]] = {
    "tiny": {},
    "wide": {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "attention_head_dim": 64,
        "num_experts": 8,
    },
    # HunyuanImage-3's expert layout (64 routed experts, top-8, one shared; 4:1 query to
    # KV heads) at a small hidden size: how the MoE's cost splits over many small experts.
    "moe64": {
        "hidden_size": 256,
        "intermediate_size": 192,
        "moe_intermediate_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "attention_head_dim": 32,
        "num_experts": 64,
        "moe_topk": 8,
    },
}


def rows_of(parts, latent: torch.Tensor, t: float) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([parts.timestep_row(t), parts.image_rows(latent, t)])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def row_flops(config: Any, keys: float) -> tuple[float, float]:
    """(projection and MLP FLOPs, attention FLOPs) of one row through every layer, the row
    attending to ``keys`` keys (QK and PV: 4 FLOPs per key, head and head dim)."""
    hidden, heads, kv_heads = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    dim = config.head_dim
    projections = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden
    moe_layers = config.num_hidden_layers - config.moe_layer_num_skipped
    routed = config.num_experts_per_tok + config.n_shared_experts
    moe = 3 * hidden * config.moe_intermediate_size * routed + hidden * config.n_routed_experts
    dense = 3 * hidden * config.intermediate_size
    mlp = moe * moe_layers + dense * config.moe_layer_num_skipped
    linear = 2 * (projections * config.num_hidden_layers + mlp)
    return linear, 4 * heads * dim * keys * config.num_hidden_layers


def reuse_ceiling(config: Any, context: int, block: int) -> dict[str, float]:
    """What reusing the context's KV can save at most: a guided step forwards 2 x ``block``
    rows (cond and uncond halves) over ``context`` cached keys each; recomputing forwards the
    2 x ``context`` rows (causal) as well. Rows, attention FLOPs, all FLOPs: recompute/reuse."""
    block_linear, block_attention = row_flops(config, context + block)
    context_linear, _ = row_flops(config, 0)
    _, causal = row_flops(config, (context + 1) / 2)  # the mean key count of a causal row
    reuse = 2 * block * (block_linear + block_attention)
    recompute = reuse + 2 * context * (context_linear + causal)
    attention = (block * block_attention + context * causal) / (block * block_attention)
    return {
        "step_reuse_ceiling_rows": round((block + context) / block, 3),
        "step_reuse_ceiling_attention_flops": round(attention, 3),
        "step_reuse_ceiling_flops": round(recompute / reuse, 3),
    }


def step_figures(folder: Path, prompt: list[int], rounds: int) -> dict[str, float]:
    """A guided step over a kept prefix, over a recomputed one; CFG paired, sequential."""
    parts = load_image_parts(folder)
    tokens = ImageTokens.from_tokenizer(load_tokenizer(folder))
    base = parts.config.image_base_size
    cond = context_ids(tokens, prompt, base, 0)
    uncond = context_ids(tokens, unconditional_ids(tokens, prompt), base, 0)
    model = load_decoder(folder, "cpu")
    engine = LLMEngine(model, EngineConfig(device="cpu"))
    fresh = LLMEngine(model, EngineConfig(device="cpu", enable_prefix_caching=False))
    rows = rows_of(parts, initial_noise((parts.config.latent_channels, *GRID), 0), 500.0)
    positions = image_block(len(cond), GRID).positions
    engine.keep_context("pair", cond, guidance=Guidance(uncond, CFG, combine=False))
    engine.keep_context("cond", cond)
    engine.keep_context("uncond", uncond)
    counter = iter(range(1 << 30))

    def step(engine: LLMEngine, context: str) -> None:
        engine.block_step(f"s{next(counter)}", context, rows, positions, 1)  # as denoise
        engine.run_to_completion()

    def recompute() -> None:
        name = f"c{next(counter)}"
        fresh.keep_context(name, cond, guidance=Guidance(uncond, CFG, combine=False))
        step(fresh, name)
        fresh.release(name)

    def sequential() -> None:
        step(engine, "cond")
        step(engine, "uncond")

    for context in ("pair", "cond", "uncond"):
        step(engine, context)  # computes each kept prefix once
    recompute()  # warm-up
    reuse, again, paired, apart = [], [], [], []
    for _ in range(rounds):
        reuse.append(timed(lambda: step(engine, "pair")))
        again.append(timed(recompute))
        paired.append(timed(lambda: step(engine, "pair")))
        apart.append(timed(sequential))
    block = GRID[0] * GRID[1] + 1  # the <timestep> row and the image rows
    return reuse_ceiling(model.config, len(cond), block) | {
        "step_ms_reuse": median(reuse),
        "step_ms_recompute": median(again),
        "cfg_batched_ms": median(paired),
        "cfg_sequential_ms": median(apart),
    }


def weight_figures(records: dict) -> tuple[float, float]:
    """Backbone MB resident in ar + diffusion (a shared page counted once), and in one role."""
    seen, total = set(), 0
    for role in ("ar", "diffusion"):
        record = records[role]
        for address, nbytes in record.meta["weights"]["tensors"]:
            where = mapping_at(address, record.pid)
            key = (where.path, where.offset) if where.path.startswith("/dev/shm/") else None
            if key is None or key not in seen:
                total += nbytes
            if key is not None:
                seen.add(key)
    one = records["ar"].meta["weights"]["bytes"]
    return total / 2**20, one / 2**20


def deployment_config(work: Path, separate: bool) -> Any:
    """configs/hunyuan_image3.toml on the benchmark's model; ``separate``: the same runtime
    and roles configured as separate stages (each role its own weights, diffusion computes
    the prompt's KV itself: share_weights, lend_kv and reuse_prefix false)."""
    raw = tomllib.loads((ROOT / "configs" / "hunyuan_image3.toml").read_text())
    raw.pop("gateway", None)
    for role in raw["roles"].values():
        role["options"]["model_path"] = str(work / "model")
    raw["roles"]["diffusion"]["options"]["steps"] = STEPS
    if separate:
        raw["name"] += "_stages"
        raw["roles"]["ar"]["options"] |= {"share_weights": False, "lend_kv": False}
        raw["roles"]["diffusion"]["options"] |= {"share_weights": False, "reuse_prefix": False}
    return parse(raw)


async def deployment_figures(work: Path, rounds: int) -> dict:
    """The shared deployment and the separate-stage one, both up, requests interleaved. Each
    round sends a new prompt (to both): a repeated one would be served from either
    deployment's prefix cache, hiding the recompute the separate stages pay."""
    params = {"size": f"{GRID[1] * 16}x{GRID[0] * 16}", "seed": 3, "cfg_scale": CFG}
    shared_config, stages_config = deployment_config(work, False), deployment_config(work, True)
    async with omniflow.Runtime(shared_config) as rt, omniflow.Runtime(stages_config) as st:
        assert rt.client is not None
        records = {r.role: r for r in await list_actors(rt.client.registry, shared_config.name)}
        two, one = weight_figures(records)
        for deployment in (rt, st):  # warm-up
            await deployment.call({"text": prompt_text(work / "model")}, params=params, timeout=300)
        served, separate = [], []
        for index in range(rounds):
            text = prompt_text(work / "model", index + 1)
            for deployment, times in ((rt, served), (st, separate)):
                start = time.perf_counter()
                await deployment.call({"text": text}, params=params, timeout=300)
                times.append(time.perf_counter() - start)
    return {
        "weights_mb_two_roles": two,
        "weights_mb_one_role": one,
        "t2i_s": median(served),
        "t2i_separate_stages_s": median(separate),
        "t2i_s_all": served,
        "t2i_separate_stages_s_all": separate,
    }


def prompt_text(folder: Path, variant: int = 0) -> str:
    """A text of exactly PROMPT_TOKENS tokens for the tiny tokenizer; each ``variant`` starts
    with another word, so no two share a cached prefix."""
    tokenizer = load_tokenizer(folder)
    words = "a red cube on a wooden table under soft light".split()
    words = [f"{variant}", *words] if variant else words
    text, n = "", 0
    while n < PROMPT_TOKENS:
        text = " ".join(words[i % len(words)] for i in range(n + 1))
        n = len(tokenizer.encode(text, add_special_tokens=False))
    ids = tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
    return tokenizer.decode(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--width",
        choices=sorted(WIDTHS),
        default="wide",
        help="wide (default): the tiny family at widths where the model's compute, not "
        "Python's per-op overhead, fills a step; moe64: the real model's expert layout (64 "
        "experts, top-8, one shared) at hidden 256; tiny: the shipped config's 64-wide model",
    )
    parser.add_argument(
        "--part",
        choices=("all", "steps", "t2i"),
        default="all",
        help="steps: the per-step figures only; t2i: the deployments only",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cpu: {cpu_name()}; torch threads {torch.get_num_threads()}", flush=True)
    short_run_root()
    work = scratch_dir("ofb-hy-")
    build_tiny_hunyuan_image3(work / "model", 0, **WIDTHS[args.width])
    print(f"model: {args.width} {WIDTHS[args.width] or '(the shipped tiny config)'}", flush=True)
    text = prompt_text(work / "model")
    prompt = load_tokenizer(work / "model").encode(text, add_special_tokens=False)
    print(f"prompt: {len(prompt)} tokens, image: {GRID[0] * GRID[1]} tokens", flush=True)
    result: dict[str, Any] = {}
    if args.part in ("all", "steps"):
        result |= step_figures(work / "model", prompt, 3 * args.rounds)  # cheap: more rounds
    if args.part in ("all", "t2i"):
        result |= asyncio.run(deployment_figures(work, args.rounds))
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    result["cpu"] = cpu_name()
    result["width"] = args.width
    emit(result)


if __name__ == "__main__":
    main()
