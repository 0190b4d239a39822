"""`omniflow send --size` on the LongCat deployment: its roles read ``image_grid``, and the
CLI maps the size onto that token grid as the gateway does (a side of n tokens is
max(16, ceil(28 n / 16) * 16) px); a side that is no LongCat side is refused (exit 2),
naming --size and the nearest sides, before anything is sent."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def longcat():
    work = Path(tempfile.mkdtemp(prefix="of-lcs-", dir="/tmp"))
    (work / "longcat.toml").write_text((ROOT / "configs" / "longcat.toml").read_text())
    run_dir = work / "run"
    cli("up", "longcat.toml", "-d", "--run-dir", str(run_dir), "--port", "0", cwd=work)
    try:
        yield run_dir
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        shutil.rmtree(work, ignore_errors=True)


def _send(run_dir: Path, *args: str):
    out = run_dir.parent / "out"
    return cli("send", "--run-dir", str(run_dir), "--out", str(out), *args, check=False)


def test_size_becomes_the_token_grid_and_the_png_has_it(longcat):
    sent = _send(longcat, "-t", "a cat", "--want", "image", "--size", "112x144", "--json")
    assert sent.returncode == 0, sent.stderr
    files = [f for f in json.loads(sent.stdout)["files"] if f.endswith(".png")]
    assert len(files) == 1, sent.stdout
    with Image.open(files[0]) as png:
        assert png.size == (112, 144)  # 4 x 5 tokens


def test_a_side_that_is_no_longcat_side_is_refused_naming_size(longcat):
    sent = _send(longcat, "-t", "a cat", "--want", "image", "--size", "128x128")
    assert sent.returncode == 2, sent.stderr
    assert "--size 128x128" in sent.stderr and "nearest: [112, 144]" in sent.stderr
    assert "no role" not in sent.stderr
    auto = _send(longcat, "-t", "a cat", "--want", "image", "--size", "auto")
    assert auto.returncode == 2 and "--size auto: expected WIDTHxHEIGHT" in auto.stderr
    both = _send(longcat, "-t", "x", "--size", "112x112", "-p", "image_grid=[4,4]")
    assert both.returncode == 2 and "give one of them" in both.stderr
