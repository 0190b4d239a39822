"""The layer contracts (.importlinter) hold, and they would catch an upward import; the
CLI's control commands import no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(tree / ".importlinter"), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("layers")
    shutil.copytree(ROOT / "omniflow", tree / "omniflow", ignore=shutil.ignore_patterns("*.so"))
    shutil.copy(ROOT / ".importlinter", tree)
    return tree


def test_the_tree_keeps_every_contract(tree_copy: Path) -> None:
    result = lint_imports(tree_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("memory/errors.py", "import omniflow.runtime.client"),  # memory -> runtime
        ("kv/radix.py", "import omniflow.engine.sampler"),  # kv -> compute
        ("engine/sampler.py", "import omniflow.transport.endpoint"),  # compute -> sockets
        ("control/join.py", "import omniflow.memory.pool"),  # control -> memory, directly
        ("runtime/actor.py", "import omniflow.cli.app"),  # anything -> cli
    ],
)
def test_an_upward_import_is_rejected(tree_copy: Path, module: str, upward: str) -> None:
    path = tree_copy / "omniflow" / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{upward}  # noqa\n")
        result = lint_imports(tree_copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert upward.split()[1] in result.stdout


def test_the_cli_imports_no_torch() -> None:
    code = "import sys, omniflow.cli.app; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]


def test_a_model_free_deployment_imports_no_torch(run_root: Path) -> None:
    """The echo deployment's supervisor and workers never map libtorch."""

    def omniflow(*args: str) -> str:
        cmd = [sys.executable, "-m", "omniflow.cli", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout

    omniflow("up", "configs/echo.toml", "--detach")
    try:
        state = json.loads(omniflow("status", "--json"))
        pids = [state["supervisor_pid"], *(actor["pid"] for actor in state["actors"])]
        assert len(pids) == 5  # the supervisor, upper, two reverse, the gateway
        assert "OLLEH" in omniflow("send", "--text", "hello")
        for pid in pids:
            assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
    finally:
        omniflow("down")
