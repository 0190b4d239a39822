"""README's embedding examples run as written: the embedded Runtime beside an `omniflow up`
of the same config, and connect() to that deployment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import cli, expected_echo

ROOT = Path(__file__).resolve().parents[2]


def _example(label: str) -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- example: {label} .*?-->\n```python\n(.*?)```", readme, re.S)
    assert found, f"README.md has no '{label}' example"
    return found.group(1)


def _run(code: str) -> subprocess.CompletedProcess:
    # From the project root, as a user who copied it into a file there would.
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_readme_examples_run_as_written(run_root):
    # The user's deployment of the same config runs first, on the default run dir and port.
    cli("up", "configs/echo.toml", "-d", cwd=ROOT)
    try:
        embedded = _run(_example("embedded"))
        assert embedded.returncode == 0, embedded.stderr
        lines = embedded.stdout.splitlines()
        assert lines[0].startswith("Output(role='reverse'")
        assert any(line.startswith("Result(request_id=") for line in lines)
        assert lines[-1].split()[0] == expected_echo("hi")[0]
        attached = _run(_example("attached"))
        assert attached.returncode == 0, attached.stderr
        assert attached.stdout.startswith("".join(expected_echo("hi there")))
    finally:
        cli("down", "--name", "echo", check=False)
    assert os.listdir(run_root) == ["echo"]  # the embedded one used a run dir of its own
