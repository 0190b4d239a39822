"""docs/architecture.md's "Where things are" table names only paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_paths() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def test_the_table_is_there():
    assert len(table_paths()) >= 20


def test_every_path_in_the_table_exists():
    missing = [path for path in table_paths() if not (ROOT / path).exists()]
    assert missing == []
