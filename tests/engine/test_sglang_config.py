"""Engine and role configs that pick backend "sglang" are checked when they load, without
SGLang installed: what it cannot serve, what is missing, another SGLang version."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.sglang_backend import SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
from omniflow.engine.llm_engine import EngineConfig
from omniflow.roles.options import LLMOptions
import msgspec
try:
    EngineConfig(backend="sglang")
except ValueError as error:
    print("engine:", error)
try:
    msgspec.convert({"model_path": ".", "backend": "sglang"}, LLMOptions)
except Exception as error:
    print("role:", error)
"""


def probe(*path: Path) -> str:
    """What loading the configs says, in a Python that sees only omniflow and ``path``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*path, ROOT]))
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout


def fake_sglang(root: Path, version: str) -> Path:
    """An installed distribution named sglang at ``version`` (metadata and a package)."""
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    info = root / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return root


def test_config_load_refuses_compute_flow_it_cannot_serve():
    with pytest.raises(ValueError, match="flow.*sglang.*codes_heads, block_steps"):
        EngineConfig(backend="sglang", flow=("codes_heads", "block_steps"))
    with pytest.raises(ValueError, match="flow: unknown operation.*'lora'"):
        EngineConfig(flow=("lora",))
    with pytest.raises(ValueError, match="backend must be one of"):
        EngineConfig(backend="vllm")
    EngineConfig(backend="torch", flow=("codes_heads", "block_steps"))  # the torch backend does


def test_another_sglang_version_is_refused_naming_the_pinned_one(tmp_path):
    out = probe(fake_sglang(tmp_path, "0.5.22"))
    for line in out.splitlines():
        assert f"sglang=={SGLANG_VERSION}" in line and "found 0.5.22" in line
    assert "engine: engine config field backend 'sglang' needs sglang==" in out
    assert "role: backend: 'sglang' needs sglang==" in out


def test_without_sglang_kernels_config_load_says_what_is_missing(tmp_path):
    # The pinned version without the CUDA-only modules it imports (a CPU machine).
    out = probe(fake_sglang(tmp_path, SGLANG_VERSION))
    if "SGLang's kernels" not in out:
        pytest.skip("sgl_kernel and torchvision are installed here (a GPU machine)")
    assert "engine: engine config field backend 'sglang' needs SGLang's kernels" in out
    assert "sgl_kernel" in out and "torchvision" in out
    assert "role: backend: 'sglang' needs SGLang's kernels" in out
