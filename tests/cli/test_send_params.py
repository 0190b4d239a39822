"""`omniflow send` checks its arguments before sending: keys, types, shapes (exit 2).

The roles declare the parameters they read; a bad range comes back as bad_request, also
exit 2, printed as plain text on one line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers import cli

PAINTER_TOML = """
name = "painter"
[roles.paint]
actor = "tests.cli.param_roles:Painter"
[graph]
edges = [{ from = "input", to = "paint" }]
"""


@pytest.fixture(scope="module")
def painter():
    root = Path(tempfile.mkdtemp(prefix="of-par-", dir="/tmp"))
    (root / "painter.toml").write_text(PAINTER_TOML)
    run_dir = root / "painter"
    cli("up", str(root / "painter.toml"), "-d", "--run-dir", str(run_dir))
    try:
        yield run_dir
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        shutil.rmtree(root, ignore_errors=True)


def _send(run_dir, *args):
    return cli("send", "--run-dir", str(run_dir), "--out", str(run_dir / "out"), *args, check=False)


def test_first_class_options_reach_the_role_as_params(painter):
    sent = _send(
        painter,
        "-t",
        "a cat",
        "--seed",
        "7",
        "--steps",
        "9",
        "--cfg-scale",
        "1.5",
        "--size",
        "64x32",
        "--json",
    )
    assert sent.returncode == 0, sent.stderr
    got = json.loads(json.loads(sent.stdout)["text"])
    assert got == {"seed": 7, "steps": 9, "cfg_scale": 1.5, "size": "64x32"}


def test_the_same_params_pass_as_param_pairs(painter):
    sent = _send(painter, "-t", "a cat", "-p", "seed=3", "-p", "size=auto", "--json")
    assert sent.returncode == 0, sent.stderr
    got = json.loads(json.loads(sent.stdout)["text"])
    assert (got["seed"], got["size"]) == (3, "auto")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-p", "cfg_scale=abc"], '--param cfg_scale="abc": Expected `float`, got `str`'),
        (["-p", "steps=[1, 2]"], "--param steps=[1, 2]: Expected `int`, got `array`"),
        (["-p", "step=2"], "--param step: no role of painter reads it (did you mean steps?)"),
        (["--size", "64"], "--size '64': expected WIDTHxHEIGHT"),
        (["--size", "64x"], "--size '64x': expected WIDTHxHEIGHT"),
        (["--want", "video"], "--want 'video': expected some of text,image,audio"),
        (["-p", "noequals"], "--param 'noequals': expected KEY=VALUE"),
        (["--timeout", "0"], "--timeout 0: expected seconds > 0"),
        (["--timeout", "-1"], "--timeout -1: expected seconds > 0"),
    ],
)
def test_a_bad_argument_exits_2_naming_it_before_sending(painter, args, named):
    sent = _send(painter, "-t", "x", *args)
    assert sent.returncode == 2, sent.stderr
    assert named in sent.stderr  # as typed: brackets and backticks not eaten as markup
    assert sent.stdout == ""


def test_a_wrong_type_for_a_first_class_option_exits_2(painter):
    sent = _send(painter, "-t", "x", "--seed", "abc")
    assert sent.returncode == 2
    assert "--seed" in sent.stderr


def test_send_with_no_input_is_a_usage_error(painter):
    sent = _send(painter)
    assert sent.returncode == 2
    assert "nothing to send: give --text, --text-file, --image or --audio" in sent.stderr


def test_a_range_the_role_refuses_is_bad_request_exit_2_on_one_plain_line(painter):
    sent = _send(painter, "-t", "x", "--steps", "0")
    assert sent.returncode == 2, sent.stderr
    lines = [line for line in sent.stderr.splitlines() if "request failed" in line]
    # One line however long (no wrapping at 80 columns when piped), "[bad_request]" kept.
    assert len(lines) == 1 and len(lines[0]) > 80, sent.stderr
    assert lines[0].startswith("request failed: [bad_request] paint: params.steps: ")
    assert ">= 1" in lines[0]


def test_a_role_side_error_names_the_field_in_json_too(painter):
    sent = _send(painter, "-t", "x", "--size", "4096x4096", "--json")
    assert sent.returncode == 2
    error = json.loads(sent.stdout)["error"]
    assert error["code"] == "bad_request" and error["role"] == "paint"
    assert error["message"].startswith("params.size: expected auto or up to 1024x1024")
