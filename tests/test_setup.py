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
        line = re.sub(r'^step "[^"]*" ', "", line)  # a timed step runs the same command
        assert line.startswith('"$VPY" -m pip '), f"pip call outside the venv: {line}"


def setup_functions(*names: str) -> str:
    """The bash text of setup.sh's functions ``names`` (to run them alone)."""
    text = SETUP.read_text()
    return "\n".join(
        re.search(rf"^{name}\(\) {{\n.*?^}}$", text, re.M | re.S).group(0) for name in names
    )


def test_each_step_says_what_it_does_and_how_long_it_took(tmp_path: Path) -> None:
    script = setup_functions("step") + '\nstep "a short wait" sleep 1\nstep "nothing" true\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "setup: a short wait ...",
        "setup: a short wait: done in 1s",
        "setup: nothing ...",
        "setup: nothing: done in 0s",
    ]
    failing = subprocess.run(
        ["bash", "-c", setup_functions("step") + "\nstep 'broken' false || echo failed"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert failing.stdout.strip() == "failed"
    assert failing.stderr.splitlines()[-1] == "setup: broken: failed after 0s"


@pytest.mark.slow  # a venv and a pip resolve: ~10 s
def test_without_a_gpu_torch_asks_the_cpu_index_first_and_still_installs_here(
    tmp_path: Path,
) -> None:
    """The CPU index is asked first (here: one that cannot be reached) and the pinned
    CPU torch still resolves from what pip is configured with on this machine (its local
    wheels); pip resolves only (PIP_DRY_RUN): nothing is installed."""
    text = SETUP.read_text()
    assert text.index("install_cpu_torch ||") < text.index('-e ".[${EXTRAS}]"')
    assert "https://download.pytorch.org/whl/cpu" in text
    venv = tmp_path / "venv"
    subprocess.run([os.sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    unreachable = "http://127.0.0.1:9/simple"
    script = (
        f"VPY={venv}/bin/python\nTORCH_CPU_INDEX={unreachable}\n"
        + setup_functions("install_cpu_torch")
        + "\ninstall_cpu_torch\n"
    )
    report = tmp_path / "report.json"  # pip's installation report: what it would install
    env = {**os.environ, "PIP_DRY_RUN": "1", "PIP_REPORT": str(report)}
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    pin = (ROOT / "constraints-cpu.txt").read_text().split("torch==")[1].split()[0]
    would = {
        i["metadata"]["name"]: i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert would["torch"] == f"{pin}+cpu", would
    # The CPU index was asked for torch (here: refused, at once).
    assert "Connection refused" in out.stderr and "/simple/torch/" in out.stderr
