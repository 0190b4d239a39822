"""docs/config.md's config reference is what scripts/config_reference.py generates from the Structs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_hold_the_generated_config_reference():
    script = ROOT / "scripts" / "config_reference.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() in (ROOT / "docs" / "config.md").read_text(), (
        "docs/config.md's config reference is stale: run python scripts/config_reference.py --write"
    )
