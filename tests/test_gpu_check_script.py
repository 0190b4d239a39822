"""scripts/gpu_check.sh on a machine without a GPU: valid bash, a clear no-GPU exit, and
(with a stand-in nvidia-smi) its steps' failures reported in the one JSON line it ends on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out"), **env}
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=300
    )


def test_the_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path: Path) -> None:
    done = _run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(tmp_path / "no-such-nvidia-smi"))
    assert done.returncode == 2
    assert "no NVIDIA GPU here" in done.stderr and "still to be run" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"gpu_check": "no_gpu", "gpu": None}


def test_a_failing_step_is_named_and_reported_in_the_json(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Stand-in GPU, 00000000:3B:00.0, 1 MiB'\n")
    smi.chmod(0o755)
    done = _run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(smi), GPU_CHECK_ONLY="transport")
    last = json.loads(done.stdout.splitlines()[-1])
    assert last["gpu_check"] == "ran" and last["gpu"].startswith("Stand-in GPU")
    if not _has_cuda():  # benchmarks/transport.py --device cuda refuses: no CUDA device
        assert last["transport"]["rc"] == "1" and "transport failed (exit 1)" in done.stderr
        assert "no CUDA device visible" in done.stderr
    assert last["tests"]["rc"] == "absent" and last["hop"]["rc"] == "absent"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
