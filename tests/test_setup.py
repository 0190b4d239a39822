"""scripts/setup.sh never installs into an externally managed interpreter (PEP 668).

On a stock Debian 12 / Ubuntu 24.04 machine /usr/bin/python3 is marked externally managed
and refuses ``pip install``; setup makes a virtual environment with it and installs there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"
SYSTEM_PYTHON = "/usr/bin/python3"

# What pip itself asks (pip._internal.utils.misc.check_externally_managed): an interpreter
# is externally managed when it is not a virtual environment's and its stdlib holds the
# EXTERNALLY-MANAGED marker.
PROBE = """import json, os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print(json.dumps({"prefix": sys.prefix, "base_prefix": sys.base_prefix,
                  "marker": os.path.isfile(marker)}))"""


def probe(python: str) -> dict:
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="no /usr/bin/python3")
def test_setup_installs_into_a_venv_made_with_the_system_python(tmp_path: Path) -> None:
    if subprocess.run([SYSTEM_PYTHON, "-c", "import ensurepip, venv"]).returncode:
        pytest.skip(
            f"{SYSTEM_PYTHON} has no venv module; `PYTHON={SYSTEM_PYTHON} "
            "bash scripts/setup.sh` installs it (python3.X-venv)"
        )
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": SYSTEM_PYTHON, "OMNIFLOW_VENV": str(venv)}
    out = subprocess.run(
        ["bash", str(SETUP), "--print-python"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    target = out.stdout.strip()
    assert target == str(venv / "bin" / "python")

    system, installed = probe(SYSTEM_PYTHON), probe(target)
    assert installed["prefix"] != installed["base_prefix"], "pip's target is no venv"
    assert os.path.realpath(installed["prefix"]) == os.path.realpath(venv)
    assert installed["base_prefix"] == system["base_prefix"], "venv not made with $PYTHON"
    assert not (installed["prefix"] == installed["base_prefix"] and installed["marker"])

    # A second run reuses the environment rather than remaking it.
    stamp = (venv / "pyvenv.cfg").stat().st_mtime_ns
    again = subprocess.run(
        ["bash", str(SETUP), "--print-python"], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and again.stdout.strip() == target, again.stderr
    assert (venv / "pyvenv.cfg").stat().st_mtime_ns == stamp


def test_every_pip_call_in_setup_goes_through_the_checked_interpreter() -> None:
    """--print-python prints $VPY; every pip call must install into exactly that one."""
    calls = [
        line.strip()
        for line in SETUP.read_text().splitlines()
        if re.search(r"\bpip\b", line) and not line.lstrip().startswith("#")
    ]
    pip_calls = [line for line in calls if re.search(r"-m pip\b|\bpip3? install\b", line)]
    assert pip_calls, "setup.sh has no pip call left to check"
    for line in pip_calls:
        assert line.startswith('"$VPY" -m pip '), f"pip call outside the venv: {line}"
