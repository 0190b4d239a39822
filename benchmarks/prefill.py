"""Prefill and time to first token on CPU, with AMX and without, against a baseline checkout.

The workload of benchmarks/engine.py on its tiny model: TTFT of a 1,024-token prefix + 16
with prefix caching off (uncached) and on (cached), 32 prompts of 128 tokens until each has
its first token (prefill), then their decode steps and tokens/s over --output-len tokens.

Each variant is one long-lived worker process (this file with --serve), its engines loaded
once; the driver runs the rounds interleaved (A B A B ...) and reports medians. Variants:
this checkout and, with --baseline PATH, another one (e.g. a worktree of main), and with
--preload this checkout with the allocator and OpenMP runtime that workers preload
(omniflow/runtime/preload.py; the others run without), each with the kernels' AMX paths on
and off (--amx). "Off" stands in for a CPU without AMX (as the
AMD Zen CPUs with AVX-512 BF16): the kernels' AMX paths off (CpuKernels.amx False), oneDNN
held to AVX-512 BF16 (ONEDNN_MAX_CPU_ISA) and MKL to AVX-512 without AMX
(MKL_ENABLE_INSTRUCTIONS=AVX512_E3), so PyTorch's own bf16 GEMMs (SDPA's) lose AMX too.

Prints a JSON object as its last line: "cpu", "amx" (whether this CPU has it), and per
variant ("this-amx", "this-noamx", "baseline-amx", "preload-amx", ...) ttft_uncached_ms, ttft_cached_ms,
prefill_ms, decode_step_ms, tokens_per_s; with a baseline, "this_speedup" per AMX setting: the
median over rounds of baseline / this TTFT uncached and prefill (this / baseline tokens/s)
within the round; with --preload, "preload_speedup" alike, preload against this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# What stands in for a CPU without AMX, beside CpuKernels.amx = False in the worker.
NO_AMX_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"}
FIGURES = ("ttft_uncached_ms", "ttft_cached_ms", "prefill_ms", "decode_step_ms", "tokens_per_s")


def worker(folder: str, amx: bool, args) -> None:
    """Serve rounds on stdin ("round N" lines), one JSON line of figures each on stdout."""
    import torch
    from engine import omniflow_throughput, random_prompts, ttft_ms

    from omniflow.engine import LLMEngine
    from omniflow.engine.llm_engine import EngineConfig
    from omniflow.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is not None and not amx:
        kernels.amx = False  # before any engine reads it (a baseline may lack the switch)
    # 256 MB of pages (32k tokens of this model) an engine: six workers of two engines at
    # the default 1 GB are more than a small machine holds.
    config = EngineConfig(device="cpu", dtype="bfloat16", max_num_seqs=64, kv_cache_bytes=1 << 28)
    cached_engine = LLMEngine(folder, config)
    uncached_engine = LLMEngine(folder, replace(config, enable_prefix_caching=False))
    vocab = cached_engine.vocab_size
    [prefix] = random_prompts(1, args.prefix_len, vocab, seed=1000)
    warm = random_prompts(4, 16, vocab, seed=99)
    with torch.inference_mode():
        for engine in (cached_engine, uncached_engine):
            omniflow_throughput(engine, warm, 4, "warmup")
            ttft_ms(engine, prefix + [5], "prefix-warm")
    print(json.dumps({"ready": True, "amx": bool(kernels and kernels.amx)}), flush=True)
    for line in sys.stdin:
        index = int(line.split()[1])
        [suffix] = random_prompts(1, 16, vocab, seed=2000 + index)
        prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=index)
        with torch.inference_mode():
            uncached = ttft_ms(uncached_engine, prefix + suffix, f"u{index}")
            cached = ttft_ms(cached_engine, prefix + suffix, f"c{index}")
            rate, prefill_s, step_s = omniflow_throughput(
                uncached_engine, prompts, args.output_len, f"t{index}"
            )
        figures = [uncached, cached, prefill_s * 1e3, step_s * 1e3, rate]
        print(json.dumps(dict(zip(FIGURES, figures, strict=True))), flush=True)


class Variant:
    def __init__(self, name: str, tree: Path, amx: bool, preload: bool, folder: str, args):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
        if not amx:
            env.update(NO_AMX_ENV)
        if preload:  # as the supervisor spawns workers
            from omniflow.runtime.preload import worker_env

            env = worker_env(env)
            print(f"{name}: LD_PRELOAD={env.get('LD_PRELOAD', '')}")
        command = [sys.executable, __file__, "--serve", folder, "--amx-on" if amx else ""]
        command += [f"--prefix-len={args.prefix_len}", f"--requests={args.requests}"]
        command += [f"--prompt-len={args.prompt_len}", f"--output-len={args.output_len}"]
        self.name = name
        self.process = subprocess.Popen(
            [part for part in command if part],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.rounds: list[dict[str, float]] = []
        self.ready = self._read()

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited ({self.process.wait()})")
        return json.loads(line)

    def run(self, index: int) -> dict[str, float]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"round {index}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"{self.name}: the worker exited ({self.process.wait()})") from None
        self.rounds.append(self._read())
        return self.rounds[-1]

    def medians(self) -> dict[str, float]:
        return {name: round(statistics.median(r[name] for r in self.rounds), 2) for name in FIGURES}

    def close(self) -> None:
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        self.process.wait(timeout=60)


def _gain(name: str, slower: float, faster: float) -> float:
    """How many times better `faster` is: a time's ratio slower / faster, a rate's inverse."""
    return faster / slower if name == "tokens_per_s" else slower / faster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--amx", choices=["on", "off", "both"], default="both")
    parser.add_argument("--baseline", type=Path, help="another checkout to compare against")
    parser.add_argument(
        "--preload",
        action="store_true",
        help="also this checkout with the libraries workers preload (runtime/preload.py, "
        "OMNIFLOW_PRELOAD choosing which); the other variants run in this environment as is",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--amx-on", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        worker(args.serve, args.amx_on, args)
        return

    import torch
    from _common import scratch_dir
    from engine import cpu_name

    from omniflow.kernels import cpu_kernels
    from omniflow.models import build_tiny_model

    kernels = cpu_kernels()
    has_amx = bool(kernels is not None and kernels.amx)
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.amx]
    if not has_amx:
        settings = [False]
    folder = str(build_tiny_model(scratch_dir("omniflow-prefill-"), "llama-bench-30m"))
    trees = {"this": HERE.parent}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve()
    print(f"cpu: {cpu_name()}, amx: {has_amx}, threads={torch.get_num_threads()}")
    runs = [(name, tree, False) for name, tree in trees.items()]
    if args.preload:
        runs.append(("preload", trees["this"], True))
    variants = [
        Variant(f"{name}-{'amx' if amx else 'noamx'}", tree, amx, preload, folder, args)
        for amx in settings
        for name, tree, preload in runs
    ]
    try:
        for index in range(args.rounds):
            for variant in variants:
                figures = variant.run(index)
                print(
                    f"round {index} {variant.name}: "
                    + ", ".join(f"{name} {value:.1f}" for name, value in figures.items())
                )
    finally:
        for variant in variants:
            variant.close()
    result: dict = {"cpu": cpu_name(), "amx": has_amx, "rounds": args.rounds}
    result["variants"] = {variant.name: variant.medians() for variant in variants}
    # Paired per round: baseline / this (and this / preload), TTFT uncached and prefill.
    pairs = [("baseline", "this")] if args.baseline else []
    pairs += [("this", "preload")] if args.preload else []
    for slower, faster in pairs:
        speedup = {}
        for amx in settings:
            suffix = "amx" if amx else "noamx"
            base, mine = (
                next(v for v in variants if v.name == f"{n}-{suffix}") for n in (slower, faster)
            )
            speedup[suffix] = {
                name: round(
                    statistics.median(
                        _gain(name, b[name], m[name])
                        for m, b in zip(mine.rounds, base.rounds, strict=True)
                    ),
                    3,
                )
                for name in ("ttft_uncached_ms", "prefill_ms", "tokens_per_s")
            }
        result[f"{faster}_speedup"] = speedup
    print(json.dumps(result))


if __name__ == "__main__":
    main()
