"""`send --text-file PATH` and `--text -` (stdin) for long prompts; `up` finds the
gateway's port taken before any model loads."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.cli.conftest import ECHO_TOML
from tests.helpers import cli, expected_echo


def test_text_from_a_file_and_from_stdin(detached, tmp_path):
    words = "some long prompt " * 50
    (tmp_path / "prompt.txt").write_text(words)
    from_file = cli("send", "--run-dir", str(detached), "--text-file", str(tmp_path / "prompt.txt"))
    from_stdin = subprocess.run(
        [sys.executable, "-m", "omniflow.cli", "send", "--run-dir", str(detached), "--text", "-"],
        input=words,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert from_stdin.returncode == 0, from_stdin.stderr
    expected = "".join(expected_echo(words))
    assert from_file.stdout.strip() == from_stdin.stdout.strip() == expected.strip()
    both = cli("send", "--run-dir", str(detached), "--text", "x", "--text-file", "y", check=False)
    assert both.returncode == 2 and "--text-file" in both.stderr
    missing = cli("send", "--run-dir", str(detached), "--text-file", "/no/such", check=False)
    assert missing.returncode == 2 and "/no/such" in missing.stderr


def test_a_taken_gateway_port_fails_the_start_before_any_worker(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        run_dir = Path(tempfile.mkdtemp(prefix="of-port-", dir="/tmp"))
        proc = cli("up", ECHO_TOML, "-d", "--run-dir", str(run_dir), "--port", str(port),
                   check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert not list(run_dir.glob("logs/*.log"))  # no worker was started


def test_down_all_stops_every_local_deployment(run_root):
    configs = []
    for name in ("one", "two"):
        text = Path(ECHO_TOML).read_text().replace('name = "echo"', f'name = "{name}"')
        path = run_root / f"{name}.toml"
        path.write_text(text.replace("port = 8000", "port = 0"))
        configs.append(path)
        cli("up", str(path), "-d")
    plain = cli("down", check=False)
    assert plain.returncode == 2 and "several deployments" in plain.stderr
    stopped = cli("down", "--all")
    assert "stopped one" in stopped.stdout and "stopped two" in stopped.stdout
    assert cli("status", check=False).returncode == 3
