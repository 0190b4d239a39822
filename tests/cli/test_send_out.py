"""`omniflow send --out` is checked before the request is sent."""

from __future__ import annotations

import json

from tests.helpers import cli, expected_echo


def test_send_refuses_an_out_that_is_a_file_before_sending(detached, tmp_path):
    target = tmp_path / "taken"
    target.write_text("mine")
    sent = cli("send", "--run-dir", str(detached), "-t", "hi", "--out", str(target), check=False)
    assert sent.returncode == 2, sent.stderr
    assert "not a directory" in sent.stderr
    assert sent.stdout == ""  # nothing ran: no text streamed
    assert target.read_text() == "mine"


def test_send_creates_a_missing_out_directory(detached, tmp_path):
    target = tmp_path / "a" / "b"
    sent = cli("send", "--run-dir", str(detached), "-t", "hi", "--out", str(target), "--json")
    assert json.loads(sent.stdout)["text"] == "".join(expected_echo("hi"))
    assert target.is_dir()
