"""`omniflow up` refuses a bad config before starting anything: exit 2, the file, table and
field in the message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.bad_configs import CASES, write
from tests.helpers import cli


@pytest.mark.parametrize("old, new, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_up_with_a_bad_config_exits_2_naming_file_table_and_field(
    tmp_path, run_root, old, new, message
):
    write(tmp_path, old, new)
    proc = cli("up", "bad.toml", check=False, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"config error: bad.toml: {message}" in proc.stderr
    assert not list(run_root.iterdir())  # no run directory: nothing started
    assert not (tmp_path / "models").exists()


def test_up_names_a_missing_file():
    proc = cli("up", "no/such.toml", check=False, timeout=60)
    assert proc.returncode == 2
    assert "no/such.toml: cannot read" in proc.stderr


def test_checking_the_shipped_roles_options_imports_no_torch(tmp_path):
    code = (
        "import sys; from omniflow.runtime.config import load; "
        "load(sys.argv[1]); print('torch' in sys.modules)"
    )
    path = write(tmp_path, "", "")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.stdout.strip() == "False", proc.stderr
